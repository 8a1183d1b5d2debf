"""Agents written against the OpenAI API with the standard library only (urllib), by import path
("tests.env.agents:sum_agent") for the agent endpoint's tests (tests/env/test_agent.py)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request


def post(base_url: str, body: dict) -> dict:
    """POST a chat completion request; the parsed JSON answer (an error answer raises its message)."""
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer none"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{e.code}: {json.loads(e.read())['error']['message']}") from None


def sum_agent(base_url: str, row: dict) -> float:
    """Asks the row's sum, then appends the reply and '?' and asks again (a chat loop that appends): 1 for the
    answer as the final reply's last number, 0.25 for a final reply with a digit, else 0."""
    messages = [{"role": "user", "content": row["model_input"]}]
    first = post(base_url, {"model": "policy", "messages": messages, "max_tokens": 3})
    messages += [first["choices"][0]["message"], {"role": "user", "content": "?"}]
    final = post(base_url, {"model": "policy", "messages": messages, "max_tokens": 3})
    numbers = re.findall(r"\d+", final["choices"][0]["message"]["content"])
    return 1.0 if numbers and numbers[-1] == str(row["answer"]) else 0.25 if numbers else 0.0


def summarising_agent(base_url: str, row: dict) -> float:
    """Asks the row's question; starts over from a summary of that exchange (history rewritten: a second training
    sequence), then goes on with that conversation (appended: the second sequence continues). Reward: the final
    reply's length / 10, so episodes differ."""
    ask = lambda messages: post(base_url, {"model": "policy", "messages": messages, "max_tokens": 3})  # noqa: E731
    first = ask([{"role": "user", "content": row["model_input"]}])["choices"][0]["message"]
    summary = [{"role": "user", "content": f"Earlier you said {first['content']}. {row['model_input']}"}]
    second = ask(summary)["choices"][0]["message"]
    final = ask([*summary, second, {"role": "user", "content": "!"}])["choices"][0]["message"]
    return len(final["content"]) / 10


def raising_agent(base_url: str, row: dict) -> float:
    post(base_url, {"model": "policy", "messages": [{"role": "user", "content": row["model_input"]}]})
    raise ValueError("the agent's own bug")
