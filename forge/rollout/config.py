"""`rollout` and `rollout.vllm`: the rollout's sections (forge/rollout/*.py, forge.workers.RolloutWorker, the Ray adapter
and the planner read them).

Kept apart from forge/rollout/vllm.py, which imports torch: `forge.config` (and with it `forgeweave config`) stays
importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge.config_base import ranged


@dataclass(kw_only=True)
class VllmConfig:
    """Settings of each vLLM engine (`rollout.backend: vllm`)."""

    python: str = ""
    """Python of the vLLM venv; empty = $FORGEWEAVE_VLLM_PYTHON, else the repo's .venv-vllm/bin/python."""
    kv_cache_gib: int = ranged(1, ">= 1")
    """On CPU: KV-cache GiB per engine (VLLM_CPU_KVCACHE_SPACE)."""
    start_timeout_s: float = ranged(600.0, "> 0", "seconds")
    """Seconds to wait for a rollout actor (a vLLM engine loading its model) to start."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine weight dtype, also the dtype of published weights; auto = bfloat16 on CUDA, else model.dtype."""
    gpu_memory_utilization: float = 0.5
    """On CUDA: fraction of each GPU's memory the engine takes (weights + KV cache); the planner counts it."""
    enforce_eager: bool = False
    """On CUDA: no CUDA graphs (less memory and start-up time, slower decoding)."""
    max_model_len: int = 0
    """Context length the engine reserves KV cache for; 0 = the model's own maximum."""
    sleep: Literal["auto", "on", "off"] = "auto"
    """On CUDA: sleep mode (level 1) between a generate and the next weight load, freeing the GPU for the update;
    auto = on when on-policy and the plan colocates rollout with update on a GPU."""


@dataclass(kw_only=True)
class RolloutConfig:
    backend: Literal["hf", "vllm"] = "hf"
    """Rollout backend ('hf': HF generate; 'vllm': vLLM engines, each a Ray actor run by .venv-vllm's python)."""
    prompts_per_step: int = ranged(8, ">= 1")
    """B: prompts sampled per step."""
    group_size: int = ranged(8, ">= 2", "(advantages compare samples of a prompt)")
    """G: completions per prompt."""
    max_new_tokens: int = ranged(16, ">= 1")
    """Completion length cap (tokens)."""
    temperature: float = ranged(1.0, "> 0", "(use eval for greedy)")
    """Sampling temperature."""
    top_p: float = ranged(1.0, "in (0, 1]")
    """Nucleus sampling mass."""
    batch_size: int = ranged(64, ">= 1")
    """Sequences per generate() call."""
    shared_prefill: bool = True
    """hf: prefill each prompt once per group and share its KV cache (same tokens; less prefill compute)."""
    compact_every: int = ranged(4, ">= 0", "(0 = never)")
    """hf: every this many new tokens, sequences that have ended leave the batch, so decoding no longer computes
    them (0 = never; greedy tokens are the same either way)."""
    autocast_bf16: bool = False
    """Sample under bf16 autocast (faster on CPUs with bf16 units and on GPUs)."""
    replicas: int = ranged(1, ">= 1")
    """Rollout actors (vLLM engines or hf copies, Ray mode); each step's prompts are split by measured tokens/s."""
    tensor_parallel_size: int = ranged(1, ">= 1")
    """vllm on GPUs: devices per engine (replica i takes the i-th block of visible devices)."""
    weight_transport: Literal["auto", "group", "ipc"] = "auto"
    """Ray mode, trainer -> engines: group (broadcast: gloo/NCCL), ipc (handles to rank 0's memory: same host and
    device), auto (ipc when every engine shares update rank 0's GPU, else group)."""
    weight_check: bool = True
    """Ray mode: after every weight sync each receiver compares a fingerprint of what arrived (16 elements a tensor)
    with update rank 0's, and an hf engine its live weights too; a difference stops the run naming the tensor
    (forge/weight_group.py)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """vllm: the engines' settings."""
