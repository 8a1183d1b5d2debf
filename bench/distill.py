"""On-policy distillation on this CPU: GRPO alone, distillation alone, and both, from the same untrained student.

Student: the preset's model (SmolLM2-135M-Instruct for `smollm2-arith`, as `make demo` starts from). Teacher: a
stronger checkpoint with the same tokenizer: one `make demo` wrote (runs/NAME/checkpoints/step-000010; GRPO trained
it, so GRPO reaches it as fast as anything), or one bench/sft_teacher.py fine-tuned on the train split's answers.
Three runs in this process (`forge.recipes.grpo.run`, plain mode, no checkpoints), same seed, same prompts, same
steps, the greedy held-out eval every `--eval-every` steps:

- `grpo`:    the preset's verifiers, no teacher (the demo's recipe);
- `distill`: no verifier, `distill.teacher` (per-token reverse KL as the reward, docs/distillation.md);
- `topk`:    no verifier, `distill.teacher` with `distill.topk=16` (the reverse KL to the teacher's top 16
             next tokens at every sampled position, in the loss), at lr 5e-5 (see MODES);
- `topk_forward`: the same with the forward KL (`distill.divergence=forward`);
- `both`:    the verifiers and the teacher (`distill.weight`).

Both teacher modes run at a constant LR (`update.adaptive.enabled=false`, see MODES); `--set` applies to every mode
and comes last, so it may override that.

The teacher's own pass@1 is measured on the same held-out rows (`forgeweave eval`'s code). The verdict follows
issue 32's acceptance 3: distillation closes >= 80% of the student -> teacher gap (X = student + 0.8 * gap) at
some step s_d, and GRPO needs at least 2 * s_d steps to reach X (or never within the budget: said so). Results go to
`--out`/results.jsonl; a mode already recorded there with the same settings is reused.

Usage: python bench/distill.py --teacher runs/demo/checkpoints/step-000010 [--steps 10] [--grpo-steps 20]
       [--eval-every 2] [--eval-rows 100] [--seed 0] [--modes grpo,distill,both,topk,topk_forward]
       [--out /tmp/distill-bench] [--set key=value ...]
       (smoke run: --preset tiny --teacher DIR_OF_A_TINY_MODEL --steps 2)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's forge, not an installed one
sys.path.insert(0, str(ROOT / "bench"))
from multiturn import cpu_name, peak_rss_mb, stderr  # noqa: E402  (bench/ is not a package)

# a teacher mode runs at a constant LR (update.adaptive off), as the published recipes do. The controller's signal
# (when measured: the grad norm per unit of mean |advantage|; since 2026-12-06 per its square root, with a cut only
# for a spike that holds or passes target^2) spikes under distillation: as the student learns, the mean per-token
# reverse KL falls (2.7 -> 0.05-0.3 nats) while a few unlikely sampled tokens keep the norm up, so the ratio jumps
# from ~30 to 130-270 on such steps. Measured (smollm2-arith, 0.940 teacher): the LR cut to 0.03-0.2 of its value
# and pass@1 0.715 at step 28, against 0.800 at a constant LR.
MODES = {
    "grpo": lambda teacher: [],
    "distill": lambda teacher: [f"distill.teacher={teacher}", "reward.verifiers=[]", "update.adaptive.enabled=false"],
    "both": lambda teacher: [f"distill.teacher={teacher}", "update.adaptive.enabled=false"],
    # an exact divergence with no sampling noise, so SFT's step size (bench/sft_teacher.py's lr): measured on 3-digit
    # sums, 1e-5 (the preset's, GRPO's) gave 0.51 at step 20
    "topk": lambda teacher: [*MODES["distill"](teacher), "distill.topk=16", "update.lr=5e-5"],
    "topk_forward": lambda teacher: [*MODES["topk"](teacher), "distill.divergence=forward"],
}
ALONE = ("distill", "topk", "topk_forward")  # the modes where the teacher is the only signal: acceptance 3's


def mode_sets(mode: str, args) -> list[str]:
    """A mode's own overrides: MODES', and GRPO's own budget when --grpo-steps gives one."""
    own = MODES[mode](args.teacher)
    return own + [f"steps={args.grpo_steps}"] if mode == "grpo" and args.grpo_steps else own


