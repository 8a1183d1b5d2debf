"""forgeweave vs TRL's `GRPOTrainer` over several RL seeds: learning per step and seconds per step, same task.

Two tasks (`arith_task.py`): `demo` (SmolLM2-135M-Instruct, 2-digit `+`/`-`) and `sparse` (3-digit sums, where most
groups of 8 samples start with all-zero rewards), both 4 prompts x 8 samples, <= 32 new tokens, T = 0.7, lr 1e-5
linear to 0, DAPO, no KL. For each seed both trainers get the same training prompts (forgeweave's train split for
that seed, formatted with the model's chat template), the same reward (`math_answer`) and the same evaluator (greedy
pass@1 on that seed's held-out split, before and after). TRL runs in its own venv (`--trl-venv`, created on first
use with pinned TRL, datasets and the main venv's torch; never in `.venv`), in fp32 on the CPU; forgeweave runs
`--preset smollm2-arith` with the task's overrides in this process (plain mode), in the preset's precision.

Per seed it prints each side's gain (after - before); then each side's mean gain and its standard error over the
seeds, the difference with its standard error, and seconds per step (the median over the steps after the first;
TRL: an optimizer step's wall time, generation included; forgeweave: `perf/step_s`). The check the issue asks:
forgeweave's mean gain >= TRL's mean gain minus one standard error (of the difference), at >= 2.5x TRL's speed.

Every (task, seed, side) result is stored under `--out` (runs/bench-vs-trl/TASK/seed-N/) with the settings it was
measured with; a rerun reuses each stored result whose settings match (not forgeweave's commit), so an
interrupted benchmark continues; each result names the commit it was measured at, and after a change to forgeweave
`--only forgeweave --fresh` measures forgeweave's side again (`--fresh` alone: both).
`--fw-set` overrides forgeweave's side only (an ablation: `--fw-set update.autocast_bf16=false`); it is part of
forgeweave's stored key.
Usage: python bench/vs_trl.py [--task demo|sparse] [--seeds 0,1,2,3] [--steps 32] [--eval-problems 200]
                              [--only trl|forgeweave] [--fresh] [--set key=value ...] [--fw-set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from arith_task import PRESET, TASKS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRL_SPECS = ["trl==1.16.0", "datasets==5.2.0", "math-verify==0.9.0"]  # math-verify: the shared reward's parser
TRL, FW = "TRL 1.16 GRPOTrainer (fp32)", "forgeweave"


def trl_python(venv: Path) -> Path:
    """The TRL venv's python, created and filled on first use (idempotent: a stamp names what was installed)."""
    import torch

    specs = [f"torch=={torch.__version__.split('+')[0]}", *TRL_SPECS]
    stamp, py = venv / ".forgeweave-bench", venv / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == " ".join(specs):
        return py
    print(f"setting up {venv} with {' '.join(specs)} (once)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *specs], check=True)
    stamp.write_text(" ".join(specs))
    return py


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "")


