"""Evaluate a checkpoint directory outside a training run (CLI `forgeweave eval` and the evaluate deployment)."""

from __future__ import annotations

from pathlib import Path

from forge.errors import UserError


def evaluate_checkpoint_dir(ckpt: Path, preset: str | None, overrides: list[str], out: Path | None = None) -> dict:
    """pass@1 / pass@k of `ckpt` on its run's eval split (or `preset`'s data); writes the report to `out`."""
    from flows.runs import resolve_config
    from forge.checkpoint import SHARDS, export_model, has_weights, is_adapter, merged_policy
    from forge.compose import data_sources
    from forge.config import apply_overrides, load_yaml
    from forge.data import build, read_split
    from forge.evaluate import evaluate
    from forge.io import write_json
    from forge.models import check_model_dir, default_device, format_prompt_fn, load_policy
    from forge.rollout import make_backend

    out = eval_output(out or ckpt / "eval.json")
    adapter = is_adapter(ckpt)  # a LoRA run's checkpoint: merged into its run's base model below
    if not adapter and not (ckpt / "config.json").is_file():
        raise UserError(f"'{ckpt}' is not a model directory (no config.json): pass a checkpoint directory")
    check_model_dir(ckpt, "copy the checkpoint again from a good copy, or evaluate another step-NNNNNN directory")
    if not has_weights(ckpt) and (ckpt / SHARDS).is_dir():  # saved sharded by several ranks: assemble it once
        export_model(ckpt)
    run_dir = ckpt.resolve().parent.parent
    in_run = (run_dir / "config.yaml").is_file() and not preset
    cfg = load_yaml(run_dir / "config.yaml") if in_run else resolve_config(preset, None, [])
    cfg = apply_overrides(cfg, overrides).validate()
    if adapter and not in_run:
        raise UserError(f"'{ckpt}' holds a LoRA adapter: evaluate it inside its run (runs/NAME/checkpoints/step-N)")
    if adapter:
        model, tok = merged_policy(ckpt, cfg.model, cfg.seed)
    else:
        cfg.model.path = str(ckpt)
        model, tok = load_policy(cfg.model, seed=cfg.seed)
    model = model.to(default_device()).requires_grad_(False)
    if in_run and (run_dir / "data" / "eval.parquet").is_file():
        rows = read_split(run_dir, "eval")
    else:
        count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
        rows = build(data_sources(cfg), format_prompt_fn(tok, cfg.model), count).eval
    # HF generate in this process whatever the run sampled with: greedy tokens are the same as vLLM's (tested)
    backend = make_backend("hf", model, tok, autocast_bf16=cfg.rollout.autocast_bf16, rollout=cfg.rollout)
    report = evaluate(backend, rows, cfg.eval, cfg.rollout, seed=cfg.seed, timeout_s=cfg.reward.score_timeout_s,
                      reward=cfg.reward)  # fmt: skip
    write_json(out, report)
    return report


def eval_output(out: Path) -> Path:
    """Where an eval report may go: a .json file in an existing directory, new or an earlier eval report (never a
    run's own record, a directory, or a file of another kind). Raises UserError naming the path."""
    import json

    out = Path(out)
    if out.suffix != ".json":
        raise UserError(f"--out '{out}': the report is JSON; give a path ending in .json")
    if not out.parent.is_dir():
        raise UserError(f"--out '{out}': directory '{out.parent}' does not exist; create it first")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise UserError(f"--out '{out}' exists and is not a plain file; choose another path")
    if out.exists():
        try:
            earlier = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and "problems" in earlier and "pass@1" in earlier):
            raise UserError(f"--out '{out}' exists and is not an eval report; choose another path")
    return out
