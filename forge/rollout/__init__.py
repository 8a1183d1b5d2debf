"""Rollout backends: sample G completions per prompt and return a `Rollouts` record."""

from pathlib import Path

from forge.config import RolloutConfig
from forge.rollout.base import RolloutBackend, SamplingParams
from forge.rollout.hf import HFBackend

__all__ = ["HFBackend", "RolloutBackend", "SamplingParams", "make_backend"]


def make_backend(
    name: str,
    model,
    tokenizer,
    autocast_bf16: bool = False,
    rollout: RolloutConfig | None = None,
    work_dir: Path | None = None,
    policy_version: int = 0,
    balancer=None,
) -> RolloutBackend:
    """vllm: `work_dir` holds the engines' model copy, logs and published weights (a temp dir if None);
    `balancer(replicas)` makes the object that splits prompts across replicas (default: equal shares)."""
    if name == "hf":
        return HFBackend(model, tokenizer, autocast_bf16=autocast_bf16)
    if name == "vllm":
        from forge.rollout.vllm import VLLMBackend

        return VLLMBackend(
            model, tokenizer, rollout or RolloutConfig(backend="vllm"), work_dir, policy_version, balancer
        )
    raise ValueError(f"unknown rollout backend {name!r}")
