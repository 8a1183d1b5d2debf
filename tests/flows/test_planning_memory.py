"""The planner's memory model on real model shapes (tests/fixtures/models: config.json of Qwen2.5-0.5B, Qwen2.5-7B,
SmolLM2-135M): exact parameter counts, FSDP sharding, a vLLM engine's GPU fraction and dtype.

Hand-worked (GiB = 2**30 B), Qwen2.5-7B = 7,615,616,512 params (the per-parameter estimate, which LoRA and
hub ids still use; weaver.memory's token-based figures replace it where config.json is known):
  update, full state per process: 7.6156e9 * 16 * 1.25 / 2**30 + 1 = 142.85  -> no 80 GB GPU holds it
  update, FSDP over 8 ranks:      141.85 / 8 + 1 = 18.73
  rollout, vLLM engine:           0.5 * 80 = 40 GiB (its gpu_memory_utilization), weights 14.2 GiB in bf16
  FSDP-8 + engine on one GPU:     18.73 + 40 = 58.73 <= 80: colocated on all 8 GPUs
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flows.planning import estimate_params, make_plan, params_from_config, run_needs
from forge.config import RunConfig
from forge.errors import UserError
from weaver.pools import pools_from_dicts

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
POOLS = pools_from_dicts(
    [{"name": "cpu", "kind": "cpu", "host": "n", "cpu_cores": 32, "memory_gib": 512},
     {"name": "gpu", "kind": "gpu", "host": "n", "devices": list(range(8)), "memory_gib": 80}],
    source="test",
)  # fmt: skip


def _cfg(model: str, **update) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(MODELS / model)
    for k, v in update.items():
        setattr(cfg.update, k, v)
    return cfg


@pytest.mark.parametrize(
    "model, params",
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512), ("smollm2-135m", 134_515_008)],
)
def test_parameter_counts_are_exact_from_config(model, params):
    # the counts transformers gives for these configs (sum of numel, tied embeddings once); the old estimate
    # 12*L*H^2 + V*H said 4.9e9 for Qwen2.5-7B
    assert estimate_params(_cfg(model)) == params


def test_safetensors_headers_and_index_give_the_count_without_config_arithmetic(tmp_path):
    config = json.loads((MODELS / "qwen2.5-7b" / "config.json").read_text())
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "config.json").write_text(json.dumps(config))
    # the published index's total: 15,231,233,024 bytes of bf16 weights
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 15_231_233_024}}))
    cfg = RunConfig()
    cfg.model.path = str(indexed)
    assert estimate_params(cfg) == 7_615_616_512
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({**config, "hidden_size": 1}))  # headers win over the config
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, local / "model.safetensors")
    cfg.model.path = str(local)
    assert estimate_params(cfg) == 22


def test_tiny_random_count_matches_the_built_model():
    from forge.models import build_char_tokenizer, build_tiny_model

    cfg = RunConfig()
    model = build_tiny_model(build_char_tokenizer(), hidden=64, layers=2, head_dim=16)
    assert estimate_params(cfg) == sum(p.numel() for p in model.parameters())


def test_7b_with_fsdp_on_8x80gb_is_planned_and_ddp_is_refused():
    cfg = _cfg("qwen2.5-7b", strategy="fsdp", num_processes=8)
    # gradient checkpointing: since update memory counts tokens (weaver.memory), micro-batches of 16 x 272 tokens
    # without it hold ~35 GiB of activations per rank, which no longer leaves room for the 40 GiB engine
    cfg.model.gradient_checkpointing = True
    cfg.rollout.backend = "vllm"
    p = make_plan(cfg, POOLS)
    update, rollout = p.for_stage("update"), p.for_stage("rollout")
    assert update.processes == 8 and update.devices == tuple(range(8))
    assert rollout.devices[0] in update.devices and "update" in rollout.colocated_with
    with pytest.raises(UserError, match="update"):
        make_plan(_cfg("qwen2.5-7b", strategy="ddp", num_processes=8), POOLS)


def test_a_reference_model_is_counted_in_the_update_and_sharded_with_it():
    """algo.beta > 0 keeps a reference copy in the policy's dtype beside the update state (sharded under FSDP):
    7.6156e9 * 4 / 2**30 / 8 = 3.55 GiB more per rank; LoRA's reference is the policy: no copy.
    The totals are weaver.memory's since it counts tokens (they were 23.16 / 18.73 from 16 bytes/param x 1.25):
    with gradient checkpointing and micro-batches of 16 x (256 + 16) tokens, 22.36 GiB without the reference."""
    cfg = _cfg("qwen2.5-7b", strategy="fsdp", num_processes=8)
    cfg.model.gradient_checkpointing = True
    cfg.algo.beta = 0.04
    assert {n.name: n for n in run_needs(cfg, POOLS)}["update"].memory_gib == 25.91
    cfg.algo.beta = 0.0
    assert {n.name: n for n in run_needs(cfg, POOLS)}["update"].memory_gib == 22.36
    cfg.algo.beta, cfg.model.lora.rank = 0.04, 16  # LoRA keeps the per-parameter estimate (16 B/param x 1.25)
    assert {n.name: n for n in run_needs(cfg, POOLS)}["update"].memory_gib == 18.73


def test_fsdp_with_automatic_rank_count_takes_enough_gpus():
    cfg = _cfg("qwen2.5-7b", strategy="fsdp")
    cfg.rollout.backend = "vllm"
    p = make_plan(cfg, POOLS)
    # 141.85 GiB of state needs 2 shards of 80 GB at least (70.9 + 1 each); with the 40 GiB engine they cannot
    # share, so rollout takes one GPU and update the other 7
    assert p.for_stage("update").processes >= 2


def test_engine_memory_is_its_gpu_fraction_and_dtype_sizes_hf_copies():
    from flows.planning import rollout_bytes

    cfg = _cfg("qwen2.5-0.5b")
    cfg.rollout.backend = "vllm"
    cfg.rollout.vllm.gpu_memory_utilization = 0.3
    assert rollout_bytes(cfg, gpu=True) == 2  # auto: bf16 on a GPU
    needs = {n.name: n for n in run_needs(cfg, POOLS)}
    assert needs["rollout"].memory_gib == needs["evaluate"].memory_gib == 24.0  # 0.3 * 80 GiB, whatever the model
    hf = _cfg("qwen2.5-0.5b")
    assert rollout_bytes(hf, gpu=True) == 4  # hf copies keep the fp32 policy weights
    # weaver.memory: fp32 weights 494,032,768 * 4 B = 1.84 GiB, the KV cache of rollout.batch_size 64 sequences of
    # 256 + 16 tokens (24 layers x 2 x 128 x 4 B per token) = 0.40 GiB, a 64 MiB sync bucket, +1 = 3.30 GiB (it was
    # weights x2 + 1 = 4.68 before the KV cache was counted from tokens; bf16 before that: 2.84)
    assert {n.name: n for n in run_needs(hf, POOLS)}["rollout"].memory_gib == 3.3
    fp32 = _cfg("qwen2.5-7b", strategy="fsdp", num_processes=8)
    fp32.rollout.backend, fp32.rollout.vllm.dtype, fp32.rollout.vllm.gpu_memory_utilization = "vllm", "float32", 0.3
    with pytest.raises(UserError, match="rollout.vllm.gpu_memory_utilization=0.3"):  # 28.4 GiB > 24 GiB
        make_plan(fp32, POOLS)


def test_params_from_config_counts_biases_and_untied_heads():
    base = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 10}  # fmt: skip
    # attn: 2*8*8 + 2*8*4 = 192; mlp 3*8*16 = 384; norms 16 + 8; embeddings 80
    assert params_from_config({**base, "tie_word_embeddings": True}) == 192 + 384 + 16 + 8 + 80
    assert params_from_config({**base, "tie_word_embeddings": False}) == 192 + 384 + 16 + 8 + 160
    assert params_from_config({**base, "model_type": "qwen2"}) == 192 + 8 + 8 + 384 + 16 + 8 + 80  # q/k/v biases


@pytest.mark.parametrize("name", ["qwen2.5-7b-8xh100", "qwen2.5-72b-2x8xh100"])
def test_docs_planning_shows_what_forgeweave_plan_prints(name, capsys, monkeypatch):
    """docs/planning.md holds the real output of `forgeweave plan` for its two configs (rerun it when this fails)."""
    from flows.cli import main

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the configs name tests/fixtures/models/... relative to the checkout
    assert main(["plan", "--config", f"docs/plans/{name}.yaml"]) == 0
    printed = capsys.readouterr().out
    assert "fsdp_gathered" in printed and "kv_cache" in printed
    assert printed.strip() in (root / "docs" / "planning.md").read_text()
