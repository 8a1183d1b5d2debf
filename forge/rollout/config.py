"""`rollout.vllm`: the vLLM engine's settings (forge/rollout/vllm.py, the Ray adapter and the planner read them).

Kept apart from forge/rollout/vllm.py, which imports torch: `forge.config` (and with it `forgeweave config`) stays
importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
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
