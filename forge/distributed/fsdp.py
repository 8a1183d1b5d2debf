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
    built on the meta device (no memory, no file read). Every rank then shards the model's skeleton on the meta
    device and allocates only its own shards on `device`; rank 0's full tensors, left where they were loaded (host
    memory), are broadcast one parameter at a time into every rank's shard, and its buffers (rotary frequencies and
    the like, which no state dict holds) copied. So no rank ever holds the whole model on `device`. With every
    rank's weights loaded this is `shard(model.to(device))`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    on_meta = any(p.is_meta for p in model.parameters())
    flag = torch.tensor([int(on_meta)], device=device)
    dist.all_reduce(flag)
    if int(flag.item()) == 0:
        return shard(model.to(device), bf16)
    if dist.get_rank() == 0 and on_meta:
        raise RuntimeError("shard_from_rank0: rank 0 must hold the loaded weights")
    full = {} if on_meta else model.state_dict()  # rank 0: the loaded tensors (detached views), kept in place
    buffers = {} if on_meta else {name: b.detach().clone() for name, b in model.named_buffers()}
    model = shard(_to_meta(model), bf16, device=device)  # rank 0's parameters leave; `full` keeps their storage
    model.to_empty(device=device)
    for name, buffer in model.named_buffers():
        if buffers:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    options = _full(cpu_offload=False, strict=False)
    options.broadcast_from_rank0 = True
    set_model_state_dict(model, full, options=options)
    return model


def _to_meta(model: torch.nn.Module) -> torch.nn.Module:
    """`model` moved to the meta device with its shared parameters (tied embeddings) still shared: `Module.to` gives
    each module a parameter of its own when the device changes, and FSDP would then shard the tied head twice."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    shared = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in first:
                shared.append((module, name, first[id(p)]))
            else:
                first[id(p)] = (module, name)
    model.to("meta")
    for module, name, (owner, owner_name) in shared:
        setattr(module, name, getattr(owner, owner_name))
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
