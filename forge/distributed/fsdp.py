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


def shard(model: torch.nn.Module, bf16: bool = False, device: torch.device | None = None) -> torch.nn.Module:
    """Shard `model` (on this rank's device, or on the meta device with `device` given) over all ranks; bf16
    compute with fp32 reduction if asked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = device or next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_from_rank0(model: torch.nn.Module, device: torch.device, bf16: bool = False) -> torch.nn.Module:
    """`shard`, where only rank 0 may have loaded the weights (a collective): the other ranks may pass the model
    built on the meta device (no memory, no file read); rank 0's full tensors are then broadcast into every rank's
    shard, and its buffers (rotary frequencies and the like, which no state dict holds) copied. With every rank's
    weights loaded this is `shard(model.to(device))`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    on_meta = any(p.is_meta for p in model.parameters())
    flag = torch.tensor([int(on_meta)], device=device)
    dist.all_reduce(flag)
    if int(flag.item()) == 0:
        return shard(model.to(device), bf16)
    if dist.get_rank() == 0 and on_meta:
        raise RuntimeError("shard_from_rank0: rank 0 must hold the loaded weights")
    full = {} if on_meta else model.state_dict()  # rank 0: the loaded tensors, kept where they were loaded
    model = shard(model if on_meta else model.to(device), bf16, device=device)
    if on_meta:
        model.to_empty(device=device)
    options = _full(cpu_offload=False, strict=False)
    options.broadcast_from_rank0 = True
    set_model_state_dict(model, full, options=options)
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)
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