def cpu_line() -> str:
    """The CPU and whether it has bf16 units: the figures differ several-fold between these machines."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    units = "AMX" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "no bf16 units"
    return f"{os.cpu_count()} cores, {cpu_model()} ({units})"


def git_commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def result_key(cfg, sets: list[str]) -> dict:
    """What a side's result depends on: the task's settings, the packages and the machine. Not forgeweave's code:
    each result records the commit it was measured at, and `--only forgeweave --fresh` measures it again."""
    import torch

    r, u = cfg.rollout, cfg.update
    key = {
        "steps": cfg.steps, "prompts": r.prompts_per_step, "group": r.group_size, "tokens": r.max_new_tokens,
        "temperature": r.temperature, "lr": u.lr, "warmup": u.warmup_steps, "seed": cfg.seed,
        "eval_problems": cfg.eval.max_problems, "sets": sets, "packages": [torch.__version__, *TRL_SPECS],
        "machine": [platform.machine(), os.cpu_count(), cpu_model()], "evaluated_on": "the task's split",
    }  # fmt: skip
    return key


def save_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def task_config(task: list[str], steps: int, problems: int, seed: int, extra: list[str]):
    from flows.runs import resolve_config

    return resolve_config(
        PRESET, None, [*task, *extra, f"steps={steps}", f"eval.max_problems={problems}", f"seed={seed}"]
    )


def run_forgeweave(cfg, root: Path) -> dict:
    from flows.execute import train
    from flows.planning import plan_run
    from forge.tracking import read_metrics

    cfg.orchestration.execution = "embedded"
    _, plan = plan_run(cfg)
    shutil.rmtree(root / "forgeweave", ignore_errors=True)
    t0 = time.perf_counter()
    summary = train(cfg, root / "forgeweave", plan, progress=True)
    wall = time.perf_counter() - t0
    rows = read_metrics(root / "forgeweave" / "metrics.jsonl")[1:]
    rewards = [r["reward/mean"] for r in rows]
    return {
        "step_s": statistics.median(r["perf/step_s"] for r in rows[1:] or rows),
        "detail": f"rollout {statistics.median(r['time/rollout_s'] for r in rows):.1f} s, "
        f"update {statistics.median(r['time/update_s'] for r in rows):.1f} s, "
        f"lowest LR scale {min(r.get('train/lr_scale', 1.0) for r in rows):.2f}",
        "reward_first10": statistics.mean(rewards[:10]), "reward_last10": statistics.mean(rewards[-10:]),
        "before": summary["eval"]["initial"]["pass@1"],
        "after": summary["eval"]["final"]["pass@1"],
        "wall_s": wall,
    }  # fmt: skip


def run_trl(cfg, root: Path, venv: Path, sets: list[str]) -> dict:
    """TRL's side of one seed: trained in its venv (once: its model and step log stay in `root`), then evaluated
    by forgeweave's evaluator on this seed's held-out split of the task (`sets`: every override of the task)."""
    from flows.evaluation import evaluate_checkpoint_dir
    from forge.models import smollm2_dir

    log = root / "trl-steps.json"
    if not (log.is_file() and (root / "trl" / "model" / "config.json").is_file()):
        t0 = time.perf_counter()
        steps = train_trl(cfg, root, venv)
        save_result(log, {**steps, "wall_s": time.perf_counter() - t0})
    res = json.loads(log.read_text())
    evals = [*sets, f"seed={cfg.seed}", f"eval.max_problems={cfg.eval.max_problems}"]
    before = evaluate_checkpoint_dir(smollm2_dir(), PRESET, evals, out=root / "eval-base.json")
    after = evaluate_checkpoint_dir(root / "trl" / "model", PRESET, evals, out=root / "eval-trl.json")
    rewards = res.get("rewards") or [float("nan")]
    first, last = (
        res.get("reward_first10", statistics.mean(rewards[:10])),
        res.get("reward_last10", statistics.mean(rewards[-10:])),
    )
    return {"step_s": statistics.median(res["step_s"][1:] or res["step_s"]), "detail": "generation + update in one step",
            "reward_first10": first, "reward_last10": last,
            "before": before["pass@1"], "after": after["pass@1"], "wall_s": res["wall_s"]}  # fmt: skip


def train_trl(cfg, root: Path, venv: Path) -> dict:
    """TRL's GRPOTrainer on this seed's training prompts (bench/trl_grpo.py in TRL's venv): its step times and
    rewards; the trained model in root/trl/model."""
    from forge.compose import data_sources
    from forge.data import build
    from forge.models import format_prompt_fn, load_tokenizer, smollm2_dir

    tok = load_tokenizer(cfg.model)
    count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    train_rows = build(data_sources(cfg), format_prompt_fn(tok, cfg.model), count).train
    data = root / "trl-train.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["model_input"], "answer": r["answer"]}) + "\n" for r in train_rows))
    r, u = cfg.rollout, cfg.update
    args = [
        f"--model={smollm2_dir()}", f"--data={data}", f"--out={root / 'trl'}", f"--steps={cfg.steps}",
        f"--prompts={r.prompts_per_step}", f"--group={r.group_size}", f"--max-new-tokens={r.max_new_tokens}",
        f"--temperature={r.temperature}", f"--lr={u.lr}", f"--warmup-steps={u.warmup_steps}", f"--seed={cfg.seed}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(trl_python(venv)), str(ROOT / "bench" / "trl_grpo.py"), *args], env=env,
                         stdout=subprocess.PIPE, text=True, check=True).stdout  # fmt: skip
    return json.loads(next(x for x in out.splitlines() if x.startswith("TRL-RESULT "))[11:])


def measured(side: str, cfg, root: Path, task: list[str], sets: list[str], args) -> dict:
    """One side's result for one seed: stored, or measured now and stored."""
    stored, key = root / f"{'trl' if side == TRL else 'forgeweave'}-result.json", result_key(cfg, sets)
    old = json.loads(stored.read_text()) if stored.is_file() and not args.fresh else {}
    if old.get("key") == key:
        print(f"{side}, seed {cfg.seed}: the result measured {old['measured']} ({stored})", flush=True)
        return old["result"]
    print(f"{side}, seed {cfg.seed}: measuring", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    res = run_trl(cfg, root, args.trl_venv, [*task, *sets]) if side == TRL else run_forgeweave(cfg, root)
    res["commit"] = git_commit()
    save_result(stored, {"key": key, "measured": time.strftime("%Y-%m-%d %H:%M"), "result": res})
    return res


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error (0 for one value).

    >>> mean_se([1.0, 3.0])
    (2.0, 1.0)
    """
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0)


def report(task: str, steps: int, problems: int, results: dict[int, dict[str, dict]]) -> str:
    """The per-seed table and the summary, as markdown (also what the README's table is made from)."""
    sides = [s for s in (TRL, FW) if all(s in r for r in results.values())]
    lines = [f"task {task}: SmolLM2-135M-Instruct, {steps} steps, greedy pass@1 on {problems} held-out problems; "
             f"{cpu_line()}", "", "| seed | " + " | ".join(f"{s}: before -> after (gain), s/step, train reward "
             "first -> last 10 steps" for s in sides) + " |", "|---" * (len(sides) + 1) + "|"]  # fmt: skip
    for seed, r in sorted(results.items()):
        cells = [
            f"{r[s]['before']:.3f} -> {r[s]['after']:.3f} ({r[s]['after'] - r[s]['before']:+.3f}), "
            f"{r[s]['step_s']:.1f}, {r[s]['reward_first10']:.3f} -> {r[s]['reward_last10']:.3f}"
            for s in sides
        ]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    commits = sorted({r[FW].get("commit", "?") for r in results.values() if FW in r})
    gains = {s: [r[s]["after"] - r[s]["before"] for r in results.values()] for s in sides}
    speed = {s: statistics.median(r[s]["step_s"] for r in results.values()) for s in sides}
    lines.append("")
    if commits:
        lines.append(f"- forgeweave measured at {', '.join(commits)}")
    for s in sides:
        m, se = mean_se(gains[s])
        lines.append(f"- {s}: mean gain {m:+.4f} +- {se:.4f} (SE, {len(gains[s])} seeds); median {speed[s]:.2f} s/step")
    if len(sides) == 2:
        (mt, set_), (mf, sef) = mean_se(gains[TRL]), mean_se(gains[FW])
        se_diff = (set_**2 + sef**2) ** 0.5
        verdict = "met" if mf >= mt - se_diff and speed[TRL] / speed[FW] >= 2.5 else "NOT met"
        lines.append(f"- forgeweave - TRL: {mf - mt:+.4f} +- {se_diff:.4f} (SE of the difference); forgeweave is "
                     f"{speed[TRL] / speed[FW]:.2f}x TRL's speed per step; check (gain >= TRL's - 1 SE, >= 2.5x): "
                     f"{verdict}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="demo")
    ap.add_argument("--seeds", default="0", help="comma-separated RL seeds, e.g. 0,1,2,3,4,5,6,7")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--only", choices=["trl", "forgeweave"], help="run one side only")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-vs-trl", help="where the runs go")
    ap.add_argument("--fresh", action="store_true", help="measure again even where a stored result matches")
    ap.add_argument("--trl-venv", type=Path, default=ROOT / ".venv-trl", help="TRL's own venv (created on first use)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both sides")
    ap.add_argument("--fw-set", action="append", default=[], metavar="KEY=VALUE", help="an override for forgeweave")
    args = ap.parse_args()
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(
            f"vs_trl.py: --seeds takes comma-separated integers, e.g. 0,1,2,3 (got {args.seeds!r})"
        ) from None
    root = (args.out / args.task).resolve()
    print(f"machine: {cpu_line()}; runs in {root}", flush=True)
    sides = [s for s in (TRL, FW) if args.only is None or args.only == ("trl" if s == TRL else "forgeweave")]
    results: dict[int, dict[str, dict]] = {}
    for seed in seeds:
        here = root / f"seed-{seed}"
        for side in sides:
            sets = [*args.set, *(args.fw_set if side == FW else [])]
            cfg = task_config(TASKS[args.task], args.steps, args.eval_problems, seed, sets)
            results.setdefault(seed, {})[side] = measured(side, cfg, here, TASKS[args.task], sets, args)
        table = report(args.task, args.steps, args.eval_problems, results)
        save_result(root / "table.json", {"seeds": {str(k): v for k, v in results.items()}})
        (root / "table.md").write_text(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
