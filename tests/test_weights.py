"""Weight publication: atomic file, version in metadata, tied weights, same directory from any process."""

from __future__ import annotations

import torch

from forge.weights import load_published, publication_dir, publish_weights, published_version


def test_publish_and_load_round_trip_with_version(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = publish_weights(model, tmp_path / "pub", version=7)
    state, version = load_published(path)
    assert version == 7 and published_version(path) == 7
    assert torch.equal(state["weight"], model.weight.detach())
    assert [p.name for p in (tmp_path / "pub").iterdir()] == ["policy.safetensors"]  # no temp file left


def test_tied_weights_are_written_once_and_reload(tmp_path):
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    state, _ = load_published(publish_weights(model, tmp_path, version=1))
    assert list(state) == ["emb.weight"]
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 4), "head": torch.nn.Linear(4, 5, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    fresh.load_state_dict(state, strict=False)
    assert torch.equal(fresh["head"].weight, emb.weight.detach())


def test_publication_dir_is_stable_for_a_run_dir(tmp_path):
    assert publication_dir(tmp_path / "r") == publication_dir(tmp_path / "r")
    assert publication_dir(tmp_path / "r", shared_memory=False) == (tmp_path / "r").resolve() / "weights"
