"""Rollout backends: sample G completions per prompt and return a `Rollouts` record."""

from forge.rollout.base import RolloutBackend, SamplingParams
from forge.rollout.hf import HFBackend

__all__ = ["HFBackend", "RolloutBackend", "SamplingParams", "make_backend"]


def make_backend(name: str, model, tokenizer, autocast_bf16: bool = False) -> RolloutBackend:
    if name == "hf":
        return HFBackend(model, tokenizer, autocast_bf16=autocast_bf16)
    raise ValueError(f"unknown rollout backend {name!r}")
