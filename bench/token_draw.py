"""The hf rollout's token draw: `torch.multinomial` over the whole vocabulary (what `generate` does) vs
`forge.rollout.hf.sample_tokens` (a block of 256 tokens by its mass, then a token inside it), milliseconds per
decoding step at SmolLM2's vocabulary. That both draw from the same distribution is tested
(tests/rollout/test_sampling.py: chi-square over 200k draws).

Both draw from the same softmax of random logits (T = 0.7), alternating in one process, so machine noise hits
both; the ratio is what to read.
Usage: python bench/token_draw.py [--rows 32] [--vocab 49152] [--threads 2] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from forge.rollout.hf import sample_tokens


def multinomial(probs: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="sequences decoding at once")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 4.0 / 0.7
    probs = torch.softmax(logits, -1)
    draws = {"torch.multinomial": multinomial, "sample_tokens": sample_tokens}
    times: dict[str, list[float]] = {k: [] for k in draws}
    for rep in range(args.repeats + 1):  # repeat 0 warms up
        for name in draws if rep % 2 == 0 else reversed(draws):
            t = time.perf_counter()
            draws[name](probs)
            if rep:
                times[name].append(time.perf_counter() - t)
    print(f"[{args.rows}, {args.vocab}] probabilities, {torch.get_num_threads()} thread(s), {args.repeats} repeats")
    base = statistics.median(times["torch.multinomial"])
    for name, t in times.items():
        print(f"{name:<20}{statistics.median(t) * 1e3:>9.2f} ms/step{base / statistics.median(t):>8.1f}x")


if __name__ == "__main__":
    main()
