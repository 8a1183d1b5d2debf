"""The multi-turn rollout loop: G episodes per prompt, each one token sequence (prompt, then sampled and tool
segments), sampled turn by turn for all live episodes at once.

Per turn: the policy samples from each live episode's tokens so far (`sample(contexts, params, seeds)`: the rollout
backend's `generate_ids`, hf or vLLM, in this process or in a Ray rollout actor); the text of the new segment is read
for tool calls (`forge.env.parse`); no call ends the episode, otherwise each call is answered
(`forge.env.tools.call_tool`: errors become the answer) and the answers are appended as the chat template's tokens
(`forge.env.chat`) with loss mask 0 and sampling log-prob 0. Limits: `env.max_turns` policy turns, `env.max_tokens`
tokens after the prompt, `env.episode_timeout_s` seconds (checked after each turn); an episode cut by one is
truncated, and with `env.mask_truncated` its loss mask is all 0. A turn cut by `rollout.max_new_tokens` ends the
episode as in single-turn (finish reason "length", trained). Departure from TRL: TRL ends an episode that runs out of
its completion budget without marking it; here it is counted (`env/truncated`) and masked by default.

Seeds (`episode_seeds`): episode e of a call draws its turn t from a seed of its own, `s_e + t * TURN_SEED_STRIDE`,
with `s_e = params.seed + e` (a seeded call) or `b + params.first_row + e` (b one draw from torch's RNG, the rollout
worker's stream). The backends give each episode's turn its own generator (vLLM: the request's seed; hf:
`forge.rollout.hf.seeded_tokens`), so an episode samples the same tokens whichever episodes share its batch, and a
step the Ray adapter splits between replicas (`first_row`, the shifted seed) samples what one call would. Every
turn of a call is sampled by the policy version the worker holds (`Episodes.policy_versions`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from forge.env.chat import ChatFormat
from forge.env.config import EnvConfig
from forge.env.parse import parse_tool_calls
from forge.env.tools import Tool, call_tool, environment_tools
from forge.errors import UserError
from forge.records import Episodes, Rollouts
from forge.rollout.base import SamplingParams, cat_padded

# (token contexts, params with n=1, one seed per context or None) -> [(sampled tokens, their log-probs)]
Sampler = Callable[[list[list[int]], SamplingParams, "list[int] | None"], list[tuple[list[int], list[float]]]]
TURN_SEED_STRIDE = 1 << 24  # seed distance between an episode's turns: more episodes than this in one call collide


@dataclass
class Episode:
    """One episode in progress (mutable while the loop runs)."""

    env: object | None
    tools: dict[str, Tool]
    prompt: str
    prompt_ids: list[int]
    messages: list[dict]
    ids: list[int] = field(default_factory=list)  # after the prompt
    loss: list[int] = field(default_factory=list)  # 1 on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # 0 off the sampled tokens
    transcript: list[dict] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    truncated: bool = False
    finish: str = "stop"
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


def start_episode(row: dict, factory: Callable | None, functions: list[Tool], fmt: ChatFormat, tok) -> Episode:
    """A fresh environment reset with the row's columns, the prompt with the tools' schemas and the observation."""
    env, observation, tools = None, None, list(functions)
    t0 = time.perf_counter()
    if factory is not None:
        env = factory()
        columns = {k: v for k, v in row.items() if k != "model_input"}
        try:
            observation = env.reset(**columns)
        except Exception as e:  # the user's environment: one line naming it, not a traceback from the loop
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            raise UserError(f"{type(env).__name__}.reset(**row) raised {why}; row columns: {sorted(columns)}") from None
        if observation is not None and not isinstance(observation, str):
            raise UserError(f"{type(env).__name__}.reset returned a {type(observation).__name__}: return a str or None")
        tools += environment_tools(env)
    prompt, messages = fmt.prompt(row, [t.schema for t in tools], observation)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ep = Episode(env, {t.name: t for t in tools}, prompt, ids, messages)
    ep.seconds = time.perf_counter() - t0
    return ep


def play_turn(ep: Episode, new: list[int], logprobs: list[float], cfg: EnvConfig, budget: int, fmt: ChatFormat,
              tok, version: int) -> None:  # fmt: skip
    """Append one sampled segment to `ep`, answer its tool calls, and decide whether the episode goes on."""
    if len(ep.ids) + len(new) > budget:  # the token budget cuts the segment
        new, logprobs, ep.truncated = new[: budget - len(ep.ids)], logprobs[: budget - len(ep.ids)], True
    ended = bool(new) and new[-1] == tok.eos_token_id
    ep.ids, ep.loss, ep.logprobs = ep.ids + new, ep.loss + [1] * len(new), ep.logprobs + logprobs
    ep.turns += 1
    text = tok.decode(new, skip_special_tokens=True)
    ep.transcript.append({"role": "assistant", "content": text, "policy_version": version})
    calls = parse_tool_calls(text)
    if ep.truncated or not calls or not ended:
        ep.done, ep.finish = True, "length" if (ep.truncated or not ended) else "stop"
        return
    late = cfg.episode_timeout_s and time.perf_counter() - ep.started > cfg.episode_timeout_s
    if ep.turns >= cfg.max_turns or late:  # it asked for more, a limit says no
        ep.done, ep.truncated, ep.finish = True, True, "length"
        return
    answers = _answer(ep, calls, cfg)
    env_ids = fmt.tool_turn(ep.messages, text, answers, ended)
    if len(ep.ids) + len(env_ids) >= budget:  # no room for the answer and a next turn
        ep.done, ep.truncated, ep.finish = True, True, "length"
        return
    ep.ids, ep.loss, ep.logprobs = ep.ids + env_ids, ep.loss + [0] * len(env_ids), ep.logprobs + [0.0] * len(env_ids)


def _answer(ep: Episode, calls, cfg: EnvConfig) -> list[tuple[str, str]]:
    t0, answers = time.perf_counter(), []
    for call in calls:
        ep.calls += 1
        if call.error:
            answer, failed = call.error, True
        else:
            answer, failed = call_tool(ep.tools, call.name, call.arguments, cfg.tool_timeout_s)
        ep.errors += failed
        answers.append((call.name or "error", answer))
        ep.transcript.append({"role": "tool", "name": call.name, "content": answer, "error": failed})
    ep.seconds += time.perf_counter() - t0
    return answers


def run_episodes(sample: Sampler, tok, rows: list[dict], params: SamplingParams, cfg: EnvConfig, fmt: ChatFormat,
                 factory: Callable | None, functions: list[Tool], version: int) -> Rollouts:  # fmt: skip
    """params.n episodes per row, grouped (row i -> prompt i // n); every environment is a fresh factory()."""
    episodes = [start_episode(r, factory, functions, fmt, tok) for r in rows for _ in range(params.n)]
    budget = cfg.max_tokens or 4 * params.max_new_tokens
    seeds = episode_seeds(params, len(episodes))
    turn = dataclasses.replace(params, n=1)
    while live := [(i, e) for i, e in enumerate(episodes) if not e.done]:
        turn_seeds = None if seeds is None else [seeds[i] + e.turns * TURN_SEED_STRIDE for i, e in live]
        outs = sample([e.prompt_ids + e.ids for _, e in live], turn, turn_seeds)
        for (_, ep), (new, lp) in zip(live, outs, strict=True):
            play_turn(ep, new, lp, cfg, budget, fmt, tok, version)
    return to_rollouts(episodes, tok, params.n, version, cfg.mask_truncated)


def episode_seeds(params: SamplingParams, count: int) -> list[int] | None:
    """The first turn's seed of each of `count` episodes (None when greedy: nothing is drawn): `params.seed + e`, or
    one draw from torch's RNG plus `params.first_row + e` (a seeded call's seed is already shifted by its first row).

    >>> episode_seeds(SamplingParams(seed=5, first_row=8), 3), episode_seeds(SamplingParams(temperature=0), 3)
    ([5, 6, 7], None)
    """
    if params.temperature == 0:
        return None
    assert count < TURN_SEED_STRIDE, f"{count} episodes in one call: their turns' seeds would collide"
    base = params.seed
    if base is None:
        base = int(torch.randint(0, 2**31 - 1, ())) + params.first_row
    return [base + e for e in range(count)]


def to_rollouts(episodes: list[Episode], tok, group_size: int, version: int, mask_truncated: bool) -> Rollouts:
    """The episodes as one record: prompts left-padded [N, P], episodes right-padded [N, T]."""
    pad = tok.pad_token_id
    row = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731  [1, len]
    ids = [row(e.ids or [pad], torch.long) for e in episodes]
    masked = [mask_truncated and e.truncated for e in episodes]
    return Rollouts(
        prompt_ids=cat_padded([row(e.prompt_ids, torch.long) for e in episodes], pad, left=True),
        prompt_mask=cat_padded([row([1] * len(e.prompt_ids), torch.long) for e in episodes], 0, left=True),
        completion_ids=cat_padded(ids, pad, left=False),
        completion_mask=cat_padded([row([1] * len(e.ids), torch.long) for e in episodes], 0, left=False),
        sampling_logprobs=cat_padded([row(e.logprobs, torch.float32) for e in episodes], 0.0, left=False),
        texts=[tok.decode(e.ids, skip_special_tokens=True) for e in episodes],
        finish_reasons=[e.finish for e in episodes],
        group_size=group_size,
        policy_version=version,
        prompts=[e.prompt for e in episodes],
        loss_mask=cat_padded(
            [row([0] * len(e.loss) if m else e.loss, torch.long) for e, m in zip(episodes, masked, strict=True)],
            0,
            left=False,
        ),  # fmt: skip
        episodes=Episodes(
            turns=[e.turns for e in episodes],
            tool_calls=[e.calls for e in episodes],
            tool_errors=[e.errors for e in episodes],
            truncated=[e.truncated for e in episodes],
            seconds=[e.seconds for e in episodes],
            policy_versions=[[version] * e.turns for e in episodes],
            transcripts=[e.transcript for e in episodes],
            masked=masked,
            environments=[e.env for e in episodes],
        ),  # fmt: skip
    )


def load_environment(cfg, tok) -> tuple[Callable | None, list[Tool], ChatFormat]:
    """(the environment factory, the stateless tools, the chat format) of a run config (`RunConfig`), checked once
    at start: a class without reset or a tool without a docstring is a one-line UserError naming it."""
    from forge.env.tools import check_environment, load_object, tool_of

    e = cfg.env
    factory = load_object(e.environment_factory, "env.environment_factory") if e.environment_factory else None
    if factory is not None:
        check_environment(factory)
    functions = [tool_of(load_object(spec, "env.tools")) for spec in e.tools]
    use_template = cfg.model.chat_template if cfg.model.chat_template is not None else True
    return factory, functions, ChatFormat(tok, use_template, cfg.model.system_prompt)


class EpisodeBackend:
    """Evaluation's backend in a multi-turn run: `generate(prompts, params)` plays params.n episodes per prompt
    (each prompt a row's model input, as `forge.evaluate` passes them) on the rollout backend (hf or vLLM)."""

    def __init__(self, backend, tok, rows: list[dict], cfg: EnvConfig, env: tuple):
        self.backend, self.tok, self.cfg, self.env = backend, tok, cfg, env
        self.rows = {r["model_input"]: r for r in rows}
        self.policy_version = backend.policy_version

    def generate(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        factory, functions, fmt = self.env
        rows = [self.rows[p] for p in prompts]
        return run_episodes(self.backend.generate_ids, self.tok, rows, params, self.cfg, fmt, factory, functions,
                            self.policy_version)  # fmt: skip
