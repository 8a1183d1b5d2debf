"""`model`: the policy's sections (`model.tiny`, `model.lora`), read by forge/models.py.

Kept apart from forge/models.py, which imports torch: `forge.config` (and with it `forgeweave config`) stays
importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge.config_base import ranged, require


@dataclass(kw_only=True)
class TinyConfig:
    """`model.tiny`: the shape of the built-in tiny-random model (forge.models.build_tiny_model)."""

    hidden: int = ranged(64, ">= 1")
    """Hidden size."""
    layers: int = ranged(2, ">= 1")
    """Transformer layers."""
    head_dim: int = ranged(16, ">= 1")
    """Attention head size (vLLM's CPU attention needs 32 or more)."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = ranged(0, ">= 0", "(0 = no LoRA, full fine-tuning)")
    """LoRA rank r of the adapter (peft); 0 = off: the whole model is trained."""
    alpha: float = ranged(0.0, ">= 0", "(0 = 2 * rank)")
    """LoRA scale numerator: the update is (alpha / rank) * B @ A; 0 = 2 * rank."""
    dropout: float = ranged(0.0, "in [0, 1)")
    """Dropout on the adapter's input during the update."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get an adapter; ["all-linear"] = every linear layer of attention and MLP (not lm_head)."""

    def check(self, prefix: str) -> None:
        require(bool(self.target_modules) or not self.rank, f"{prefix}target_modules", "needs at least one name")


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "tiny-random"
    """Policy: a local HF model directory, a hub id (online only), or a built-in: tiny-random, smollm2-135m-instruct."""
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None = when the tokenizer has one."""
    system_prompt: str = ""
    """System message placed before each prompt when the chat template is used (empty = none)."""
    tiny: TinyConfig = field(default_factory=TinyConfig)
    """tiny-random only: the model's shape."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weights dtype (the optimizer updates these)."""
    attn_implementation: str = ""
    """Attention kernel passed to from_pretrained (e.g. sdpa, eager); empty = transformers' default."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more update time)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter (model.lora.rank > 0): only the adapter is trained and checkpointed."""
