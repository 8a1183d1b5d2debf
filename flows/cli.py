"""The `forgeweave` command line: run, eval, presets.

Errors a user can fix (a bad config key, a malformed data file, a missing model path) are printed as one
line on stderr with exit code 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from forge.errors import UserError

EPILOG = """examples:
  forgeweave run --preset tiny                     # tiny random model, learns in ~1 minute on CPU
  forgeweave run --preset smollm2-arith            # SmolLM2-135M-Instruct on 2-digit addition (make demo)
  forgeweave run --preset tiny --set update.lr=5e-4 --set steps=100 --name my-run
  forgeweave run --name my-run --resume            # continue from the last checkpoint
  forgeweave eval runs/my-run/checkpoints/step-000100
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forgeweave",
        description="RL post-training for LLMs (GRPO and variants).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run", help="train a policy with GRPO", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG
    )
    src = r.add_mutually_exclusive_group()
    src.add_argument("--preset", help="named preset (see `forgeweave presets`); default: tiny")
    src.add_argument("--config", help="YAML run config file")
    r.add_argument("--name", help="run name (directory under the runs dir); default: <preset>-<timestamp>")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set update.lr=1e-5 (repeatable)",
    )
    r.add_argument("--resume", action="store_true", help="continue the named run from its latest checkpoint")
    _runs_dir_arg(r)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    e = sub.add_parser("eval", help="evaluate a checkpoint (or any HF model directory) on an eval split")
    e.add_argument("checkpoint", help="checkpoint directory, e.g. runs/NAME/checkpoints/step-000040")
    e.add_argument("--preset", help="preset giving data/eval settings when the checkpoint is not inside a run")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--out", help="write the JSON report here (default: <checkpoint>/eval.json)")
    sub.add_parser("presets", help="list the named presets")
    return p


def _runs_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs-dir",
        default=os.environ.get("FORGEWEAVE_RUNS_DIR", "runs"),
        help="where runs live (default: $FORGEWEAVE_RUNS_DIR or ./runs)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return {"run": cmd_run, "eval": cmd_eval, "presets": cmd_presets}[args.command](args)
    except UserError as e:
        print(f"forgeweave: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("forgeweave: interrupted; continue with `forgeweave run --name NAME --resume`", file=sys.stderr)
        return 130


def resolve_config(preset: str | None, config: str | None, overrides: list[str]):
    from forge.config import apply_overrides, load_yaml
    from forge.presets import get_preset

    cfg = load_yaml(config) if config else get_preset(preset or "tiny")
    return apply_overrides(cfg, overrides).validate()


def cmd_run(args) -> int:
    from forge.config import apply_overrides, load_yaml
    from forge.recipes.grpo import run

    runs_dir = Path(args.runs_dir)
    if args.resume:
        if not args.name:
            raise UserError("--resume needs --name RUN (the run directory to continue)")
        run_dir = runs_dir / args.name
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"cannot resume '{run_dir}': no such run (config.yaml missing)")
        cfg = apply_overrides(load_yaml(run_dir / "config.yaml"), args.overrides).validate()
    else:
        cfg = resolve_config(args.preset, args.config, args.overrides)
        name = args.name or f"{cfg.preset or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = runs_dir / name
    print(f"run {run_dir.name}: preset={cfg.preset or '-'} model={cfg.model.path} steps={cfg.steps} -> {run_dir}")
    summary = run(cfg, run_dir, resume=args.resume, progress=not args.quiet)
    print(format_summary(summary))
    return 0


def format_summary(s: dict) -> str:
    init, final = s["eval"]["initial"], s["eval"]["final"]
    lines = ["", f"{'eval':<14}{'before':>10}{'after':>10}"]
    for key in sorted(k for k in final if k.startswith("pass@")):
        lines.append(f"{key:<14}{init.get(key, float('nan')):>10.3f}{final[key]:>10.3f}")
    lines += ["", f"{'stage':<14}{'seconds':>10}{'share':>10}"]
    total = s["seconds"]["total"]
    for stage in ("rollout", "reward", "update", "evaluate"):
        sec = s["seconds"].get(stage, 0.0)
        lines.append(f"{stage:<14}{sec:>10.1f}{sec / max(total, 1e-9):>10.0%}")
    lines.append(f"{'total':<14}{total:>10.1f}")
    lines += ["", f"run directory: {s['run_dir']}"]
    return "\n".join(lines)


def cmd_eval(args) -> int:
    from forge.config import apply_overrides, load_yaml
    from forge.data import build, read_split
    from forge.evaluate import evaluate
    from forge.io import write_json
    from forge.models import format_prompt_fn, load_policy
    from forge.rollout import make_backend

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise UserError(f"'{ckpt}' is not a model directory (no config.json): pass a checkpoint directory")
    run_dir = ckpt.resolve().parent.parent
    in_run = (run_dir / "config.yaml").is_file() and not args.preset
    cfg = load_yaml(run_dir / "config.yaml") if in_run else resolve_config(args.preset, None, [])
    cfg = apply_overrides(cfg, args.overrides)
    cfg.model.path = str(ckpt)
    model, tok = load_policy(cfg.model, seed=cfg.seed)
    if in_run and (run_dir / "data" / "eval.parquet").is_file():
        rows = read_split(run_dir, "eval")
    else:
        rows = build(
            cfg, format_prompt_fn(tok, cfg.model), lambda s: len(tok(s, add_special_tokens=False).input_ids)
        ).eval
    backend = make_backend(cfg.rollout.backend, model, tok, autocast_bf16=cfg.rollout.autocast_bf16)
    report = evaluate(backend, rows, cfg.eval, cfg.rollout, seed=cfg.seed)
    out = Path(args.out) if args.out else ckpt / "eval.json"
    write_json(out, report)
    brief = {k: round(v, 4) for k, v in report.items() if k.startswith("pass@")}
    print(json.dumps({"checkpoint": str(ckpt), "problems": report["problems"], **brief}))
    print(f"report: {out}")
    return 0


def cmd_presets(args) -> int:
    from forge.presets import PRESETS

    for name, fn in PRESETS.items():
        cfg = fn()
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        print(f"{name:<16} model={cfg.model.path:<24} steps={cfg.steps:<5} {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
