"""Whether bf16 autocast pays off on the device at hand.

bf16 is worth it where the hardware multiplies in bf16: CUDA GPUs that support it, and CPUs with bf16 units
(AVX512-BF16 or AMX). On a CPU without them torch emulates bf16 matmuls, which measured ~300x slower than fp32
on an AVX2-only AMD EPYC (2048^2 matmul: fp32 0.09 TFLOP/s, bf16 0.0003 TFLOP/s) — a preset that asks for bf16
would then take hours instead of minutes. `bf16_autocast` turns such a request into fp32 and says so once.

Precision is explicit and applied in one place per stage (`forge.trainer.autocast_context`): the update (policy and
reference model alike) runs under bf16 autocast on a CUDA GPU with bf16, or where `update.autocast_bf16` asks for it
and the CPU has bf16 units (`update_bf16`); the hf rollout only where `rollout.autocast_bf16` asks for it. Nothing
is left to Accelerate's `mixed_precision`: its wrapper patches the module's own forward, so the rollout sharing the
trainer's module would sample in bf16 whatever it was asked, and a reference model outside the wrapper would run
in fp32 and bias the KL at identical weights.
"""

from __future__ import annotations

import functools
import sys

import torch


@functools.cache
def bf16_fast(device_type: str) -> bool:
    """True when `device_type` ("cpu", "cuda") computes bf16 matmuls natively."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type != "cpu":
        return True
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def bf16_autocast(requested: bool, device_type: str, key: str) -> bool:
    """Whether to run under bf16 autocast: `requested` (config `key`), unless the device has no bf16 units."""
    if not requested or bf16_fast(device_type):
        return requested
    _warn_once(key, device_type)
    return False


def update_bf16(requested: bool, device_type: str) -> bool:
    """Whether the update runs under bf16 autocast: always on a CUDA GPU with bf16 units (fp32 master weights,
    fp32 log-softmax), else `update.autocast_bf16` where the CPU has bf16 units."""
    if device_type == "cuda" and bf16_fast("cuda"):
        return True
    return bf16_autocast(requested, device_type, "update.autocast_bf16")


@functools.cache
def _warn_once(key: str, device_type: str) -> None:
    print(
        f"forgeweave: {key}=true, but this {device_type} has no bf16 units (avx512_bf16/AMX): bf16 would run "
        f"hundreds of times slower, so this run computes in fp32",
        file=sys.stderr,
        flush=True,
    )