def eval_sets(args) -> list[str]:
    return [f"seed={args.seed}", f"eval.max_problems={args.eval_rows}", "eval.k=0", *args.sets]


def run_mode(mode: str, args, progress: bool) -> dict:
    """One training run; held-out pass@1 at every eval step, seconds per step, the reverse KL per step."""
    from forge.config import apply_overrides
    from forge.presets import get_preset
    from forge.recipes.grpo import run
    from forge.tracking import read_metrics

    # --set comes last: it may override a mode's own settings
    sets = [f"steps={args.steps}", f"eval.every={args.eval_every}", "checkpoint.every=0", "tracking.mlflow=false",
            *mode_sets(mode, args), *eval_sets(args)]  # fmt: skip
    cfg = apply_overrides(get_preset(args.preset), sets)
    run_dir = Path(tempfile.mkdtemp(prefix=f"distill-{mode}-"))
    t0 = time.perf_counter()
    run(cfg, run_dir, progress=progress)
    wall = time.perf_counter() - t0
    metrics = read_metrics(run_dir / "metrics.jsonl")
    step_s = sorted(m["perf/step_s"] for m in metrics if "perf/step_s" in m)
    return {
        "mode": mode, "pass": {m["step"]: m["eval/pass@1"] for m in metrics if "eval/pass@1" in m},
        "s_per_step": step_s[len(step_s) // 2] if step_s else None, "wall_s": round(wall),
        "reverse_kl": [round(m["distill/reverse_kl"], 4) for m in metrics if "distill/reverse_kl" in m],
        "teacher_s": [round(m["time/teacher_s"], 2) for m in metrics if "time/teacher_s" in m],
    }  # fmt: skip


def teacher_pass(args, out: Path) -> float:
    """The teacher's greedy pass@1 on the same held-out rows."""
    from flows.evaluation import evaluate_checkpoint_dir

    report = evaluate_checkpoint_dir(Path(args.teacher), args.preset, eval_sets(args), out=out / "teacher-eval.json")
    return report["pass@1"]


def first_reaching(passes: dict, x: float) -> int | None:
    """The first eval step whose pass@1 is >= x (None: never).

    >>> first_reaching({0: 0.3, 2: 0.5, 4: 0.7}, 0.6), first_reaching({0: 0.3}, 0.6)
    (4, None)
    """
    return next((s for s in sorted(passes) if passes[s] >= x), None)


def verdict(results: dict, teacher: float) -> list[str]:
    """The acceptance check: distillation's step reaching 80% of the gap against GRPO's step reaching it."""
    student = results["grpo"]["pass"][0] if "grpo" in results else next(iter(results.values()))["pass"][0]
    target = student + 0.8 * (teacher - student)
    lines = [f"student {student:.3f}, teacher {teacher:.3f}: 80% of the gap is pass@1 >= {target:.3f}"]
    if teacher <= student:
        return lines + ["verdict: none: the teacher is not stronger than the student on these rows"]
    steps = {m: first_reaching(r["pass"], target) for m, r in results.items()}
    for m, s in steps.items():
        lines.append(f"  {m:8s} reaches it at step {s}" if s is not None else f"  {m:8s} does not reach it")
    alone = [m for m in ALONE if m in steps]
    if not alone or "grpo" not in steps:
        return lines + ["verdict: none: run the grpo mode and a distillation mode (distill, topk, topk_forward; --modes)"]
    g, budget = steps["grpo"], max(results["grpo"]["pass"])
    for m in alone:
        d = steps[m]
        if d is None:
            lines.append(f"verdict ({m}): distillation alone did not close 80% of the gap within the budget")
        elif g is None:
            half = "" if 2 * d <= budget else f", but the budget ({budget}) is under twice step {d}: run longer"
            lines.append(f"verdict ({m}): distillation closes 80% of the gap at step {d}; GRPO alone does not "
                         f"reach it within {budget} steps{half}")  # fmt: skip
        else:
            ok = d <= g / 2
            lines.append(f"verdict ({m}): distillation at step {d}, GRPO at step {g}: {'' if ok else 'NOT '}"
                         "within half")  # fmt: skip
    return lines


def table(results: dict, n: int) -> str:
    modes = list(results)
    steps = sorted({s for r in results.values() for s in r["pass"]})
    head = "| step | " + " | ".join(f"{m} pass@1" for m in modes) + " |"
    rows = [head, "|" + "---|" * (len(modes) + 1)]
    rows += [f"| {s} | " + " | ".join(f"{results[m]['pass'][s]:.3f}" if s in results[m]["pass"] else ""
                                      for m in modes) + " |" for s in steps]  # fmt: skip
    rows.append("| s/step (median) | " + " | ".join(f"{results[m]['s_per_step']:.1f}" for m in modes) + " |")
    rows.append(f"(SE of a pass@1 near 0.5 over {n} rows: {stderr(0.5, n):.3f})")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="the teacher's model directory (a checkpoint make demo wrote)")
    ap.add_argument("--preset", default="smollm2-arith")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--grpo-steps", type=int, default=None,
                    help="GRPO's budget (default: --steps); twice --steps answers whether GRPO needs twice the steps")  # fmt: skip
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--eval-rows", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="grpo,distill,both")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="an override key=value (repeatable)")
    ap.add_argument("--out", default="/tmp/distill-bench")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.grpo_steps is not None and args.grpo_steps < 1:
        sys.exit(f"distill: --grpo-steps {args.grpo_steps} is not a step count: pass at least 1 (or leave it out)")
    if not (Path(args.teacher) / "config.json").is_file():
        sys.exit(f"distill: --teacher '{args.teacher}' is not a model directory: run `make demo` and pass "
                 "runs/NAME/checkpoints/step-000010 (or any local model with the student's tokenizer)")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    key = [args.preset, str(Path(args.teacher).resolve()), args.steps, args.eval_every, args.eval_rows, args.seed,
           args.sets]  # fmt: skip
    old = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    own = {m: mode_sets(m, args) for m in MODES}  # a record is reused only with its mode's current settings
    done = {r["mode"]: r for r in old if r["key"] == key and r.get("sets", []) == own.get(r["mode"], [])}
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; preset {args.preset}, teacher {args.teacher}, seed "
          f"{args.seed}, {args.steps} steps, eval every {args.eval_every} on {args.eval_rows} held-out rows, "
          f"overrides {args.sets}", flush=True)  # fmt: skip
    if "teacher" not in done:
        done["teacher"] = {"mode": "teacher", "key": key, "pass@1": teacher_pass(args, out)}
        with path.open("a") as f:
            f.write(json.dumps(done["teacher"]) + "\n")
    results = {}
    for mode in args.modes.split(","):
        if mode not in done:
            r = run_mode(mode, args, not args.quiet)
            done[mode] = {**r, "key": key, "sets": own[mode]}
            with path.open("a") as f:
                f.write(json.dumps(done[mode]) + "\n")
        results[mode] = {**done[mode], "pass": {int(s): p for s, p in done[mode]["pass"].items()}}
        r = results[mode]
        print(f"{mode}: pass@1 {r['pass']}, {r['s_per_step']:.1f} s/step, reverse KL {r['reverse_kl']}", flush=True)
    print(table(results, args.eval_rows))
    print("\n".join(verdict(results, done["teacher"]["pass@1"])))
    print(f"peak RSS {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
