"""Rollout backends: sample G completions per prompt and return a `Rollouts` record.

The backends are imported on first use (PEP 562), so `forge.rollout.config` (imported by `forge.config`) does not
pull in torch."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forge.rollout.base import RolloutBackend, SamplingParams
    from forge.rollout.config import RolloutConfig
    from forge.rollout.hf import HFBackend

__all__ = ["HFBackend", "RolloutBackend", "SamplingParams", "make_backend"]
_LAZY = {
    "HFBackend": "forge.rollout.hf",
    "RolloutBackend": "forge.rollout.base",
    "SamplingParams": "forge.rollout.base",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'forge.rollout' has no attribute {name!r}")


def make_backend(
    name: str,
    model,
    tokenizer,
    autocast_bf16: bool = False,
    rollout: RolloutConfig | None = None,
    work_dir: Path | None = None,
    sleep: bool = False,
) -> RolloutBackend:
    """hf: `generate` on `model` itself; vllm: an engine in this process built from `model` (its venv must have
        vllm: the Ray adapter runs it in .venv-vllm), its files under `work_dir` (a temp dir if None), sleeping between a
    generate and the next weight load if `sleep` (`forge.rollout.vllm.wants_sleep`)."""
    from forge.rollout.config import RolloutConfig

    if name == "hf":
        from forge.rollout.hf import HFBackend

        r = rollout or RolloutConfig()
        return HFBackend(
            model,
            tokenizer,
            autocast_bf16=autocast_bf16,
            batch_size=r.batch_size,
            shared_prefill=r.shared_prefill,
            compact_every=r.compact_every,
        )
    if name == "vllm":
        from forge.rollout.vllm import VLLMBackend

        return VLLMBackend(model, tokenizer, rollout or RolloutConfig(backend="vllm"), work_dir, sleep=sleep)
    raise ValueError(f"unknown rollout backend {name!r}")
