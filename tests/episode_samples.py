"""samples.jsonl rows of multi-turn episodes that call tools, written by forge itself: the episode loop
(`forge.env.episode.run_episodes`) plays the tiny-multiturn preset's `SumEnv` with a scripted policy, and
`forge.rundir.append_samples` writes the rows as a training step does. Its `reset` gives a first observation
(`OBSERVATION`), which the transcript records as its first segment (role "environment"). The tiny random model of a real run never
emits a tool call, so the dashboard and tracking tests that need one get it here."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPT, ANSWER = "4+5=", "9"
# the policy's turns: a wrong guess through the `check` tool, a call of a tool that does not exist, the answer
TURNS = [
    'Let me check. <tool_call>{"name": "check", "arguments": {"guess": 8}}</tool_call>',
    '<tool_call>{"name": "peek", "arguments": {}}</tool_call>',
    ANSWER,
]
UNKNOWN_TOOL = "Error: unknown tool 'peek'; available: check"  # forge.env.tools.call_tool's answer to `peek`
OBSERVATION = "Tip: check a guess before you answer."  # what `reset` returns: the episode's first observation


def observed_sum_env():
    """`SumEnv` whose `reset` returns `OBSERVATION` (TRL appends it to the prompt; so does forge)."""
    from forge.tasks.multiturn import SumEnv

    class ObservedSumEnv(SumEnv):
        def reset(self, **kwargs) -> str:
            super().reset(**kwargs)
            return OBSERVATION

    return ObservedSumEnv()


def write_tool_episodes(run_dir: Path, step: int, version: int = 2, trainer_version: int | None = None) -> list[dict]:
    """Append two identical scripted episodes as step `step`'s samples (reward 1 each), their tokens' text decoded
    by the char tokenizer; `trainer_version`: the trainer's version at the step (staleness recorded; None: not).
    Returns the rows written (without their tokens, as the tracker gets them)."""
    from forge.rundir import append_samples

    rows, ro, batch, tok = tool_episodes(version)
    return append_samples(run_dir, step, rows, ro, batch, trainer_version=trainer_version, token_text=token_text(tok))


def tool_episodes(version: int = 2):
    """The two scripted episodes, played: (rows, their `Rollouts`, a `ScoredBatch` of reward 1 each, the tokenizer)."""
    from forge.config import EnvConfig
    from forge.env.chat import ChatFormat
    from forge.env.episode import run_episodes
    from forge.models import build_char_tokenizer
    from forge.records import ScoredBatch
    from forge.rollout.base import SamplingParams

    tok = build_char_tokenizer()
    rows = [{"prompt": PROMPT, "model_input": PROMPT, "answer": ANSWER}]
    params = SamplingParams(max_new_tokens=128, n=2, seed=0)
    cfg = EnvConfig(max_turns=4, max_tokens=1000)
    fmt = ChatFormat(tok, use_template=False)
    ro = run_episodes(_scripted(tok), tok, rows, params, cfg, fmt, observed_sum_env, [], version=version)
    batch = ScoredBatch(["sum_reward"], torch.ones(2, 1), torch.ones(2), torch.zeros(2), verifier_failures={})
    return rows, ro, batch, tok


def token_text(tok):
    """Each token decoded alone, as the run's record decodes them (forge.recipes.wiring.RunRecord.token_text)."""
    return lambda ids: tok.batch_decode([[t] for t in ids], skip_special_tokens=False)


def _scripted(tok):
    """A sampler answering each episode with TURNS[k] (+ eos) at its k-th turn, k = tool answers in its context."""

    def sample(contexts: list[list[int]], params, seeds=None) -> list[tuple[list[int], list[float]]]:
        out = []
        for ctx in contexts:
            k = tok.decode(ctx).count("<tool_response>")
            ids = tok(TURNS[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return sample
