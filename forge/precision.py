"""Whether bf16 autocast pays off on the device at hand.

bf16 is worth it where the hardware multiplies in bf16: CUDA GPUs that support it, and CPUs with bf16 units
(AVX512-BF16 or AMX). On a CPU without them torch emulates bf16 matmuls, which measured ~300x slower than fp32
on an AVX2-only AMD EPYC (2048^2 matmul: fp32 0.09 TFLOP/s, bf16 0.0003 TFLOP/s) — a preset that asks for bf16
would then take hours instead of minutes. `bf16_autocast` turns such a request into fp32 and says so once.
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


@functools.cache
def _warn_once(key: str, device_type: str) -> None:
    print(
        f"forgeweave: {key}=true, but this {device_type} has no bf16 units (avx512_bf16/AMX): bf16 would run "
        f"hundreds of times slower, so this run computes in fp32",
        file=sys.stderr,
        flush=True,
    )
