"""What this machine offers: CPU cores, memory, GPUs (when torch sees them), host name. Standard library only;
torch is imported only if it is installed, to count GPUs."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gib: float


@dataclass(frozen=True)
class Resources:
    host: str
    cpu_cores: int
    memory_gib: float
    gpus: list[Gpu] = field(default_factory=list)


def discover() -> Resources:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Resources(host=socket.gethostname(), cpu_cores=cores, memory_gib=_memory_gib(), gpus=_gpus())


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def _gpus() -> list[Gpu]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(Gpu(index=i, name=p.name, memory_gib=round(p.total_memory / 2**30, 1)))
    return out
