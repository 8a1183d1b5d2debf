"""The OpenAI-compatible HTTP endpoint of agent episodes (`forge.env.agent`): `POST .../v1/chat/completions` and
`GET .../v1/models` under one base URL per episode, `http://127.0.0.1:PORT/episodes/<id>/v1`, served by the stdlib's
`http.server.ThreadingHTTPServer` (one thread per request: a request waits there for its batch).

Why the stdlib and why in forge: the rollout worker serves the endpoint of the episodes it plays (in this process, or
in its Ray actor), and forge imports only torch, transformers, accelerate, safetensors, numpy, peft and the stdlib; a
JSON POST needs nothing more than `http.server`.

Trust: it binds 127.0.0.1 only. An episode's id is 128 random bits (`secrets.token_urlsafe(16)`) and is the
capability to use it: nothing is served outside an episode's base URL, an ended episode's URL answers 404, a body is
at most `MAX_BODY` bytes. The API key a client sends is not checked (the URL is the secret).

What this module does: routing, JSON in and out, and the checks of a request (`parse_chat_request`), whose failures
are OpenAI-shaped errors `{"error": {"message", "type", "param", "code"}}` with a 4xx status. Supported: `messages`
(roles system, developer, user, assistant with `tool_calls`, tool; text content, or text parts), `tools` (type
function), `tool_choice` auto/none, `n`, `temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `stop`;
`seed`, `user`, `metadata`, `store`, `parallel_tool_calls`, `service_tier` are accepted and ignored (the run's seeds
decide). Refused with a 400: `stream: true` (not supported yet), `logprobs`, `response_format` other than text,
`tool_choice` required or a named function, non-zero penalties, `logit_bias`, image or audio content, any other key.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

MAX_BODY = 8 << 20  # bytes of one request body
MAX_CHOICES = 16  # `n`
ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("seed", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "stream_options")
TAKEN = ("model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
         "max_completion_tokens", "stop", "stream", "logprobs", "top_logprobs", "response_format",
         "frequency_penalty", "presence_penalty", "logit_bias")  # fmt: skip
_ROUTE = re.compile(r"^/episodes/([A-Za-z0-9_-]{8,64})/v1/(models|chat/completions)/?$")


class RequestError(Exception):
    """A request the endpoint cannot answer: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat completion request. Messages are normalised: `{"role", "content": str}`, plus `tool_calls`
    [{"id", "name", "arguments": dict}] on an assistant message that has them, `tool_call_id` / `name` on a tool's."""

    model: str
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)  # OpenAI's {"type": "function", "function": {...}} as sent
    parse_tools: bool = True  # tool_choice "none": the reply is text, never read for calls
    n: int = 1
    temperature: float | None = None  # None: the server's default
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)


class ChatBackend(Protocol):
    def models(self, episode: str) -> list[str]:
        """The model ids an episode may ask for (RequestError 404 for an unknown or ended episode)."""
        ...

    def chat(self, episode: str, request: ChatRequest) -> dict:
        """The chat.completion object answering `request` (RequestError for what cannot be answered)."""
        ...

    # optional: `refused(episode, error)`, told of every request under an episode's URL answered with an error


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # listen backlog: every episode of a step may connect at once (the default 5 resets)
    daemon_threads = True


class OpenAIServer:
    """`backend`'s endpoint on 127.0.0.1:`port` (0: a free one), served from a daemon thread until `close`."""

    def __init__(self, backend: ChatBackend, port: int = 0):
        self.backend = backend
        self.httpd = _Server(("127.0.0.1", port), _handler(backend))
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="forge-openai", daemon=True)
        self._thread.start()

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()


def new_episode_id() -> str:
    return secrets.token_urlsafe(16)


def _handler(backend: ChatBackend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._answer(lambda episode, kind: _models(backend, episode, kind))

        def do_POST(self):  # noqa: N802
            self._answer(lambda episode, kind: _completion(backend, episode, kind, self._body()))

        def _answer(self, route) -> None:
            match = _ROUTE.match(self.path.split("?", 1)[0])
            try:
                if match is None:
                    raise RequestError(404, f"no such endpoint {self.path!r}: use an episode's base URL", None,
                                       "not_found")  # fmt: skip
                status, body = 200, route(*match.groups())
            except RequestError as e:
                status, body = e.status, e.body()
                if match is not None and hasattr(backend, "refused"):  # counted against its episode (optional)
                    backend.refused(match.group(1), e)
            except Exception as e:  # a bug here must answer the agent, not hang it
                status, body = 500, RequestError(500, f"{type(e).__name__}: {e}").body()
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> object:
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_BODY:
                self.close_connection = True
                raise RequestError(413, f"request body of {size} bytes is over the {MAX_BODY} byte limit")
            raw = self.rfile.read(size)
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                raise RequestError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None

        def log_message(self, format, *args):  # noqa: A002 (http.server's name): quiet, the run has its own log
            pass

    return Handler


def _models(backend: ChatBackend, episode: str, kind: str) -> dict:
    if kind != "models":
        raise RequestError(405, "use POST for /v1/chat/completions")
    ids = backend.models(episode)
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "forgeweave"} for m in ids]}


