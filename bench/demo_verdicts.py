"""Does the math-verify `math_answer` change `make demo`? Trains the demo (preset smollm2-arith, plain mode) with a
verifier that scores exactly like `math_answer` and also computes the verdict of the number-only checker it replaced
(`extract_answer` + `answers_match`) on every completion it sees: the training rollouts of every step and every
eval completion (greedy and pass@k).

When no verdict differs, the run with the old checker would have received the same rewards and advantages at every
step, so its updates, weights and eval numbers are the same too: the demo numbers do not move. Otherwise the script
prints each differing completion. The verifier is named `math_answer_audit`, so its metrics read
`reward/math_answer_audit/...`; it decides eval as math_answer does (eval.verifiers' default for an import-path
verifier).

Usage: python bench/demo_verdicts.py [--runs-dir /tmp/demo-verdicts] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from forge.rewards.math import answers_match, extract_answer
from forge.rewards.verifiers import math_answer

SEEN: list[int] = [0]
DIFFERENT: list[dict] = []


def math_answer_audit(prompts, completions, answer, **kwargs):
    """`math_answer`'s scores; every completion whose old verdict differs is recorded in DIFFERENT."""
    scores = math_answer(prompts, completions, answer=answer)
    for text, ref, score in zip(completions, answer, scores, strict=True):
        if ref is None:
            continue
        SEEN[0] += 1
        old = float(answers_match(extract_answer(text), str(ref)))
        if old != score:
            DIFFERENT.append({"completion": text, "answer": str(ref), "new": score, "old": old})
    return scores


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-dir", default="/tmp/demo-verdicts")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    audit = importlib.import_module("demo_verdicts")  # the copy the run imports by path (not this __main__)
    from flows.cli import main as cli

    name = f"audit-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = ["reward.verifiers=[demo_verdicts:math_answer_audit]", "tracking.mlflow=false", *args.overrides]
    argv = ["run", "--preset", "smollm2-arith", "--no-prefect", "--quiet", "--runs-dir", args.runs_dir, "--name", name]
    rc = cli(argv + [a for s in sets for a in ("--set", s)])
    summary = json.loads((Path(args.runs_dir) / name / "summary.json").read_text()) if rc == 0 else {}
    print(f"completions checked: {audit.SEEN[0]}; verdicts that differ from the old checker: {len(audit.DIFFERENT)}")
    for d in audit.DIFFERENT[:50]:
        print(f"  answer {d['answer']!r}: old {d['old']} new {d['new']}: {d['completion']!r}")
    if summary:
        first, last = summary["eval"]["initial"], summary["eval"]["final"]
        print(f"greedy pass@1 {first['pass@1']:.3f} -> {last['pass@1']:.3f} ({summary['steps']} steps)")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
