"""`forgeweave eval` (and the evaluate deployment, which calls the same function) samples on the device
`forge.models.default_device` picks: CUDA when present. Here the device is a stand-in ("meta") seen by the backend."""

from __future__ import annotations

import pytest
import torch

import forge.models
import forge.rollout
from flows.evaluation import evaluate_checkpoint_dir
from forge.models import build_char_tokenizer, build_tiny_model, default_device


class Seen(Exception):
    pass


def test_eval_moves_the_checkpoint_to_the_default_device(tmp_path, monkeypatch):
    tok = build_char_tokenizer()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    build_tiny_model(tok, hidden=32, layers=1).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    monkeypatch.setattr(forge.models, "default_device", lambda: torch.device("meta"))
    seen = {}

    def spy(name, model, tokenizer, **kw):
        seen["device"], seen["grad"] = model.device.type, any(p.requires_grad for p in model.parameters())
        raise Seen

    monkeypatch.setattr(forge.rollout, "make_backend", spy)
    with pytest.raises(Seen):
        evaluate_checkpoint_dir(ckpt, "tiny", [])
    assert seen == {"device": "meta", "grad": False}


def test_default_device_is_cuda_only_when_torch_sees_one(monkeypatch):
    assert default_device() == torch.device("cpu")  # tests hide GPUs (tests/conftest.py)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == torch.device("cuda")
