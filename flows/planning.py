"""Weaver glue for a run config: pools (declared or autodetected), stage needs from the model size, the plan.

Lives in flows because it joins forge's config with weaver (forge imports neither flows nor weaver).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from forge.config import RunConfig, read_yaml_file
from forge.errors import UserError
from weaver import discover
from weaver.errors import PlanError
from weaver.memory import Breakdown, ModelShape, TokenShape, UpdateSetup, rollout_memory, update_memory
from weaver.plan import Plan, StageNeed, plan, stage_needs
from weaver.pools import Pool, autodetect_pools, pools_from_dicts

KNOWN_PARAMS = {"smollm2-135m-instruct": 134_515_008}
KNOWN_CONFIGS = {"smollm2-135m-instruct": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                 "tie_word_embeddings": True}}  # fmt: skip
TINY_VOCAB = 99  # forge.models.build_char_tokenizer: 95 printable characters (no tabs/newlines) + 4 specials
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TEACHER_BYTES = BYTES["float32"]  # forge.rewards.teacher.Teacher loads fp32, whatever its dtype
QKV_BIAS_MODELS = ("qwen2",)  # architectures whose q/k/v projections always carry a bias


def estimate_params(cfg: RunConfig) -> int:
    """The policy's parameter count, without loading weights: exact from a local model directory's safetensors
    (file headers, else the index's byte total), else from its config.json (`params_from_config`); a hub id
    plans as 1B."""
    m = cfg.model
    if m.path in KNOWN_PARAMS:
        return KNOWN_PARAMS[m.path]
    if m.path == "tiny-random":
        return params_from_config(_tiny_config(cfg))
    d = Path(m.path).expanduser()
    if not (d / "config.json").is_file():
        return 1_000_000_000  # a hub id: plan conservatively for a 1B model
    config = _read_json(d / "config.json")
    return params_from_safetensors(d, config) or params_from_config(config)


def _tiny_config(cfg: RunConfig) -> dict:
    h = cfg.model.tiny.hidden
    heads = max(1, h // cfg.model.tiny.head_dim)
    return {"hidden_size": h, "intermediate_size": 4 * h, "num_hidden_layers": cfg.model.tiny.layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": TINY_VOCAB,
            "tie_word_embeddings": True}  # fmt: skip


def model_shape(cfg: RunConfig) -> ModelShape | None:
    """The policy's decoder shape from its config.json (or the built-in's), None where it is not known (a hub id,
    a config without Llama-style sizes)."""
    path = cfg.model.path
    if path == "tiny-random":
        config = _tiny_config(cfg)
    elif path in KNOWN_CONFIGS:
        config = KNOWN_CONFIGS[path]
    elif (Path(path).expanduser() / "config.json").is_file():
        config = _read_json(Path(path).expanduser() / "config.json")
    else:
        return None
    try:
        return ModelShape.from_config(config)
    except KeyError:  # GPT-2-style or unusual configs: the per-parameter estimate plans them
        return None


def params_from_config(c: dict) -> int:
    """Parameters of a Llama/Qwen2/Mistral-style decoder from its config.json: embeddings (+ an untied LM head),
    per layer q/o (hidden x heads*head_dim), k/v (hidden x kv_heads*head_dim, + biases where the architecture
    has them), a gated MLP (3 x hidden x intermediate) and two RMSNorms, and the final norm.

    >>> params_from_config({"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    ...     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True})
    134515008
    """
    c = c.get("text_config", c)
    h, layers, vocab = (
        c.get("hidden_size") or c.get("n_embd"),
        c.get("num_hidden_layers") or c.get("n_layer"),
        c.get("vocab_size"),
    )
    if not (h and layers and vocab):
        raise UserError("model config.json has no hidden_size/num_hidden_layers/vocab_size: cannot size the model")
    if "intermediate_size" not in c or "num_attention_heads" not in c:  # GPT-2 style blocks: 12 H^2 per layer
        return 12 * layers * h * h + vocab * h
    inter, heads = c["intermediate_size"], c["num_attention_heads"]
    kv, head_dim = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    q, kv_width = heads * head_dim, kv * head_dim
    attn = 2 * h * q + 2 * h * kv_width
    if c.get("attention_bias") or c.get("model_type") in QKV_BIAS_MODELS:
        attn += q + 2 * kv_width + (h if c.get("attention_bias") else 0)  # q/k/v biases (+ o's when declared)
    mlp = 3 * h * inter + (2 * inter + h if c.get("mlp_bias") else 0)
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)
    return layers * (attn + mlp + 2 * h) + h + embeddings


def params_from_safetensors(d: Path, config: dict) -> int:
    """Exact count from the weight files' headers (shapes only, no tensor read), else the index's total bytes /
    the config's dtype size; 0 when the directory has neither."""
    files = sorted(d.glob("*.safetensors"))
    if files:
        return sum(_header_params(f) for f in files)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        total = _read_json(index).get("metadata", {}).get("total_size", 0)
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        return int(total) // BYTES.get(dtype, 4)
    return 0


def _header_params(path: Path) -> int:
    from forge.io import check_safetensors
    from forge.models import MODEL_FIX

    check_safetensors(path, MODEL_FIX)  # a truncated file: one line naming it (not a JSONDecodeError)
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise UserError(f"cannot read '{path}': {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"cannot read '{path}': a JSON object expected, got {type(data).__name__}")
    return data


def resolve_pools(cfg: RunConfig, pools_file: str | None = None) -> list[Pool]:
    try:
        if pools_file:
            p = Path(pools_file)
            data = read_yaml_file(p, "pools file") or []
            items = data.get("pools", []) if isinstance(data, dict) else data
            return pools_from_dicts(items, source=str(p))
        if cfg.pools:
            return pools_from_dicts(cfg.pools, source="config pools")
        return autodetect_pools(discover())
    except PlanError as e:
        raise UserError(str(e)) from None


def make_plan(cfg: RunConfig, pools: list[Pool]) -> Plan:
    needs = run_needs(cfg, pools)
    try:
        return plan(needs, pools)
    except PlanError as e:
        teacher = e.stage == "teacher"  # a teacher that fits nowhere: the line names its directory
        raise UserError(f"distill.teacher '{cfg.distill.teacher}': {e}" if teacher else str(e)) from None


def run_needs(cfg: RunConfig, pools: list[Pool]) -> list[StageNeed]:
    """The stages' needs for this run on these pools (GPU memory per device sizes FSDP and the engine)."""
    gpus = [p for p in pools if p.kind == "gpu"]
    gpu = bool(gpus)
    r = cfg.rollout
    replicas = r.replicas  # rollout actors (vLLM engines or hf copies); one in-process
    vllm = r.backend == "vllm"
    gpu_gib = min((p.memory_gib for p in gpus), default=0.0)
    params = estimate_params(cfg)
    needs = stage_needs(
        params,
        rollout_replicas=replicas,
        update_processes=cfg.update.num_processes,
        gpu=gpu,
        rollout_tp=r.tensor_parallel_size if vllm else 1,
        update_sharded=cfg.update.strategy == "fsdp",
        reference_bytes_per_param=reference_bytes(cfg),
        rollout_bytes_per_param=rollout_bytes(cfg, gpu),
        engine_fraction=r.vllm.gpu_memory_utilization if vllm else 0.0,
        gpu_memory_gib=gpu_gib,
        teacher_params=teacher_params(cfg),
        teacher_bytes_per_param=TEACHER_BYTES,
        **_token_needs(cfg, gpu),
    )
    if gpu and vllm:
        _check_engine_fits(cfg, params, gpu_gib)
    return needs


def _token_needs(cfg: RunConfig, gpu: bool) -> dict:
    """stage_needs' memory-model arguments: update GiB per shard count and rollout GiB, where the shape is known
    (LoRA keeps the per-parameter estimate: its frozen base has no gradients or moments)."""
    shape = model_shape(cfg)
    if shape is None or cfg.model.lora.rank:
        return {}
    return {
        "update_gib_for": lambda shards: update_breakdown(cfg, shape, shards, gpu).total_gib,
        "rollout_gib": _rollout_floor_gib(rollout_breakdown(cfg, shape, gpu), cfg.rollout.backend == "vllm"),
    }


def _rollout_floor_gib(b: Breakdown, vllm: bool) -> float:
    """A rollout device's GiB: everything for an hf copy; without the KV cache for a vLLM engine, whose cache fills
    the fraction of the GPU it reserves (stage_needs takes the larger) and schedules fewer sequences at once when
    they do not all fit."""
    return (b.total - (dict(b.terms)["kv_cache"] if vllm else 0)) / 2**30


def update_breakdown(cfg: RunConfig, shape: ModelShape, shards: int, gpu: bool) -> Breakdown:
    """One update process's memory for this run over `shards` FSDP ranks (1 = DDP or one process): micro-batches of
    `update.micro_batch_size` rows (at most the step's B*G) of `data.max_prompt_tokens` + `rollout.max_new_tokens`
    tokens; bf16 autocast on GPUs (forge uses it on every CUDA GPU with bf16), `update.autocast_bf16` on a CPU."""
    u, r = cfg.update, cfg.rollout
    rows = min(u.micro_batch_size, r.prompts_per_step * r.group_size)
    ddp = u.num_processes if u.strategy == "ddp" else 1
    setup = UpdateSetup(
        master_bytes=BYTES[cfg.model.dtype], autocast_bf16=gpu or u.autocast_bf16,
        gradient_checkpointing=cfg.model.gradient_checkpointing, shards=shards, ddp_world=max(1, ddp),
        completion_only=u.logits_completion_only, reference_bytes=reference_bytes(cfg),
    )  # fmt: skip
    return update_memory(shape, TokenShape(rows, cfg.data.max_prompt_tokens, r.max_new_tokens), setup)


def rollout_breakdown(cfg: RunConfig, shape: ModelShape, gpu: bool) -> Breakdown:
    """One rollout device's memory: weights in the rollout's dtype (1/tp each), the KV cache of its concurrent
    sequences (an hf copy: `rollout.batch_size` at a time; a vLLM engine: the step's B*G over the replicas) of
    prompt + completion tokens in that dtype, one weight-sync bucket (and, vLLM, the layer its reload holds)."""
    r = cfg.rollout
    vllm = r.backend == "vllm"
    tp = r.tensor_parallel_size if vllm and gpu else 1
    sequences = -(-r.prompts_per_step * r.group_size // max(1, r.replicas)) if vllm else r.batch_size
    dtype = rollout_bytes(cfg, gpu)
    tokens = cfg.data.max_prompt_tokens + r.max_new_tokens
    return rollout_memory(shape, sequences=sequences, tokens_per_sequence=tokens, weight_bytes=dtype,
                          kv_bytes=dtype, tp=tp, fuses_layers=vllm)  # fmt: skip


def memory_report(cfg: RunConfig, result: Plan, pools: list[Pool]) -> str:
    """The per-device memory of the planned update and rollout, term by term (`forgeweave plan` prints it); one
    line saying why where the model's shape is not known."""
    shape = model_shape(cfg)
    if shape is None or cfg.model.lora.rank:
        why = "LoRA" if shape is not None else f"no config.json for '{cfg.model.path}'"
        return f"memory per device: from the parameter count only ({why})"
    gpu = any(p.kind == "gpu" for p in pools)
    update = result.for_stage("update")
    shards = update.processes if cfg.update.strategy == "fsdp" and gpu and update.processes > 1 else 1
    u, r = cfg.update, cfg.rollout
    rows = min(u.micro_batch_size, r.prompts_per_step * r.group_size)
    head = (f"update, per process ({update.processes} process{'es' if update.processes > 1 else ''}, "
            f"{'FSDP x' + str(shards) if shards > 1 else u.strategy if update.processes > 1 else 'one process'}; "
            f"micro-batch {rows} x ({cfg.data.max_prompt_tokens} + {r.max_new_tokens}) tokens"
            f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}):")  # fmt: skip
    lines = [head, *update_breakdown(cfg, shape, shards, gpu).lines()]
    rollout = rollout_breakdown(cfg, shape, gpu)
    tp = r.tensor_parallel_size if r.backend == "vllm" and gpu else 1
    lines.append(f"rollout, per device ({r.backend}{f', tensor parallel {tp}' if tp > 1 else ''}):")
    lines += rollout.lines()
    if r.backend == "vllm" and gpu:
        gib = min(p.memory_gib for p in pools if p.kind == "gpu")
        budget = r.vllm.gpu_memory_utilization * gib * 2**30
        kv = dict(rollout.terms)["kv_cache"]
        room = max(0.0, budget - (rollout.total - kv))
        lines.append(f"  the engine reserves gpu_memory_utilization {r.vllm.gpu_memory_utilization} x {gib:g} GiB "
                     f"= {budget / 2**30:.1f} GiB; its KV cache gets {room / 2**30:.1f} GiB of it: "
                     f"{min(1.0, room / kv) if kv else 1.0:.0%} of the step's sequences at once")  # fmt: skip
    return "\n".join(lines)


def teacher_params(cfg: RunConfig) -> int:
    """The distillation teacher's parameter count (0 without `distill.teacher`): exact from its safetensors headers,
    else from its config.json; a missing directory or config.json is one line naming distill.teacher."""
    if not cfg.distill.teacher:
        return 0
    from forge.rewards.teacher import check_teacher_dir

    d = Path(check_teacher_dir(cfg.distill.teacher))
    config = _read_json(d / "config.json")
    return params_from_safetensors(d, config) or params_from_config(config)


def reference_bytes(cfg: RunConfig) -> int:
    """Bytes per parameter of the update's reference model: the policy's dtype when the KL penalty
    (algo.beta > 0) needs a copy, 0 without one (no penalty, or LoRA: the base model is the policy, adapter off)."""
    return BYTES[cfg.model.dtype] if cfg.algo.beta > 0 and not cfg.model.lora.rank else 0


def rollout_bytes(cfg: RunConfig, gpu: bool) -> int:
    """Bytes per parameter the rollout holds: a vLLM engine's dtype (`rollout.vllm.dtype`: auto = bf16 on a GPU,
    else the policy's), the policy's own dtype for hf copies (autocast computes in bf16 but keeps the weights)."""
    r, own = cfg.rollout, cfg.model.dtype
    if r.backend == "vllm":
        return BYTES[r.vllm.dtype] if r.vllm.dtype != "auto" else (2 if gpu else BYTES[own])
    return BYTES[own]


def _check_engine_fits(cfg: RunConfig, params: int, gpu_gib: float) -> None:
    r = cfg.rollout
    weights = params * rollout_bytes(cfg, True) / r.tensor_parallel_size / 2**30
    budget = r.vllm.gpu_memory_utilization * gpu_gib
    if gpu_gib > 0 and weights + 1.0 > budget:
        raise UserError(
            f"rollout.vllm.gpu_memory_utilization={r.vllm.gpu_memory_utilization} gives each vLLM engine "
            f"{budget:.1f} GiB of a {gpu_gib:g} GiB GPU, but its weights alone take {weights:.1f} GiB: raise it, "
            "or set rollout.tensor_parallel_size"
        )


def plan_run(cfg: RunConfig, pools_file: str | None = None) -> tuple[Plan, dict]:
    """Plan the run's stages; returns the plan and what plan.json holds (pools + assignments)."""
    pools = resolve_pools(cfg, pools_file)
    result = make_plan(cfg, pools)
    return result, {"pools": [p.to_dict() for p in pools], **result.to_dict()}


OBJECT_STORE_MIN = 512 * 2**20  # Ray's own floor is 75 MB; room for the small records every run puts
STORE_BYTES_PER_TOKEN = 64  # a token's share of Rollouts (ids, masks, logprobs) and of the ScoredBatch, with slack
STORE_COPIES = 4  # a step's replica parts, their merged copy, the reward actor's and the ranks' reads


def object_store_bytes(cfg: RunConfig) -> int:
    """Bytes of Ray object store a run needs: weights never go through it (the weight group carries them), so it
    holds the steps in flight — `algo.max_staleness` + 2 steps of B*G token rows (prompt + completion, at
    STORE_BYTES_PER_TOKEN, STORE_COPIES times) — at least OBJECT_STORE_MIN. A private Ray instance gets this size;
    docker/compose.yaml's Ray nodes must have it in /dev/shm (tests/test_docker.py checks the presets against it).

    >>> from forge.presets import tiny
    >>> object_store_bytes(tiny()) == OBJECT_STORE_MIN
    True
    """
    r = cfg.rollout
    tokens = r.prompts_per_step * r.group_size * (cfg.data.max_prompt_tokens + r.max_new_tokens)
    steps = cfg.algo.max_staleness + 2
    return max(OBJECT_STORE_MIN, steps * tokens * STORE_BYTES_PER_TOKEN * STORE_COPIES)
