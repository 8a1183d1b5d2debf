"""Agent requests as tokens: OpenAI messages rendered by the policy's chat template, the token bridge from one request
to the next, and the assistant message a sampled reply becomes (`forge.env.agent` plays the episodes).

- Rendering: the template gets the messages as Hugging Face templates take them (a `developer` message as `system`,
  an assistant's `tool_calls` with their arguments as objects) and the tools through `tools=` where it renders them,
  else in a system message (`forge.env.chat.TOOLS_SYSTEM`), as `forge.env.chat.ChatFormat` does for environments.
  Without a template (the tiny test model): the tools' one-line signatures, then each message's text in order (a
  tool's as `<tool_response>...</tool_response>`, an assistant's with its calls as `<tool_call>...</tool_call>` and
  eos).
- The bridge (`AgentChat.bridge`): when a request's messages are the last request's messages, then one of the
  assistant messages it was answered with, then new messages (a chat loop that appends), its token ids are the last
  request's prompt ids, the sampled ids of that reply, never re-tokenised, and the template's token diff after the
  reply (what closes the reply turn and the new messages up to the next generation prompt). Anything else (history
  rewritten, tools changed, a template that rewrites earlier turns) is rendered whole and tokenised: the episode
  then begins another training sequence there (`forge.env.agent.episode_sequences`). `AgentHost` tries the bridge
  from every earlier request, latest first.
- A reply (`reply_message`): its text read for tool calls with `forge.env.parse`'s conventions when the request
  offered tools; calls that cannot be read leave the reply as text.
"""

from __future__ import annotations

import json
import secrets

from forge.env.chat import TOOL_RESPONSE, _tools_line, _with_system_tools
from forge.env.parse import _TAGGED, parse_tool_calls


class AgentChat:
    """Renders normalised messages (`forge.env.openai_server.ChatRequest`) for `tokenizer` (`use_template`: the run's
    model.chat_template resolved; without a template on the tokenizer, the plain format)."""

    def __init__(self, tokenizer, use_template: bool):
        self.tok = tokenizer
        self.template = use_template and bool(getattr(tokenizer, "chat_template", None))

    def ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """Token ids of the whole conversation rendered, ending with the generation prompt."""
        return self.tok(self.render(messages, tools, generation=True), add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict], tools: list[dict], generation: bool) -> str:
        if not self.template:
            text = "".join(_plain(m, self.tok.eos_token or "") for m in messages)
            return (_tools_line(tools) + text) if tools else text
        msgs = [_for_template(m) for m in messages]
        if tools and not self._renders_tools(msgs, tools):
            msgs, tools = _with_system_tools(msgs, tools), []
        return self.tok.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=generation)

    def bridge(
        self, head: list[dict], reply: dict, tail: list[dict], tools: list[dict], ended: bool
    ) -> list[int] | None:
        """The token ids after a sampled reply: what closes its turn, then `tail` up to the next generation prompt
        (`head`: the messages before the reply; `ended`: the reply's tokens end with eos). None where the template
        does not keep the earlier text as a prefix (the caller renders the whole conversation)."""
        if not self.template:
            return self.tok("".join(_plain(m, self.tok.eos_token or "") for m in tail),
                            add_special_tokens=False)["input_ids"]  # fmt: skip
        prompt = self.render(head, tools, generation=True)
        before = self.render([*head, reply], tools, generation=False)
        after = self.render([*head, reply, *tail], tools, generation=True)
        if not (before.startswith(prompt) and after.startswith(before)):
            return None
        turn, eos = before[len(prompt) :], self.tok.eos_token or ""
        close = ""
        if eos and eos in turn:  # the template's text after the turn's end token (the model sampled the end token)
            close = turn[turn.rfind(eos) + len(eos) :] if ended else turn[turn.rfind(eos) :]
        return self.tok(close + after[len(before) :], add_special_tokens=False)["input_ids"]

    def _renders_tools(self, messages: list[dict], tools: list[dict]) -> bool:
        plain = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return plain != self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def _for_template(m: dict) -> dict:
    """A normalised message as Hugging Face chat templates take it."""
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c["id"], "function": {"name": c["name"],
                              "arguments": c["arguments"]}} for c in m["tool_calls"]]  # fmt: skip
    out.update({k: m[k] for k in ("tool_call_id", "name") if k in m})
    return out


def _plain(m: dict, eos: str) -> str:
    """A message in the plain format (no chat template).

    >>> _plain({"role": "tool", "content": "7"}, "</s>"), _plain({"role": "assistant", "content": "7"}, "</s>")
    ('<tool_response>7</tool_response>', '7</s>')
    """
    if m["role"] == "tool":
        return TOOL_RESPONSE.format(m["content"])
    if m["role"] != "assistant":
        return m["content"]
    calls = "".join(f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c['arguments']})}</tool_call>"
                    for c in m.get("tool_calls", []))  # fmt: skip
    return m["content"] + calls + eos


def same_message(a: dict, b: dict) -> bool:
    """Whether two normalised messages say the same (ids of tool calls aside)."""
    calls = lambda m: [(c["name"], c["arguments"]) for c in m.get("tool_calls", [])]  # noqa: E731
    return a["role"] == b["role"] and a["content"] == b["content"] and calls(a) == calls(b)


def reply_message(text: str, read_calls: bool, finished: bool) -> tuple[dict, str]:
    """(the OpenAI assistant message, the finish reason) of a sampled reply's text (`finished`: it ended with eos or
    a stop string; else it was cut by max_tokens).

    >>> reply_message('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', True, True)[0]["tool_calls"][0][
    ...     "function"]
    {'name': 'add', 'arguments': '{"a": 1}'}
    >>> reply_message("7", True, False)
    ({'role': 'assistant', 'content': '7'}, 'length')
    """
    calls = parse_tool_calls(text) if read_calls else []
    if not calls or any(c.error for c in calls):
        return {"role": "assistant", "content": text}, "stop" if finished else "length"
    rest = _TAGGED.sub("", text).strip() if "<tool_call>" in text else ""
    return {
        "role": "assistant",
        "content": rest or None,
        "tool_calls": [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls],
    }, "tool_calls"  # fmt: skip


def cut_at_stop(tok, ids: list[int], stops: list[str]) -> tuple[int, str | None]:
    """(how many of `ids` to keep, the reply's text without the stop string) where a stop string appears in the
    decoded text, else (len(ids), None): the tokens up to the one that completes the first stop string."""
    if not stops:
        return len(ids), None
    text = tok.decode(ids, skip_special_tokens=True)
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if at < 0:
        return len(ids), None
    for n in range(1, len(ids) + 1):
        seen = tok.decode(ids[:n], skip_special_tokens=True)
        if any(s in seen for s in stops):
            return n, text[:at]
    return len(ids), text[:at]