def _completion(backend: ChatBackend, episode: str, kind: str, body: object) -> dict:
    if kind != "chat/completions":
        raise RequestError(405, "use GET for /v1/models")
    return backend.chat(episode, parse_chat_request(body, backend.models(episode)))


def parse_chat_request(body: object, models: list[str]) -> ChatRequest:
    """The checked request of a JSON body; a RequestError (400, or 404 for a model not served) names what is wrong.

    >>> parse_chat_request({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}, ["policy"]).n
    1
    >>> parse_chat_request({"model": "policy", "messages": [], "stream": True}, ["policy"])
    Traceback (most recent call last):
    forge.env.openai_server.RequestError: streaming is not supported yet: leave stream out or set it to false
    """
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    _refuse_unsupported(body)
    model = body.get("model")
    if model not in models:
        raise RequestError(404, f"model {model!r} is not served here: use one of {models}", "model",
                           "model_not_found")  # fmt: skip
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop must be a string or a list of at most 4 non-empty strings", "stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        parse_tools=body.get("tool_choice") != "none",
        n=_number(body.get("n", 1), "n", int, 1, MAX_CHOICES),
        temperature=None
        if body.get("temperature") is None
        else _number(body["temperature"], "temperature", float, 0, 2),
        top_p=None if body.get("top_p") is None else _number(body["top_p"], "top_p", float, 1e-9, 1),
        max_tokens=None if limit is None else _number(limit, "max_tokens", int, 1, 1 << 20),
        stop=stop,
    )


def _refuse_unsupported(body: dict) -> None:
    unknown = sorted(k for k in body if k not in TAKEN + IGNORED)
    if unknown:
        raise RequestError(400, f"unsupported parameter(s) {unknown}: the endpoint takes {list(TAKEN[:10])}",
                           unknown[0], "unsupported_parameter")  # fmt: skip
    if body.get("stream"):
        raise RequestError(400, "streaming is not supported yet: leave stream out or set it to false", "stream",
                           "unsupported_value")  # fmt: skip
    refused = {
        "logprobs": bool(body.get("logprobs")) or bool(body.get("top_logprobs")),
        "response_format": body.get("response_format") not in (None, {"type": "text"}),
        "tool_choice": body.get("tool_choice") not in (None, "auto", "none"),
        "frequency_penalty": bool(body.get("frequency_penalty")),
        "presence_penalty": bool(body.get("presence_penalty")),
        "logit_bias": bool(body.get("logit_bias")),
    }
    for key, bad in refused.items():
        if bad:
            raise RequestError(400, f"{key}={body.get(key)!r} is not supported by this endpoint", key,
                               "unsupported_value")  # fmt: skip


def _number(value: object, name: str, kind: type, low: float, high: float):
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    if not ok or not low <= value <= high:
        raise RequestError(400, f"{name} must be a{'n integer' if kind is int else ' number'} in [{low:g}, {high:g}], "
                                f"got {value!r}", name)  # fmt: skip
    return kind(value)


def _messages(raw: object) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def _message(m: object, where: str) -> dict:
    """One message normalised (the ChatRequest's form)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(400, f"{where} must be an object with a role in {list(ROLES)}", where)
    out = {"role": m["role"], "content": _text(m.get("content"), where)}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(m["tool_calls"])]
    if m["role"] == "tool":
        out.update({k: str(m[k]) for k in ("tool_call_id", "name") if m.get(k) is not None})
    return out


def _text(content: object, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = content if isinstance(content, list) else [None]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise RequestError(400, f"{where}.content must be a string or text parts (no images or audio)", where)
    return "".join(p["text"] for p in parts)


def _call(c: object, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(400, f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments") or "{}"
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except (json.JSONDecodeError, RecursionError):
        raise RequestError(400, f"{where}.function.arguments is not a JSON object", where) from None
    if not isinstance(args, dict):
        raise RequestError(400, f"{where}.function.arguments is not a JSON object", where)
    return {"id": str(c.get("id") or ""), "name": fn["name"], "arguments": args}


def _tools(raw: object) -> list[dict]:
    if raw is None:
        return []
    ok = isinstance(raw, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in raw
    )  # fmt: skip
    if not ok:
        raise RequestError(400, "tools must be a list of {'type': 'function', 'function': {'name', ...}}", "tools")
    return raw


def chat_response(model: str, choices: list[tuple[dict, str]], prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's chat.completion object for [(message, finish reason)].

    >>> r = chat_response("policy", [({"role": "assistant", "content": "4"}, "stop")], 5, 2)
    >>> r["object"], r["choices"][0]["finish_reason"], r["usage"]["total_tokens"]
    ('chat.completion', 'stop', 7)
    """
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "message": m, "finish_reason": f, "logprobs": None} for i, (m, f) in enumerate(choices)
        ],  # fmt: skip
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },  # fmt: skip
    }
