"""forgeweave vs TRL's `GRPOTrainer`: seconds per step and learning on the same task, model and data, in one run.

The task is `arith_task.py`'s (SmolLM2-135M-Instruct, 2-digit `+`/`-`, 4 prompts x 8 samples, <= 32 new tokens,
T = 0.7, lr 1e-5 linear, DAPO, no KL). Both trainers get the same training prompts (forgeweave's train split,
formatted with the model's chat template) and the same reward (`math_answer`). TRL runs in its own venv
(`--trl-venv`, created on first use with pinned TRL, datasets and the main venv's torch; never in `.venv`), in fp32
on the CPU. forgeweave runs `--preset smollm2-arith` with the task's overrides in this process, in-process (no Ray).
Both trained models are scored by the same evaluator (greedy pass@1 on the held-out split).

Seconds per step: the median over the steps after the first (warm-up). For TRL, an optimizer step's wall time
(generation, reward, update); for forgeweave, `perf/step_s` of the loop.

Each side's result is written to `--out` (runs/bench-vs-trl). `--reuse-trl` takes TRL's result from there when it
was measured with the same settings on this machine (TRL's side does not change with forgeweave's code; the table
says when it was measured), so a forgeweave change is re-measured in minutes instead of TRL's half hour.
Usage: python bench/vs_trl.py [--steps 32] [--eval-problems 200] [--only trl|forgeweave] [--reuse-trl]
                              [--set key=value ...]
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

from arith_task import PRESET, TASK  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRL_SPECS = ["trl==1.16.0", "datasets==5.2.0", "math-verify==0.9.0"]  # math-verify: the shared reward's parser


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


def trl_key(cfg, extra: list[str]) -> dict:
    """What TRL's result depends on: the task's settings, the packages and the machine."""
    import torch

    r, u = cfg.rollout, cfg.update
    return {
        "steps": cfg.steps, "prompts": r.prompts_per_step, "group": r.group_size, "tokens": r.max_new_tokens,
        "temperature": r.temperature, "lr": u.lr, "warmup": u.warmup_steps, "seed": cfg.seed,
        "eval_problems": cfg.eval.max_problems, "sets": extra, "packages": [torch.__version__, *TRL_SPECS],
        "machine": [platform.machine(), platform.processor(), os.cpu_count(), cpu_model()],
    }  # fmt: skip


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "")


def save_result(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def task_config(steps: int, problems: int, extra: list[str]):
    from flows.runs import resolve_config

    return resolve_config(PRESET, None, [*TASK, *extra, f"steps={steps}", f"eval.max_problems={problems}"])


def run_forgeweave(cfg, root: Path) -> dict:
    from flows.execute import train
    from flows.planning import plan_run
    from forge.tracking import read_metrics

    cfg.orchestration.execution = "embedded"
    _, plan = plan_run(cfg)
    t0 = time.perf_counter()
    summary = train(cfg, root / "forgeweave", plan, progress=True)
    wall = time.perf_counter() - t0
    rows = read_metrics(root / "forgeweave" / "metrics.jsonl")[1:]
    return {
        "step_s": statistics.median(r["perf/step_s"] for r in rows),
        "detail": f"rollout {statistics.median(r['time/rollout_s'] for r in rows):.1f} s, "
        f"update {statistics.median(r['time/update_s'] for r in rows):.1f} s",
        "before": summary["eval"]["initial"]["pass@1"],
        "after": summary["eval"]["final"]["pass@1"],
        "wall_s": wall,
    }


def run_trl(cfg, root: Path, venv: Path, extra: list[str]) -> dict:
    from flows.evaluation import evaluate_checkpoint_dir
    from forge.data import build
    from forge.models import format_prompt_fn, load_tokenizer, smollm2_dir

    tok = load_tokenizer(cfg.model)
    count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    train_rows = build(cfg, format_prompt_fn(tok, cfg.model), count).train
    data = root / "trl-train.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["model_input"], "answer": r["answer"]}) + "\n" for r in train_rows))
    r, u = cfg.rollout, cfg.update
    args = [
        f"--model={smollm2_dir()}", f"--data={data}", f"--out={root / 'trl'}", f"--steps={cfg.steps}",
        f"--prompts={r.prompts_per_step}", f"--group={r.group_size}", f"--max-new-tokens={r.max_new_tokens}",
        f"--temperature={r.temperature}", f"--lr={u.lr}", f"--warmup-steps={u.warmup_steps}", f"--seed={cfg.seed}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    out = subprocess.run([str(trl_python(venv)), str(ROOT / "bench" / "trl_grpo.py"), *args], env=env,
                         stdout=subprocess.PIPE, text=True, check=True).stdout  # fmt: skip
    wall = time.perf_counter() - t0
    seconds = json.loads(next(x for x in out.splitlines() if x.startswith("TRL-RESULT "))[11:])["step_s"]
    sets = [*TASK, *extra, f"eval.max_problems={cfg.eval.max_problems}"]
    before = evaluate_checkpoint_dir(smollm2_dir(), PRESET, sets, out=root / "eval-base.json")
    after = evaluate_checkpoint_dir(root / "trl" / "model", PRESET, sets, out=root / "eval-trl.json")
    return {"step_s": statistics.median(seconds[1:] or seconds), "detail": "generation + update in one step",
            "before": before["pass@1"], "after": after["pass@1"], "wall_s": wall}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--only", choices=["trl", "forgeweave"], help="run one side only")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-vs-trl", help="where both runs go")
    ap.add_argument("--reuse-trl", action="store_true", help="reuse TRL's result measured with the same settings")
    ap.add_argument("--trl-venv", type=Path, default=ROOT / ".venv-trl", help="TRL's own venv (created on first use)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both runs")
    args = ap.parse_args()
    root = args.out.resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores ({cpu_model()}); runs in {root}", flush=True)
    cfg = task_config(args.steps, args.eval_problems, args.set)
    res = {}
    if args.only != "forgeweave":
        cached, key = root / "trl-result.json", trl_key(cfg, args.set)
        old = json.loads(cached.read_text()) if args.reuse_trl and cached.is_file() else {}
        if old.get("key") == key:
            print(f"TRL: reusing the result measured {old['measured']} ({cached})", flush=True)
            trl = {**old["result"], "detail": f"{old['result']['detail']}; measured {old['measured']}"}
        else:
            if args.reuse_trl:
                print("TRL: no result with these settings on this machine yet: measuring it", flush=True)
            trl = run_trl(cfg, root, args.trl_venv, args.set)
            save_result(cached, {"key": key, "measured": time.strftime("%Y-%m-%d %H:%M"), "result": trl})
        res["TRL 1.16 GRPOTrainer (fp32)"] = trl
    if args.only != "trl":
        shutil.rmtree(root / "forgeweave", ignore_errors=True)
        res["forgeweave"] = run_forgeweave(cfg, root)
        save_result(root / "forgeweave-result.json", res["forgeweave"])
    print(f"\nSmolLM2-135M-Instruct, {args.steps} steps, greedy pass@1 on {args.eval_problems} held-out problems")
    print(f"{'':<30}{'s/step':>9}{'pass@1 before -> after':>26}{'wall s':>9}  detail")
    for name, r in res.items():
        cell = f"{r['before']:.3f} -> {r['after']:.3f} ({r['after'] - r['before']:+.3f})"
        print(f"{name:<30}{r['step_s']:>9.2f}{cell:>26}{r['wall_s']:>9.0f}  {r['detail']}")
    if len(res) == 2:
        trl, fw = res.values()
        print(f"\nforgeweave is {trl['step_s'] / fw['step_s']:.2f}x TRL's speed per step; pass@1 gain difference "
              f"{(fw['after'] - fw['before']) - (trl['after'] - trl['before']):+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
