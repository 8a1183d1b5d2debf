"""How much the learning tests' outcomes depend on the seed: each test's scenario, run at several seeds, with the
figure the test asserts.

The learning tests assert a threshold on one seed. On the tiny model that figure spreads widely over seeds. For
example, tiny-unlabeled's final greedy pass@1 was 0.82 at seed 0 and 0.27 at seed 1 with the same code (2026-12-03).
A threshold picked on one seed then says little about the code, and any change that moves the random numbers (a
new sampling order, derived seeds) breaks it. This prints each scenario's spread, so a threshold can be set below
the worst seed with the spread stated beside it.

Scenarios (the tests they stand for):
  tiny  `--preset tiny`, 200 steps: final greedy pass@1 (tests/test_cli.py::test_tiny_preset_learns)
  lf    `--preset tiny-unlabeled`: final greedy pass@1 (tests/test_labelfree_learning.py)
  lora  tiny 80 steps, then a rank-16 adapter for 100 steps on that checkpoint: base / adapter pass@1
        (tests/test_lora.py::test_lora_learns_on_a_pretrained_tiny_model)
  trl   the TRL example through `forgeweave run`, groups of 32, 150 steps: reward_correct rise (steps 1-10 ->
        141-150) and pass@1 at steps 0/150 (before 2026-12-05: groups of 16, 300 steps; variants with `--set`)
        (tests/test_trl_example.py::test_trl_example_learns_with_forgeweave_run)
  trlapi  the TRL example through `forge.train`, 40 steps: reward/mean over steps 1-5 and 36-40 and its rise
        (tests/test_trl_example.py::test_trl_example_learns_with_forge_train)
  mt    `tiny-multiturn` with a TRL-style environment class, 30 steps: reward/mean over steps 1-5 and 26-30 and
        its rise (tests/env/test_multiturn_learning.py::test_a_trl_environment_class_learns_on_the_tiny_model)
  teacher  pure distillation from the student edited to prefer "7", 30 steps: p("7") after four prompts before
        and after, first and last reverse KL (tests/rewards/test_teacher.py::
        test_distillation_raises_the_preferred_tokens_probability)
  topk  the same at 10 steps, sampled-token reward (k0) and top-8 divergence (k8): p("7") after, and k8's first
        and last reverse KL (tests/rewards/test_teacher.py::test_topk_distillation_names_the_token_...)
  rayteacher  tests/flows/test_ray_teacher.py's config (lr 0.1, top-8 divergence, 20 steps) run in this process
        (execution=embedded): p("7") before and after, first and last reverse KL (the Ray test's figures, which
        its first steps equal; tests/flows/test_ray_teacher.py::test_ray_distillation_learns_the_teachers_token)

Each run is a subprocess (plain mode, one thread), one after another; results go to `--out`/results.jsonl, and a
run already recorded there is reused, so an interrupted benchmark continues where it stopped.

Usage: python bench/seed_spread.py [--scenarios tiny,lf,lora,trl,trlapi,mt,teacher,topk,rayteacher]
       [--seeds 0,1,2,3] [--out /tmp/seed-spread]
       [--steps N]  (N overrides every scenario's step count: a smoke run, not the tests' figures)
       [--set KEY=VALUE ...]  (added to the trl scenario's overrides: a variant, recorded apart)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_EXAMPLE = ROOT / "examples" / "trl_style"
TRL_SETS = ["threads=1", "checkpoint.every=0", "tracking.mlflow=false", "eval.k=0", "model.chat_template=true",
            "data.eval_split=test", "data.answer_column=target",
            "reward.verifiers=[trl_rewards:reward_format,trl_rewards:reward_correct]", "reward.weights=[0.1,1.0]",
            "rollout.group_size=32", "steps=150", "eval.every=150"]  # fmt: skip


def cli_run(args: list[str], sets: list[str]) -> None:
    from flows.cli import main

    code = main(["run", *args, "--quiet", "--no-prefect", *(a for s in sets for a in ("--set", s))])
    if code != 0:
        raise SystemExit(f"run {args} {sets} exited {code}")


def final_pass(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["eval"]["final"]["pass@1"]


def preset_run(preset: str, seed: int, tmp: Path, steps: int | None) -> dict:
    sets = [f"seed={seed}", *([f"steps={steps}"] if steps else [])]
    cli_run(["--preset", preset, "--name", "t", "--runs-dir", str(tmp)], sets)
    return {"final": final_pass(tmp / "t")}


def lora_run(seed: int, tmp: Path, steps: int | None) -> dict:
    from forge.presets import tiny
    from forge.recipes.grpo import run

    def cfg(n: int):
        c = tiny()
        c.seed, c.steps, c.threads, c.tracking.mlflow = seed, n, 1, False
        c.eval.k, c.eval.every, c.checkpoint.every = 0, n, n
        return c

    base_steps, adapter_steps = (steps, steps) if steps else (80, 100)
    base = run(cfg(base_steps), tmp / "base", progress=False)
    c = cfg(adapter_steps)
    c.model.path = str(tmp / "base" / "checkpoints" / f"step-{base_steps:06d}")
    c.model.lora.rank, c.update.lr = 16, 3e-3
    lora = run(c, tmp / "lora", progress=False)
    return {"base": base["eval"]["final"]["pass@1"], "adapter": lora["eval"]["final"]["pass@1"]}


def trl_run(seed: int, tmp: Path, steps: int | None, extra: list[str]) -> dict:
    from forge.tracking import read_metrics

    sys.path.insert(0, str(TRL_EXAMPLE))
    import build_dataset

    build_dataset.build(tmp / "arith-chat")
    build_dataset.tiny_chat_model(tmp / "tiny-chat")
    sets = [*TRL_SETS, f"model.path={tmp / 'tiny-chat'}", f"data.source={tmp / 'arith-chat'}", f"seed={seed}"]
    if steps:
        sets += [f"steps={steps}", f"eval.every={steps}"]
    sets += extra
    cli_run(["--preset", "tiny", "--name", "t", "--runs-dir", str(tmp)], sets)
    rows = read_metrics(tmp / "t" / "metrics.jsonl")
    correct = [r["reward/reward_correct/mean"] for r in rows if "reward/reward_correct/mean" in r]
    return {"correct_rise": sum(correct[-10:]) / 10 - sum(correct[:10]) / 10,
            "pass@1": [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]}  # fmt: skip


def trlapi_run(seed: int, tmp: Path, steps: int | None) -> dict:
    import forge
    from forge.tracking import read_metrics

    sys.path.insert(0, str(TRL_EXAMPLE))
    import build_dataset
    from datasets import load_from_disk
    from trl_rewards import reward_correct, reward_format

    build_dataset.build(tmp / "arith-chat")
    build_dataset.tiny_chat_model(tmp / "tiny-chat")
    data = load_from_disk(str(tmp / "arith-chat"))
    sets = [f"model.path={tmp / 'tiny-chat'}", f"steps={steps or 40}", "threads=1", "eval.every=0", "eval.k=0",
            "checkpoint.every=0", "tracking.mlflow=false", "model.chat_template=true", "data.answer_column=target",
            f"seed={seed}"]  # fmt: skip
    forge.train(preset="tiny", dataset=data["train"], eval_dataset=data["test"], progress=False,
                reward_funcs=[reward_format, reward_correct], run_dir=tmp / "api", overrides=sets)  # fmt: skip
    rows = [r["reward/mean"] for r in read_metrics(tmp / "api" / "metrics.jsonl") if r["step"] > 0]
    first, last = sum(rows[:5]) / 5, sum(rows[-5:]) / 5
    return {"first": round(first, 3), "last": round(last, 3), "rise": round(last - first, 3)}


def mt_run(seed: int, tmp: Path, steps: int | None) -> dict:
    import forge
    from forge.tracking import read_metrics
    from tests.env.graded import reward_func
    from tests.env.test_multiturn_learning import GuessEnv

    n = steps or 30
    sets = [f"steps={n}", "threads=1", "tracking.mlflow=false", "checkpoint.every=0", "eval.every=0",
            "rollout.max_new_tokens=3", "update.lr=2e-3", f"seed={seed}"]  # fmt: skip
    forge.train(preset="tiny-multiturn", environment_factory=GuessEnv, reward_funcs=[reward_func], overrides=sets,
                run_dir=tmp / "run", progress=False)  # fmt: skip
    metrics = read_metrics(tmp / "run" / "metrics.jsonl")
    rows = [r["reward/mean"] for r in metrics if r["step"] > 0 and "reward/mean" in r]
    first, last = sum(rows[:5]) / 5, sum(rows[-5:]) / 5
    return {"first": round(first, 3), "last": round(last, 3), "rise": round(last - first, 3)}


def p_x(model, tok) -> float:
    """The model's mean probability of the distillation teacher's token after four prompts (as the tests read it)."""
    import torch

    from tests.rewards.test_teacher import X

    prompts = tok(["1+2=", "4+4=", "3+5=", "0+6="], return_tensors="pt")
    with torch.no_grad():
        return float(model.eval()(**prompts).logits[:, -1].softmax(-1)[:, tok.convert_tokens_to_ids(X)].mean())


def teacher_run(seed: int, tmp: Path, steps: int | None, topk: int = 0, ray_cfg: bool = False) -> dict:
    """tests/rewards/test_teacher.py's distillation run (or tests/flows/test_ray_teacher.py's config, embedded)."""
    import dataclasses

    import torch

    from forge.api import train
    from forge.models import load_policy
    from tests.rewards.test_teacher import X, prefers, reverse_kls, run_cfg, save

    torch.set_num_threads(1)
    n = steps or (20 if ray_cfg else 30)
    if ray_cfg:
        from tests.flows.test_ray_teacher import distill_cfg

        cfg = distill_cfg(tmp, n, "embedded")
        cfg.checkpoint.every = n
    else:
        cfg = run_cfg(n)
        cfg.distill.topk = topk
    cfg.seed = seed
    start, tok = load_policy(cfg.model, seed=cfg.seed)
    cfg.distill.teacher = save(prefers(start, tok, X, gap=2.0), tok, tmp / "teacher")
    train(cfg, run_dir=tmp / "run", progress=False)
    end, _ = load_policy(dataclasses.replace(cfg.model, path=str(tmp / "run" / "checkpoints" / f"step-{n:06d}")))
    kl = reverse_kls(tmp / "run")
    return {"p_before": round(p_x(start, tok), 4), "p_after": round(p_x(end, tok), 4), "kl_first": round(kl[0], 3),
            "kl_last": round(kl[-1], 3)}  # fmt: skip


def topk_run(seed: int, tmp: Path, steps: int | None) -> dict:
    k0, k8 = (teacher_run(seed, tmp / f"k{k}", steps or 10, topk=k) for k in (0, 8))
    return {"k0_p_after": k0["p_after"], "k8_p_after": k8["p_after"], "k8_kl_first": k8["kl_first"],
            "k8_kl_last": k8["kl_last"]}  # fmt: skip


def one(scenario: str, seed: int, steps: int | None, extra: list[str]) -> dict:
    """Run one scenario at one seed in this process; its figures."""
    tmp = Path(tempfile.mkdtemp(prefix=f"seed-spread-{scenario}-{seed}-"))
    t0 = time.perf_counter()
    if scenario in ("tiny", "lf"):
        out = preset_run("tiny" if scenario == "tiny" else "tiny-unlabeled", seed, tmp, steps)
    elif scenario == "lora":
        out = lora_run(seed, tmp, steps)
    elif scenario == "trl":
        out = trl_run(seed, tmp, steps, extra)
    elif scenario == "trlapi":
        out = trlapi_run(seed, tmp, steps)
    elif scenario == "mt":
        out = mt_run(seed, tmp, steps)
    elif scenario == "teacher":
        out = teacher_run(seed, tmp, steps)
    elif scenario == "topk":
        out = topk_run(seed, tmp, steps)
    elif scenario == "rayteacher":
        out = teacher_run(seed, tmp, steps, ray_cfg=True)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    seconds, variant = round(time.perf_counter() - t0), {"sets": extra} if extra else {}
    return {"scenario": scenario, "seed": seed, "steps": steps, **variant, **out, "seconds": seconds}


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())


def recorded(results: Path) -> dict[tuple, dict]:
    if not results.exists():
        return {}
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(r["scenario"], r["seed"], r["steps"], tuple(r.get("sets", ()))): r for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="tiny,lf,lora,trl")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--out", default="/tmp/seed-spread")
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's steps (smoke runs)")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE added to the trl scenario's overrides")
    ap.add_argument("--one", nargs=2, metavar=("SCENARIO", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args.steps, args.set)), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, done = out / "results.jsonl", recorded(out / "results.jsonl")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; steps: {args.steps or 'the tests own'}")
    for scenario in args.scenarios.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            key = (scenario, seed, args.steps, tuple(args.set if scenario == "trl" else ()))
            if key not in done:
                cmd = [sys.executable, __file__, "--one", scenario, str(seed)]
                cmd += ["--steps", str(args.steps)] if args.steps else []
                cmd += [a for s in key[3] for a in ("--set", s)]
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{scenario} seed {seed} failed:\n{proc.stderr[-3000:]}")
                done[key] = json.loads(line[7:])
                with results.open("a") as f:
                    f.write(line[7:] + "\n")
            r = done[key]
            figures = {k: v for k, v in r.items() if k not in ("scenario", "seed", "steps", "sets")}
            print(f"{scenario:5s} seed {seed}: {json.dumps(figures)}", flush=True)


if __name__ == "__main__":
    main()
