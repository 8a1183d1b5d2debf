"""The multi-turn rollout loop (forge.env.episode) with a scripted policy: layout of the episode's tokens, the loss
mask, tool errors as answers, the limits, the chat template's token diff, and one-line errors for bad classes."""

from __future__ import annotations

import time

import pytest
import torch

from forge.config import EnvConfig
from forge.env.chat import TOOL_RESPONSE, ChatFormat
from forge.env.episode import run_episodes
from forge.env.tools import check_environment, tool_of
from forge.errors import UserError
from forge.rollout.base import SamplingParams

CALL = '<tool_call>{"name": "add", "arguments": {"n": 3}}</tool_call>'


class CounterEnv:
    """A TRL-style environment: reset(**row), one public method = one tool, the reward as an attribute."""

    def __init__(self):
        self.total = 0
        self.reward = 0.0

    def reset(self, **kwargs):
        self.total, self.target = 0, int(kwargs["answer"])
        return None

    def add(self, n: int) -> str:
        """Add n to the running total.

        Args:
            n: the number to add
        """
        self.total += n
        self.reward = float(self.total == self.target)
        return str(self.total)

    def boom(self) -> str:
        """Always fails."""
        raise ValueError("no")

    def slow(self) -> str:
        """Takes too long."""
        time.sleep(2)
        return "late"


