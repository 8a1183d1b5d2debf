"""math_answer speed and verdicts: the old checker (extract_answer + answers_match) vs today's (fast path + math-verify).

Measured in one run, on the same items:
- integer completions ("The answer is 57.", "57.0", "1,234", ...; tests/test_math_verify.py's generator): items/s
  of both, and whether every verdict is the same;
- LaTeX answers (tests/math_answer_cases.py, cycled): items/s of both (the new one includes the child process's
  round trip and math-verify's sympy work; the first call also starts the child, timed separately);
- with --smollm2: SmolLM2-135M-Instruct's greedy completions on the smollm2-arith eval split (200 problems,
  32 new tokens, as the preset evaluates), pass@1 under both checkers and the completions where they differ.

Usage: python bench/math_answer.py [--items 4000] [--smollm2]   (add --set-threads 1 on a shared machine)
"""

from __future__ import annotations

import argparse
import time

import torch

from forge.rewards.math import answers_match, completion_matches, extract_answer, is_plain_number
from forge.rewards.mathverify import math_verify_match
from tests.math_answer_cases import CASES
from tests.test_math_verify import _arith_completions


def old(completion: str, ref: str) -> bool:
    return answers_match(extract_answer(completion), ref)


def rates(pairs: list[tuple[str, str]], repeats: int = 3) -> tuple[float, float, list[bool], list[bool]]:
    """Items/s of the old and the new checker, best of `repeats` alternated runs (the machine is shared)."""
    best = {old: 0.0, completion_matches: 0.0}
    verdicts = {}
    for _ in range(repeats):
        for check in best:
            t0 = time.perf_counter()
            verdicts[check] = [check(c, r) for c, r in pairs]
            best[check] = max(best[check], len(pairs) / (time.perf_counter() - t0))
    return best[old], best[completion_matches], verdicts[old], verdicts[completion_matches]


def smollm2_completions() -> list[tuple[str, str]]:
    from forge.compose import data_sources
    from forge.data import build
    from forge.models import format_prompt_fn, load_policy
    from forge.presets import smollm2_arith
    from forge.rollout import make_backend
    from forge.rollout.base import SamplingParams

    cfg = smollm2_arith()
    model, tok = load_policy(cfg.model, seed=cfg.seed)
    model.requires_grad_(False)
    rows = build(data_sources(cfg), format_prompt_fn(tok, cfg.model), lambda s: len(tok(s, add_special_tokens=False).input_ids)).eval
    backend = make_backend("hf", model, tok, autocast_bf16=cfg.rollout.autocast_bf16, rollout=cfg.rollout)
    params = SamplingParams(
        max_new_tokens=cfg.eval.max_new_tokens, temperature=0.0, n=1, batch_size=cfg.eval.batch_size
    )
    out = backend.generate([r["model_input"] for r in rows], params)
    return list(zip(out.texts, [str(r["answer"]) for r in rows], strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=4000)
    ap.add_argument("--smollm2", action="store_true", help="also score SmolLM2's greedy completions (CPU, ~1 min)")
    ap.add_argument("--set-threads", type=int, default=0, help="torch threads (0 = default)")
    args = ap.parse_args()
    if args.set_threads:
        torch.set_num_threads(args.set_threads)

    t0 = time.perf_counter()
    math_verify_match("$1$", "$1$")  # starts the child process (the integer run below may need it: "Answer: a + b = x")
    print(f"math-verify child start: {time.perf_counter() - t0:.2f} s")
    ints = _arith_completions(args.items)
    old_rate, new_rate, old_v, new_v = rates(ints)
    same = sum(a == b for a, b in zip(old_v, new_v, strict=True))
    print(f"integer completions ({len(ints)}, best of 3): old {old_rate:,.0f} items/s, new {new_rate:,.0f} items/s; "
          f"same verdict on {same}/{len(ints)}")  # fmt: skip
    fast = [(c, r) for c, r in ints if (p := extract_answer(c)) is not None and is_plain_number(p)]
    old_rate, new_rate, old_v, new_v = rates(fast)
    same = sum(a == b for a, b in zip(old_v, new_v, strict=True))
    print(f"  of which on the fast path ({len(fast)}): old {old_rate:,.0f} items/s, new {new_rate:,.0f} items/s; "
          f"same verdict on {same}/{len(fast)}")  # fmt: skip

    latex = [(c, g) for _, g, c, _ in CASES] * 3
    old_rate, new_rate, _, _ = rates(latex, repeats=1)
    print(
        f"LaTeX cases ({len(latex)}, {len(CASES)} distinct): old {old_rate:,.0f} items/s, new {new_rate:,.0f} items/s"
    )

    if args.smollm2:
        pairs = smollm2_completions()
        old_v = [old(c, r) for c, r in pairs]
        new_v = [completion_matches(c, r) for c, r in pairs]
        print(f"smollm2-arith greedy pass@1 ({len(pairs)} problems): old {sum(old_v) / len(pairs):.3f}, "
              f"new {sum(new_v) / len(pairs):.3f}")  # fmt: skip
        for (c, r), a, b in zip(pairs, old_v, new_v, strict=True):
            if a != b:
                print(f"  differs: ref {r!r} completion {c!r}: old {a}, new {b}")


if __name__ == "__main__":
    main()
