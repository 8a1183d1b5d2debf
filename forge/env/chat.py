"""The tokens of an episode's prompt and of its tool turns, from the tokenizer's chat template.

- Tool schemas go through the template's `tools=` argument where the template renders them (the rendered prompt
  changes with them); otherwise into a system message in the documented format `TOOLS_SYSTEM` (docs/environments.md).
- A tool turn is appended as the template's token diff: the conversation rendered up to the assistant turn and
  rendered with the tool messages after it (plus the generation prompt); the second must start with the first
  (a prefix-preserving template) and its remaining tokens are the turn. The tokens the template closes the assistant
  turn with after the sampled ones (e.g. a newline after `<|im_end|>`, which the model does not sample) come first.
  The sampled tokens themselves are never re-tokenised: only the template's own text is.
- A tokenizer without a chat template (the tiny test model): the prompt is one compact line of the tools'
  signatures (`TOOLS_LINE`) and the row's model input, and a tool turn is the text `TOOL_RESPONSE` tokenised.
"""

from __future__ import annotations

import json

from forge.errors import UserError

TOOLS_SYSTEM = (
    "You can call these tools:\n<tools>\n{tools}\n</tools>\nTo call one, reply with "
    '<tool_call>{{"name": <tool name>, "arguments": <JSON object>}}</tool_call>; its answer comes back in '
    "<tool_response></tool_response>."
)
TOOL_RESPONSE = "<tool_response>{}</tool_response>"
TOOLS_LINE = "<tools>{}</tools>"  # no chat template: `name(arg: type, ...)` per tool, `; ` between them


class ChatFormat:
    """Renders one episode's prompt and tool turns for `tokenizer` (`use_template`: model.chat_template resolved)."""

    def __init__(self, tokenizer, use_template: bool, system_prompt: str = ""):
        self.tok = tokenizer
        self.template = use_template and bool(getattr(tokenizer, "chat_template", None))
        self.system = system_prompt
        self.schemas: list[dict] = []  # what the template's tools= renders (empty: in the system message, or none)

    def prompt(self, row: dict, schemas: list[dict], observation: str | None) -> tuple[str, list[dict]]:
        """(the prompt text, the conversation so far) for a data row, its tools' schemas and reset's observation."""
        if not self.template:
            text = row["model_input"] + (observation or "")
            return (_tools_line(schemas) + text if schemas else text), []
        raw = row["prompt"]
        messages = list(raw) if isinstance(raw, list) else [{"role": "user", "content": raw}]
        if self.system and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system})
        if observation:
            messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{observation}"}
        if schemas and not self._renders_tools(messages, schemas):
            messages = _with_system_tools(messages, schemas)
            schemas = []
        self.schemas = schemas
        return self._render(messages, generation=True), messages

    def tool_turn(self, messages: list[dict], assistant: str, answers: list[tuple[str, str]], ended: bool) -> list[int]:
        """Token ids appended after a sampled turn (`assistant`: its text; `ended`: it ended with eos) that called
        tools answered by `answers` [(tool name, answer text)]; `messages` gets both turns."""
        if not self.template:
            return self.tok("".join(TOOL_RESPONSE.format(a) for _, a in answers), add_special_tokens=False)["input_ids"]
        tools = [{"role": "tool", "name": name, "content": answer} for name, answer in answers]
        return self._diff(messages, assistant, tools, ended)

    def user_turn(self, messages: list[dict], assistant: str, feedback: str, ended: bool = True) -> list[int]:
        """Token ids appended after a sampled turn (`assistant`: its text; `ended`: it ended with eos, False for a turn
        cut by rollout.max_new_tokens, whose close the template supplies) that the environment answers with `feedback`
        as a user message; `messages` gets both turns. Without a template: the text tokenised."""
        if not self.template:
            return self.tok(feedback, add_special_tokens=False)["input_ids"]
        return self._diff(messages, assistant, [{"role": "user", "content": feedback}], ended)

    def _diff(self, messages: list[dict], assistant: str, answers: list[dict], ended: bool) -> list[int]:
        """The template's tokens after the sampled `assistant` turn up to the next generation prompt, `answers` (the
        environment's messages) between them; a template that rewrites earlier turns is a UserError."""
        messages.append({"role": "assistant", "content": assistant})
        before = self._render(messages, generation=False)
        messages.extend(answers)
        after = self._render(messages, generation=True)
        if not after.startswith(before):
            raise UserError(
                f"the chat template of {type(self.tok).__name__} is not prefix-preserving at a tool or user turn (it "
                "rewrites earlier turns): use a model whose template keeps them, or a training template "
                "(docs/environments.md)"
            )
        at = before.rfind(assistant)
        if at < 0:
            raise UserError(f"the chat template of {type(self.tok).__name__} changes an assistant turn's text when it "
                            "renders it: multi-turn episodes need a template that keeps it")  # fmt: skip
        close = before[at + len(assistant) :]
        eos = self.tok.eos_token or ""
        if ended and eos and close.startswith(eos):
            close = close[len(eos) :]  # the model sampled it
        return self.tok(close + after[len(before) :], add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[dict], generation: bool) -> str:
        tools = self.schemas or None
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)

    def _renders_tools(self, messages: list[dict], schemas: list[dict]) -> bool:
        plain = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = self.tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        return plain != with_tools


def _tools_line(schemas: list[dict]) -> str:
    """The tools' signatures in one line (no chat template: a small model's prompt stays short).

    >>> _tools_line([{"function": {"name": "check", "parameters": {"properties": {"guess": {"type": "integer"}}}}}])
    '<tools>check(guess: integer)</tools>'
    """
    sigs = []
    for s in schemas:
        props = s["function"].get("parameters", {}).get("properties", {})
        args = ", ".join(f"{name}: {spec.get('type', 'any')}" for name, spec in props.items())
        sigs.append(f"{s['function']['name']}({args})")
    return TOOLS_LINE.format("; ".join(sigs))


def _tools_text(schemas: list[dict]) -> str:
    return TOOLS_SYSTEM.format(tools="\n".join(json.dumps(s) for s in schemas))


def _with_system_tools(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """The tools' text in the system message (added first when there is none)."""
    text = _tools_text(schemas)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
