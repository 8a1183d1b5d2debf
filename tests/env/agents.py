"""Agents written against the OpenAI API with the standard library only (urllib), by import path
("tests.env.agents:sum_agent") for the agent endpoint's tests (tests/env/test_agent.py)."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

HANG_S = 4.0  # how long chaotic_agent's hanging kinds hang (the load test's env.agent.timeout_s is below it)


def post(base_url: str, body: dict | bytes) -> dict:
    """POST a chat completion request (a dict as JSON, bytes as they are); the parsed JSON answer (an error answer
    raises its message)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=data,
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


def chaotic_agent(base_url: str, row: dict) -> float:
    """Behaves as row['kind'] says (tests/env/test_agent_load.py): 'ok' asks once and returns 1; 'raise' asks, then
    raises; 'hang' sleeps HANG_S without a request; 'stall' sends a request whose body never comes and waits
    HANG_S; 'bad_json' and 'wrong_model' first send a request the endpoint refuses (a body that is not JSON, a model
    not served), then a good one; 'unsupported' asks with stream: true (refused: the client raises); 'nan' asks,
    then returns NaN."""
    kind = row["kind"]
    ask = {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 3}
    if kind in ("hang", "stall"):
        _stall(base_url) if kind == "stall" else time.sleep(HANG_S)
        return 1.0
    if kind in ("bad_json", "wrong_model"):
        try:
            post(base_url, b"{not json" if kind == "bad_json" else {**ask, "model": "gpt-4o"})
        except RuntimeError:  # the 4xx it asked for: go on as a careful agent would
            pass
    post(base_url, {**ask, "stream": True} if kind == "unsupported" else ask)
    if kind == "raise":
        raise ValueError("the agent's own bug")
    return math.nan if kind == "nan" else 1.0


def _stall(base_url: str) -> None:
    """Open a connection to the endpoint and send a request's headers and one byte of its 100-byte body, then hold
    the connection HANG_S (a server thread waits on it)."""
    url = urllib.parse.urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=HANG_S + 5) as conn:
        head = f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Length: 100\r\n\r\n{{"
        conn.sendall(head.encode())
        time.sleep(HANG_S)
