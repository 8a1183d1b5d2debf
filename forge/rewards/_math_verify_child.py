"""The math-verify checker process started by forge/rewards/mathverify.py (run as a script, not imported).

argv: parse/verify timeout in whole seconds, address-space limit in MiB. It limits its own memory, imports
math-verify, prints one JSON line ({"ready": true} or {"error": "..."}), then answers one JSON line per request
line on stdin: {"gold": str, "pred": str} -> {"match": bool, "gave_up": bool} (gave_up: a math-verify timeout or
the memory limit ended the check). It ends when stdin closes.

It runs on its own main thread, so math-verify's signal-based timeouts work here; work they cannot interrupt (a
huge integer power in C) is bounded by the parent, which kills this process past its deadline.
"""

import functools
import json
import logging
import resource
import sys


class _TimeoutCounter(logging.Handler):
    """math-verify reports a timeout only as a log record ("Timeout during parsing/comparison"); count them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Timeout during")


def main() -> None:
    timeout_s, memory_mib = int(sys.argv[1]), int(sys.argv[2])
    if memory_mib > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mib << 20, memory_mib << 20))
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    counter = _TimeoutCounter()
    mv_logger = logging.getLogger("math_verify")
    mv_logger.addHandler(counter)
    mv_logger.propagate = False  # its records quote the whole input; the parent reports timeouts itself
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    # a group's G completions share one reference: parse it once (sympy objects are immutable; a timed-out parse
    # is cached as [] too, so an adversarial reference costs its timeout once)
    parse_gold = functools.lru_cache(maxsize=4096)(
        lambda gold: parse(gold, extraction_config=config, parsing_timeout=timeout_s)
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        before, gave_up = counter.count, False
        try:
            gold = parse_gold(req["gold"])
            pred = parse(req["pred"], extraction_config=config, parsing_timeout=timeout_s)
            match = bool(gold and pred and verify(gold, pred, timeout_seconds=timeout_s))
        except MemoryError:  # the address-space limit: an answer too big to build is not a match
            match, gave_up = False, True
        print(json.dumps({"match": match, "gave_up": gave_up or counter.count > before}), flush=True)


if __name__ == "__main__":
    main()
