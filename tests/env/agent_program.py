"""An agent that is a program (`env.agent.command`, tests/env/test_agent.py): reads its row as JSON on stdin, talks to
OPENAI_BASE_URL with the standard library (tests.env.agents.sum_agent's two requests), prints its reward last.
The row's `kind` makes it misbehave: exit 3, hang, print a word, print `none` (the verifiers score), or report
whether it was given the run's secrets."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, for tests.env.agents

from tests.env.agents import sum_agent  # noqa: E402


def main() -> int:
    row = json.loads(sys.stdin.read())
    kind = row.get("kind", "ok")
    if kind == "exit":
        print("cannot go on", file=sys.stderr)
        return 3
    if kind == "hang":
        time.sleep(60)
    reward = sum_agent(os.environ["OPENAI_BASE_URL"], row)
    print("talking to", os.environ["OPENAI_BASE_URL"])
    if kind == "word":
        print("great")
    elif kind == "secrets":  # 1 when it sees the run's plain variable and not its secret
        print(float("FORGEWEAVE_TEST_PLAIN" in os.environ and "FORGEWEAVE_TEST_PASSWORD" not in os.environ))
    elif kind == "none":  # left to the verifiers
        print("none")
    else:
        print(reward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
