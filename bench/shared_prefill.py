"""The hf rollout with `rollout.shared_prefill` off vs on (or `--knob compact_every`: compaction off, every 8 and
every 4 tokens): tokens/s of one GRPO rollout (B prompts x G samples).

bench/arith_task.py's shape: SmolLM2-135M-Instruct, 4 chat-formatted prompts ("Compute 37 + 48. Reply with only the
final integer, nothing else.") x 8 samples, <= 32 new tokens, T = 0.7, fp32, one generate() chunk (batch_size 64).
Both variants run in this process, alternating (the order flips every repeat), with the same seed per repeat, so
they sample the same tokens (the agreement is printed) and machine noise hits both; the ratio is what to read.
Usage: OMP_NUM_THREADS=1 python bench/shared_prefill.py [--model smollm2-135m-instruct] [--threads 1] [--repeats 5]
                                                       [--knob shared_prefill|compact_every]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from forge.config import ModelConfig
from forge.models import default_device, format_prompt_fn, load_policy
from forge.records import Rollouts
from forge.rollout import HFBackend, SamplingParams

TEMPLATE = "Compute {a} + {b}. Reply with only the final integer, nothing else."


def arith_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [TEMPLATE.format(a=rng.randint(10, 99), b=rng.randint(10, 99)) for _ in range(n)]


def timed(backend: HFBackend, prompts: list[str], params: SamplingParams) -> tuple[float, Rollouts]:
    t = time.perf_counter()
    ro = backend.generate(prompts, params)
    return time.perf_counter() - t, ro


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4, help="B")
    ap.add_argument("--samples", type=int, default=8, help="G")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--knob",
        choices=["shared_prefill", "compact_every"],
        default="shared_prefill",
        help="what to compare: shared prefill off/on, or compaction off (0) / every 8 / every 4 tokens",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(path=args.model)
    model, tok = load_policy(cfg)
    model = model.to(default_device()).eval()
    fmt = format_prompt_fn(tok, cfg)
    prompts = [fmt(p) for p in arith_prompts(args.prompts)]
    lengths = [len(tok(p, add_special_tokens=False).input_ids) for p in prompts]
    if args.knob == "shared_prefill":  # compaction off: only the prefill differs
        backends = {f"shared_prefill {k}": HFBackend(model, tok, shared_prefill=k == "on", compact_every=0)
                    for k in ("off", "on")}  # fmt: skip
    else:
        backends = {f"compact_every {k}": HFBackend(model, tok, compact_every=k) for k in (0, 8, 4)}
    times: dict[str, list[float]] = {k: [] for k in backends}
    tokens: dict[str, list[int]] = {k: [] for k in backends}
    same = total = 0
    for rep in range(args.repeats + 1):  # repeat 0 warms up
        params = SamplingParams(args.tokens, args.temperature, n=args.samples, seed=rep)
        order = list(backends) if rep % 2 == 0 else list(reversed(backends))
        runs = {name: timed(backends[name], prompts, params) for name in order}
        if rep == 0:
            continue
        for name, (seconds, ro) in runs.items():
            times[name].append(seconds)
            tokens[name].append(int(ro.completion_mask.sum()))
        a, b = (runs[k][1] for k in list(backends)[:2])  # compaction draws fewer numbers: its samples differ
        same += sum(x == y for x, y in zip(a.texts, b.texts, strict=True))
        total += len(a.texts)
    print(f"{args.model} on {model.device}, fp32, {torch.get_num_threads()} thread(s): {args.prompts} prompts x "
          f"{args.samples} samples, <= {args.tokens} new tokens, T={args.temperature}, prompt tokens {lengths}, "
          f"{args.repeats} repeats")  # fmt: skip
    print(f"{'variant':<22}{'s/rollout':>11}{'tokens/s':>10}{'vs off':>9}")
    rate = {k: sum(tokens[k]) / sum(times[k]) for k in backends}
    for name in backends:
        ratio = rate[name] / rate[next(iter(backends))]
        print(f"{name:<22}{statistics.median(times[name]):>11.3f}{rate[name]:>10.1f}{ratio:>8.2f}x")
    print(f"identical completions (same seed), first two variants: {same}/{total}")


if __name__ == "__main__":
    main()
