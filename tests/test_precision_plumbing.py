"""Precision is explicit: the update's autocast (policy and reference alike), no Accelerate mixed_precision wrapper
on the module, and the KL to a reference at identical weights exactly 0 under bf16 autocast."""

from __future__ import annotations

import copy

import torch

import forge.precision as precision
from forge.precision import update_bf16
from forge.trainer import make_accelerator
from tests.grpo_parts import Trainer
from tests.test_trainer import make_batch, make_cfg

torch.set_num_threads(1)


def test_update_runs_bf16_on_a_cuda_gpu_with_bf16_whatever_the_cpu_flag(monkeypatch):
    monkeypatch.setattr(precision, "bf16_fast", lambda device: device == "cuda")
    assert update_bf16(False, "cuda") and update_bf16(True, "cuda")
    assert not update_bf16(True, "cpu")  # this CPU (as patched) has no bf16 units: fp32
    monkeypatch.setattr(precision, "bf16_fast", lambda device: False)
    assert not update_bf16(False, "cuda")  # a GPU without bf16 (pre-Ampere) stays fp32


def test_accelerator_leaves_precision_to_the_trainer():
    acc = make_accelerator()
    assert acc.mixed_precision == "no"


def test_reference_kl_is_exactly_zero_at_identical_weights_under_bf16(tok, monkeypatch):
    from forge.models import build_tiny_model

    monkeypatch.setattr(precision, "bf16_fast", lambda device: True)  # run CPU bf16 autocast even without units
    model = build_tiny_model(tok, hidden=32, layers=1, seed=0)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    cfg = make_cfg(autocast_bf16=True, micro_batch_size=4)
    cfg.algo.beta = 0.1
    trainer = Trainer(model, cfg, total_steps=1, ref_model=ref)
    assert trainer.autocast_bf16
    forward = type(model).forward
    assert getattr(trainer.unwrapped.forward, "__func__", None) is forward  # no autocast wrapper patched in
    stats = trainer.update(*make_batch(tok))
    assert stats.kl_ref == 0.0
