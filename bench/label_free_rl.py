"""Label-free rewards on a real model: labelled vs ensemble vs majority vote vs mean, same seeds and steps.

Each run trains SmolLM2-135M-Instruct with `--preset smollm2-arith-unlabeled` (2-digit additions from a file
without answers, forge/tasks/arith.py) and differs only in the reward:

- labelled: `math_answer` against the reference answers (the same train prompts, with their answers written to a
  labelled copy of the train file): the ceiling;
- ensemble: the preset's label-free Gaussian ensemble of six weak verifiers (self-consistency, length, format, two
  partial rule checks, the frozen initial policy as LLM judge);
- majority: majority vote (TTRL): the group's most common final answer gets 1, the rest 0;
- mean: the plain average of the six verifiers' scores.

Every run evaluates greedy pass@1 on the same 200 held-out labelled problems at step 0 and at the end (no eval in
between); the table prints each run's gain and its share of the labelled run's gain. A run already finished in
`--out` (an earlier invocation) is reused, so an interrupted benchmark continues where it stopped. Runs go one after another (or `--jobs 2` at a time,
each with a share of the cores) in subprocesses, so one run's memory never carries into the next.

Usage: python bench/label_free_rl.py [--steps 20] [--seeds 0] [--runs labelled,ensemble,majority,mean]
       [--jobs 1] [--out /tmp/label-free-rl] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = "smollm2-arith-unlabeled"
RUNS: dict[str, list[str]] = {
    "labelled": ["reward.label_free=false", "reward.aggregate=weighted", "reward.verifiers=[math_answer]"],
    "ensemble": [],
    # the vote reads the completions only; group_agreement is kept so its metrics are logged (no judge to pay for)
    "majority": ["reward.aggregate=majority", "reward.verifiers=[group_agreement]"],
    "mean": ["reward.aggregate=mean"],
}


def labelled_train_file(out: Path) -> Path:
    """The preset's train prompts with their answers ("Compute a + b. ..." -> a + b), for the labelled run."""
    from forge.tasks.arith import TRAIN_FILE

    path = out / "arith_labelled_train.jsonl"
    lines = []
    for line in TRAIN_FILE.read_text().splitlines():
        row = json.loads(line)
        lines.append(json.dumps({**row, "answer": true_sum(row["prompt"])}, sort_keys=True))
    path.write_text("\n".join(lines) + "\n")
    return path


def true_sum(prompt: str) -> str:
    """The reference answer of an "a + b" prompt (the task's answers are not in its train file)."""
    a, b = map(int, re.search(r"(\d+) \+ (\d+)", prompt).groups())
    return str(a + b)


def command(name: str, seed: int, steps: int, out: Path, extra: list[str], threads: int) -> list[str]:
    sets = [*RUNS[name], f"seed={seed}", f"steps={steps}", f"threads={threads}", "eval.every=0",
            "tracking.mlflow=false", *extra]  # fmt: skip
    if name == "labelled":
        sets.append(f"data.source={labelled_train_file(out)}")
    argv = [sys.executable, "-m", "flows.cli", "run", "--preset", PRESET, "--no-prefect", "--quiet",
            "--runs-dir", str(out), "--name", f"{name}-seed{seed}"]  # fmt: skip
    return argv + [a for s in sets for a in ("--set", s)]


def result(out: Path, name: str, seed: int, wall: float, rc: int) -> dict:
    summary_path = out / f"{name}-seed{seed}" / "summary.json"
    if rc != 0 or not summary_path.is_file():
        return {"run": name, "seed": seed, "failed": f"exit {rc}, see {out / f'{name}-seed{seed}.log'}"}
    s = json.loads(summary_path.read_text())
    before, after = s["eval"]["initial"]["pass@1"], s["eval"]["final"]["pass@1"]
    return {"run": name, "seed": seed, "before": before, "after": after, "gain": after - before, "wall_s": wall}


def run_all(
    names: list[str], seeds: list[int], steps: int, out: Path, extra: list[str], jobs: int, threads: int
) -> list[dict]:
    threads = threads or max(1, (os.cpu_count() or 2) // jobs)
    queue = [(n, s) for s in seeds for n in names]
    running: list[tuple[str, int, subprocess.Popen, float]] = []
    results = []
    for name, seed in list(queue):  # finished by an earlier invocation (same --out): reused, not rerun
        if (out / f"{name}-seed{seed}" / "summary.json").is_file():
            queue.remove((name, seed))
            results.append(result(out, name, seed, _recorded_wall(out / f"{name}-seed{seed}"), 0))
            print(f"reuse {name} seed {seed}: {_cells(results[-1])}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    while queue or running:
        while queue and len(running) < jobs:
            name, seed = queue.pop(0)
            log = (out / f"{name}-seed{seed}.log").open("w")
            print(f"start {name} seed {seed} ({steps} steps)", flush=True)
            proc = subprocess.Popen(command(name, seed, steps, out, extra, threads), stdout=log, stderr=log, env=env)
            running.append((name, seed, proc, time.perf_counter()))
        time.sleep(2)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            name, seed, proc, t0 = item
            results.append(result(out, name, seed, time.perf_counter() - t0, proc.returncode))
            print(f"done  {name} seed {seed}: {_cells(results[-1])}", flush=True)
    return results


def _recorded_wall(run_dir: Path) -> float:
    return float(json.loads((run_dir / "summary.json").read_text())["seconds"]["total"])


def _cells(r: dict) -> str:
    if "failed" in r:
        return r["failed"]
    return f"pass@1 {r['before']:.3f} -> {r['after']:.3f} ({r['gain']:+.3f}) in {r['wall_s']:.0f} s"


def table(results: list[dict], steps: int) -> str:
    gains = {r["seed"]: r["gain"] for r in results if r["run"] == "labelled" and "gain" in r}
    lines = [f"SmolLM2-135M-Instruct, 2-digit additions, {steps} steps, greedy pass@1 on 200 held-out problems",
             "| reward | seed | pass@1 before -> after | gain | share of labelled gain | wall |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['run']} | {r['seed']} | failed: {r['failed']} | | | |")
            continue
        ref = gains.get(r["seed"])
        share = f"{r['gain'] / ref:.0%}" if ref and ref > 0 else "-"
        lines.append(f"| {r['run']} | {r['seed']} | {r['before']:.3f} -> {r['after']:.3f} | {r['gain']:+.3f} | "
                     f"{share} | {r['wall_s'] / 60:.0f} min |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; every reward runs with each")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = cores / jobs)")
    ap.add_argument("--out", default="/tmp/label-free-rl", help="runs directory (a run name taken there is refused)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run")  # fmt: skip
    args = ap.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if unknown := [n for n in names if n not in RUNS]:
        ap.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run_all(names, seeds, args.steps, out, args.overrides, args.jobs, args.threads)
    text = table(results, args.steps)
    print("\n" + text)
    (out / "label_free_rl.md").write_text(text + "\n")
    (out / "label_free_rl.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all("failed" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
