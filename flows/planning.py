"""Weaver glue for a run config: pools (declared or autodetected), stage needs from the model size, the plan.

Lives in flows because it joins forge's config with weaver (forge imports neither flows nor weaver).
"""

from __future__ import annotations

import json
from pathlib import Path

from forge.config import RunConfig, read_yaml_file
from forge.errors import UserError
from weaver import discover
from weaver.errors import PlanError
from weaver.plan import Plan, plan, stage_needs
from weaver.pools import Pool, autodetect_pools, pools_from_dicts

KNOWN_PARAMS = {"smollm2-135m-instruct": 134_515_008}


def estimate_params(cfg: RunConfig) -> int:
    """Parameter count from the model's config (no weights loaded): ~12·L·H² for the blocks + V·H embeddings."""
    m = cfg.model
    if m.path in KNOWN_PARAMS:
        return KNOWN_PARAMS[m.path]
    if m.path == "tiny-random":
        hidden, layers, vocab = m.tiny_hidden, m.tiny_layers, 100
    else:
        config_file = Path(m.path).expanduser() / "config.json"
        if not config_file.is_file():
            return 1_000_000_000  # a hub id: plan conservatively for a 1B model
        try:
            c = json.loads(config_file.read_text(encoding="utf-8"))
            hidden, layers, vocab = (int(c.get(k, d)) for k, d in (("hidden_size", 1024), ("num_hidden_layers", 24),
                                                                    ("vocab_size", 50000)))  # fmt: skip
        except (ValueError, TypeError, AttributeError) as e:
            raise UserError(f"{config_file}: not a model config ({type(e).__name__}); point model.path at a "
                            "Hugging Face model directory") from None  # fmt: skip
    return 12 * layers * hidden * hidden + vocab * hidden


def resolve_pools(cfg: RunConfig, pools_file: str | None = None) -> list[Pool]:
    try:
        if pools_file:
            p = Path(pools_file)
            data = read_yaml_file(p, "pools file") or []
            items = data.get("pools", []) if isinstance(data, dict) else data
            return pools_from_dicts(items, source=str(p))
        if cfg.pools:
            return pools_from_dicts(cfg.pools, source="config pools")
        return autodetect_pools(discover())
    except PlanError as e:
        raise UserError(str(e)) from None


def make_plan(cfg: RunConfig, pools: list[Pool]) -> Plan:
    gpu = any(p.kind == "gpu" for p in pools)
    r = cfg.rollout
    replicas = r.replicas  # rollout actors (vLLM engines or hf copies); one in-process
    needs = stage_needs(
        estimate_params(cfg),
        rollout_replicas=replicas,
        update_processes=cfg.update.num_processes,
        gpu=gpu,
        rollout_tp=r.tensor_parallel_size if r.backend == "vllm" else 1,
    )
    try:
        return plan(needs, pools)
    except PlanError as e:
        raise UserError(str(e)) from None


def plan_run(cfg: RunConfig, pools_file: str | None = None) -> tuple[Plan, dict]:
    """Plan the run's stages; returns the plan and what plan.json holds (pools + assignments)."""
    pools = resolve_pools(cfg, pools_file)
    result = make_plan(cfg, pools)
    return result, {"pools": [p.to_dict() for p in pools], **result.to_dict()}
