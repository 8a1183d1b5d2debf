"""FSDP (full shard) for the update: torch's `fully_shard` (FSDP2) per decoder layer and at the root.

Used instead of Accelerate's FSDP plugin because Accelerate 1.15 ignores the plugin on CPU (the distributed
type stays MULTI_CPU and the model is wrapped in DDP, without a warning), while torch's FSDP2 shards over gloo
on CPU and over NCCL on GPUs alike. Parameters become DTensors sharded on dim 0 across ranks; the gradient
reduce-scatter averages over ranks, as DDP does.

The weights published to the rollout workers cross this boundary as *full* tensors (gathered to CPU on rank 0);
a checkpoint's HF weights are given in full to every rank when loading. Checkpoints themselves are sharded
(`forge.distributed.state`: each rank saves and loads its own slice).
"""

from __future__ import annotations

import torch


def shard(model: torch.nn.Module, bf16: bool = False) -> torch.nn.Module:
    """Shard `model` (already on this rank's device) over all ranks; bf16 compute with fp32 reduction if asked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _full(cpu_offload: bool = True, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full state dict on CPU on rank 0 (empty on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full())


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Collective: every rank passes the same full state dict (tied copies may be missing) and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_full(cpu_offload=False, strict=False))
