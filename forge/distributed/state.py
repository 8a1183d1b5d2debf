"""The trainer's tensors as one flat dict for `torch.distributed.checkpoint`, whatever the strategy.

`torch.distributed.checkpoint.state_dict.get_state_dict` gives the model and optimizer state keyed by parameter
name (FQN) for a plain module, DDP and FSDP2 alike: plain tensors in one process or under DDP (every rank holds
them all; DCP writes each once), DTensor shards under FSDP (each rank holds its slice). Flattened here to
`model.<fqn>` and `optim.<fqn>.<name>` (`step`, `exp_avg`, `exp_avg_sq` for AdamW); tied copies (lm_head when
tied to the embedding) appear once. The optimizer's param groups (hyperparameters, plain values) are returned
apart, for JSON. Loading goes the other way: the current state (sharded as this process holds it now) is the
target that DCP fills from any saved layout, then `set_state_dict` puts it in place.
"""

from __future__ import annotations

import torch


def _plain_optimizer(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch optimizer


def trainer_tensors(model, optimizer, with_model: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(flat tensors of this rank, optimizer param groups) of the unwrapped `model` (not the DDP wrapper). The
    tensors are the live ones: copy them to keep them. An optimizer that has not stepped yet gets its state
    initialised by a zero-LR step first (torch's `get_state_dict` does that), so a fresh trainer is a load target."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, _plain_optimizer(optimizer))
    flat: dict[str, torch.Tensor] = {}
    if with_model:
        unique = unique_names(model)
        flat.update({f"model.{k}": v for k, v in model_sd.items() if k in unique})
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            assert isinstance(value, torch.Tensor), f"optimizer state {fqn}.{name} is not a tensor"
            flat[f"optim.{fqn}.{name}"] = value
    return flat, optim_sd["param_groups"]


def load_trainer_tensors(model, optimizer, flat: dict[str, torch.Tensor], groups: list[dict]) -> None:
    """Put `flat` (as `trainer_tensors` returns it, filled from a checkpoint) and `groups` into the unwrapped
    model and its optimizer; without `model.*` keys only the optimizer is set."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_sd = {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith("optim."):
            fqn, _, name = key[len("optim.") :].rpartition(".")  # AdamW's state names have no dot
            state.setdefault(fqn, {})[name] = value
    if model_sd:
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))  # tied copies are absent
    set_optimizer_state_dict(model, _plain_optimizer(optimizer), {"state": state, "param_groups": groups})


def unique_names(model) -> set[str]:
    """State-dict names without tied duplicates: parameters as `named_parameters` lists them, and buffers."""
    params = {n for n, _ in model.named_parameters()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n for n in model.state_dict() if n in params or n not in every}