def scripted(tok, turns: list[str]):
    """A sampler that emits turns[k] (+ eos) at every episode's k-th turn, log-prob -0.5 per token (every turn but
    the last calls a tool)."""

    def sample(contexts, params, seeds=None):
        out = []
        for ctx in contexts:
            k = tok.decode(ctx).count("</tool_call></s>")  # sampled calls so far = turns taken
            ids = tok(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return sample


def play(tok, turns, cfg=None, fmt=None, n=2):
    rows = [{"prompt": "3?", "model_input": "3?", "answer": "3"}]
    params = SamplingParams(max_new_tokens=64, n=n, seed=0)
    return run_episodes(scripted(tok, turns), tok, rows, params, cfg or EnvConfig(max_turns=3, max_tokens=400),
                        fmt or ChatFormat(tok, use_template=False), CounterEnv, [], version=5)  # fmt: skip


def test_an_episode_is_one_sequence_with_the_tool_answer_masked(tok):
    ro = play(tok, [CALL, "3"])
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer = tok(TOOL_RESPONSE.format("3"), add_special_tokens=False)["input_ids"]
    final = tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    T = len(call) + len(answer) + len(final)
    assert ro.completion_ids[0, :T].tolist() == call + answer + final
    expected = [1] * len(call) + [0] * len(answer) + [1] * len(final)
    assert ro.loss_mask[0].tolist() == expected and ro.completion_mask[0].tolist() == [1] * T
    assert torch.equal(ro.sampling_logprobs[0] != 0, ro.loss_mask[0].bool())  # log-probs only where sampled
    e = ro.episodes
    assert (e.turns, e.tool_calls, e.tool_errors, e.truncated) == ([2, 2], [1, 1], [0, 0], [False, False])
    assert [env.reward for env in e.environments] == [1.0, 1.0]  # each episode its own instance
    assert [s["role"] for s in e.transcripts[0]] == ["assistant", "tool", "assistant"]
    assert e.policy_versions[0] == [5, 5] and ro.finish_reasons == ["stop", "stop"]


@pytest.mark.parametrize(
    "call,error",
    [
        ('<tool_call>{"name": add}</tool_call>', "malformed"),
        ('<tool_call>{"name": "mul"}</tool_call>', "unknown"),
        ('<tool_call>{"name": "boom"}</tool_call>', "raised ValueError"),
        ('<tool_call>{"name": "add", "arguments": {"m": 1}}</tool_call>', "raised TypeError"),
        ('<tool_call>{"name": "slow"}</tool_call>', "timed out"),
    ],  # fmt: skip
)
def test_a_bad_call_is_answered_with_an_error_and_counted(tok, call, error):
    cfg = EnvConfig(max_turns=3, max_tokens=400, tool_timeout_s=0.2)
    ro = play(tok, [call, "3"], cfg, n=1)
    tool = ro.episodes.transcripts[0][1]
    assert tool["error"] and error in tool["content"]
    assert ro.episodes.tool_errors == [1] and ro.episodes.turns == [2]  # the episode went on


def test_the_turn_limit_truncates_and_masks(tok):
    ro = play(tok, [CALL], EnvConfig(max_turns=2, max_tokens=400))
    assert ro.episodes.truncated == [True, True] and ro.episodes.turns == [2, 2]
    assert int(ro.loss_mask.sum()) == 0 and ro.finish_reasons == ["length", "length"]
    kept = play(tok, [CALL], EnvConfig(max_turns=2, max_tokens=400, mask_truncated=False))
    assert int(kept.loss_mask.sum()) > 0 and kept.episodes.truncated == [True, True]


def test_the_episode_wall_limit_truncates(tok):
    slow = '<tool_call>{"name": "slow"}</tool_call>'  # 2 s, past the episode's 1 s (the call's 10 s are fine)
    ro = play(tok, [slow, slow, "3"], EnvConfig(max_turns=3, max_tokens=400, episode_timeout_s=1.0), n=1)
    assert ro.episodes.truncated == [True] and ro.episodes.turns == [2] and int(ro.loss_mask.sum()) == 0


def test_the_token_budget_truncates(tok):
    ro = play(tok, [CALL, "3"], EnvConfig(max_turns=4, max_tokens=30))
    assert ro.episodes.truncated == [True, True] and ro.completion_mask.sum(1).max() <= 30


TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_tool_turn_is_the_templates_token_diff(tok):
    tok.chat_template = TEMPLATE
    try:
        ro = play(tok, [CALL, "3"], fmt=ChatFormat(tok, use_template=True), n=1)
    finally:
        tok.chat_template = None
    assert ro.prompts[0] == "<tools>add;boom;slow;</tools><user>3?</s>\n<assistant>"  # tools via the template
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    env = tok("\n<tool>3</s>\n<assistant>", add_special_tokens=False)["input_ids"]  # the close, then the diff
    assert ro.completion_ids[0, : len(call) + len(env)].tolist() == call + env
    assert ro.loss_mask[0, len(call) : len(call) + len(env)].sum() == 0


def test_a_template_that_rewrites_earlier_turns_is_a_clear_error(tok):
    tok.chat_template = "{% for m in messages[-2:] %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    try:
        with pytest.raises(UserError, match="not prefix-preserving"):
            play(tok, [CALL, "3"], fmt=ChatFormat(tok, use_template=True), n=1)
    finally:
        tok.chat_template = None


def test_bad_environment_classes_and_tools_get_one_line(tok):
    class NoReset:
        pass

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(UserError, match="NoReset has no reset method"):
        check_environment(NoReset)
    with pytest.raises(UserError, match="tool .*undocumented.*docstring"):
        tool_of(undocumented)

    class IntObservation(CounterEnv):
        def reset(self, **kwargs):
            return 3

    class NeedsColumn(CounterEnv):
        def reset(self, **kwargs):
            return kwargs["missing"]

    with pytest.raises(UserError, match=r"NeedsColumn.reset\(\*\*row\) raised KeyError: 'missing'"):
        run_episodes(scripted(tok, ["3"]), tok, [{"prompt": "q", "model_input": "q"}], SamplingParams(n=1),
                     EnvConfig(), ChatFormat(tok, False), NeedsColumn, [], 0)  # fmt: skip
    with pytest.raises(UserError, match=r"IntObservation.reset returned a int"):
        run_episodes(scripted(tok, ["3"]), tok, [{"prompt": "q", "model_input": "q"}], SamplingParams(n=1),
                     EnvConfig(), ChatFormat(tok, False), IntObservation, [], 0)  # fmt: skip


def test_smollm2s_template_gets_the_tools_in_a_system_message_and_a_newline_before_the_tool_turn():
    """SmolLM2's template ignores tools= and closes a turn with `<|im_end|>` + newline; the model samples the first."""
    from forge.config import ModelConfig
    from forge.models import load_tokenizer

    smol = load_tokenizer(ModelConfig(path="smollm2-135m-instruct"))
    fmt = ChatFormat(smol, use_template=True)
    schema = tool_of(CounterEnv().add, "CounterEnv").schema
    prompt, messages = fmt.prompt({"prompt": "2+1?", "model_input": ""}, [schema], None)
    assert prompt.startswith("<|im_start|>system\nYou can call these tools:\n<tools>\n") and '"name": "add"' in prompt
    assert prompt.endswith("<|im_start|>user\n2+1?<|im_end|>\n<|im_start|>assistant\n")
    ids = fmt.tool_turn(messages, CALL, [("add", "3")], ended=True)
    assert smol.decode(ids) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def test_stateless_tools_without_an_environment(tok):
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    rows = [{"prompt": "6*7?", "model_input": "6*7?", "answer": "42"}]
    cfg, tools = EnvConfig(max_turns=3, max_tokens=400), [tool_of(multiply)]
    params = SamplingParams(max_new_tokens=64, n=2)
    ro = run_episodes(scripted(tok, [call, "42"]), tok, rows, params, cfg, ChatFormat(tok, False), None, tools, 0)
    assert ro.prompts[0] == "<tools>multiply(a: integer, b: integer)</tools>6*7?"
    assert ro.episodes.transcripts[0][1]["content"] == "42" and ro.episodes.environments == [None, None]
    assert ro.texts[0].endswith("<tool_response>42</tool_response>42")


class FeedbackEnv:
    """No tools: `on_reply` answers each reply until one is the answer (forge.env.episode.REPLY_HOOK)."""

    def __init__(self):
        self.reward, self.replies = 0.0, []

    def reset(self, **kwargs):
        self.target = str(kwargs["answer"])
        return None

    def on_reply(self, reply: str) -> str | None:
        self.replies.append(reply)
        if reply.strip() == self.target:
            self.reward = 1.0
            return None
        return "no"


def replies(tok, turns: list[str], eos: bool = True):
    """A sampler that emits turns[k] (+ eos, unless `eos` is False: a turn cut by rollout.max_new_tokens) at each
    episode's k-th turn (k = FeedbackEnv's answers so far)."""

    def sample(contexts, params, seeds=None):
        out = []
        for ctx in contexts:
            k = tok.decode(ctx).count("no")
            ids = tok(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * eos
            out.append((ids, [-0.5] * len(ids)))
        return out

    return sample


def play_feedback(tok, turns, env=FeedbackEnv, max_turns=3, fmt=None, eos=True, cut_reply="end"):
    rows = [{"prompt": "3?", "model_input": "3?", "answer": "3"}]
    cfg = EnvConfig(max_turns=max_turns, max_tokens=400, cut_reply=cut_reply)
    return run_episodes(replies(tok, turns, eos), tok, rows, SamplingParams(max_new_tokens=64, n=1, seed=0), cfg,
                        fmt or ChatFormat(tok, use_template=False), env, [], version=1)  # fmt: skip


def test_an_environment_answers_a_plain_reply_with_feedback_until_it_is_right(tok):
    from forge.env.tools import environment_tools

    assert environment_tools(FeedbackEnv()) == []  # on_reply is not a tool
    ro = play_feedback(tok, ["1", "2", "3"])
    one, two, three = (tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in ("1", "2", "3"))
    no = tok("no", add_special_tokens=False)["input_ids"]
    assert ro.completion_ids[0].tolist() == one + no + two + no + three
    assert ro.loss_mask[0].tolist() == [1] * len(one) + [0] * len(no) + [1] * len(two) + [0] * len(no) + [1] * 2
    assert torch.equal(ro.sampling_logprobs[0] != 0, ro.loss_mask[0].bool())
    e = ro.episodes
    assert (e.turns, e.tool_calls, e.truncated, ro.finish_reasons) == ([3], [0], [False], ["stop"])
    assert [s["role"] for s in e.transcripts[0]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert e.environments[0].reward == 1.0 and e.environments[0].replies == ["1", "2", "3"]


def test_out_of_turns_the_last_reply_stands_and_is_trained(tok):
    ro = play_feedback(tok, ["1", "2", "3"], max_turns=2)
    e = ro.episodes
    assert (e.turns, e.truncated, ro.finish_reasons) == ([2], [False], ["stop"])  # not cut: the reply was final
    assert e.environments[0].replies == ["1", "2"] and e.environments[0].reward == 0.0
    assert [s["role"] for s in e.transcripts[0]] == ["assistant", "user", "assistant"]
    assert int(ro.loss_mask.sum()) == 4  # both replies and their eos


def test_feedback_is_the_templates_user_turn_diff(tok):
    tok.chat_template = TEMPLATE
    try:
        ro = play_feedback(tok, ["1", "3"], fmt=ChatFormat(tok, use_template=True))
    finally:
        tok.chat_template = None
    one = tok("1", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    user = tok("\n<user>no</s>\n<assistant>", add_special_tokens=False)["input_ids"]
    assert ro.completion_ids[0, : len(one) + len(user)].tolist() == one + user
    assert ro.loss_mask[0, len(one) : len(one) + len(user)].sum() == 0


def test_a_bad_on_reply_gets_one_line(tok):
    class Raises(FeedbackEnv):
        def on_reply(self, reply):
            raise KeyError("x")

    class Number(FeedbackEnv):
        def on_reply(self, reply):
            return 3

    with pytest.raises(UserError, match=r"Raises.on_reply\(reply\) raised KeyError"):
        play_feedback(tok, ["1"], env=Raises)
    with pytest.raises(UserError, match="Number.on_reply returned a int: return a str"):
        play_feedback(tok, ["1"], env=Number)


def test_the_first_observation_is_the_transcripts_first_segment(tok):
    """Issue 44: what `reset` returns follows the prompt in the model's input (TRL appends it to the last user
    message) and is recorded as the transcript's first segment, role "environment"; its tokens are the prompt's,
    never trained. An environment whose reset returns None adds no segment."""

    class Observed(CounterEnv):
        def reset(self, **kwargs):
            super().reset(**kwargs)
            return " Add to reach it."

    rows = [{"prompt": "3?", "model_input": "3?", "answer": "3"}]
    ro = run_episodes(scripted(tok, [CALL, "3"]), tok, rows, SamplingParams(max_new_tokens=64, n=1, seed=0),
                      EnvConfig(max_turns=3, max_tokens=400), ChatFormat(tok, use_template=False), Observed, [],
                      version=5)  # fmt: skip
    assert ro.prompts[0].endswith("3? Add to reach it.")
    segments = ro.episodes.transcripts[0]
    assert segments[0] == {"role": "environment", "content": " Add to reach it."}
    assert [s["role"] for s in segments] == ["environment", "assistant", "tool", "assistant"]
    assert [s["role"] for s in play(tok, [CALL, "3"]).episodes.transcripts[0]] == ["assistant", "tool", "assistant"]


def test_a_cut_reply_ends_the_episode_by_default_and_is_counted(tok):
    """Issue 44: a turn cut by rollout.max_new_tokens (no eos) ends the episode (finish reason length, trained, not
    truncated), as TRL does (a cut turn has no complete tool call); `on_reply` never sees it, and it is counted:
    cut_turns 1 of 1 turn, env/cut_frac 1.0 (a turn that ended with eos: 0)."""
    from forge.metrics import episode_metrics

    ro = play_feedback(tok, ["1", "2", "3"], eos=False)
    e = ro.episodes
    assert (e.turns, e.cut_turns, e.truncated, ro.finish_reasons) == ([1], [1], [False], ["length"])
    assert e.environments[0].replies == [] and int(ro.loss_mask.sum()) == 1  # "1" trained
    assert episode_metrics(ro)["env/cut_frac"] == 1.0
    done = play_feedback(tok, ["1", "2", "3"])
    assert done.episodes.cut_turns == [0] and episode_metrics(done)["env/cut_frac"] == 0.0


def test_with_cut_reply_continue_a_cut_reply_goes_to_on_reply(tok):
    """env.cut_reply=continue: each cut reply (1, 2, 3 without eos) is read as a reply: on_reply answers "no" to 1
    and 2 and ends the episode at 3 (reward 1). Three turns, all cut (env/cut_frac 1.0); the last was cut, so the
    finish reason is length; the replies are trained and the feedback is not."""
    ro = play_feedback(tok, ["1", "2", "3"], eos=False, cut_reply="continue")
    e = ro.episodes
    assert (e.turns, e.cut_turns, e.truncated, ro.finish_reasons) == ([3], [3], [False], ["length"])
    assert e.environments[0].replies == ["1", "2", "3"] and e.environments[0].reward == 1.0
    one, no = (tok(t, add_special_tokens=False)["input_ids"] for t in ("1", "no"))
    assert ro.loss_mask[0, : len(one) + len(no)].tolist() == [1] * len(one) + [0] * len(no)
    assert [s["role"] for s in e.transcripts[0]] == ["assistant", "user", "assistant", "user", "assistant"]


def test_a_cut_reply_passed_on_gets_the_templates_close_before_the_feedback(tok):
    """With a chat template the cut turn's close (the eos the model did not sample) comes from the template's diff,
    before the user turn; with eos sampled it is not repeated."""
    tok.chat_template = TEMPLATE
    try:
        ro = play_feedback(tok, ["1", "3"], eos=False, cut_reply="continue", fmt=ChatFormat(tok, use_template=True))
    finally:
        tok.chat_template = None
    one = tok("1", add_special_tokens=False)["input_ids"]
    user = tok("</s>\n<user>no</s>\n<assistant>", add_special_tokens=False)["input_ids"]
    assert ro.completion_ids[0, : len(one) + len(user)].tolist() == one + user
    assert ro.loss_mask[0, len(one) : len(one) + len(user)].sum() == 0
