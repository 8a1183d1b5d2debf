"""The multi-turn rollout loop: G episodes per prompt, each one token sequence (prompt, then sampled and tool
segments), sampled turn by turn for all live episodes at once.

Per turn: the policy samples from each live episode's tokens so far (`sample(contexts, params, seeds)`: the rollout
backend's `generate_ids`, hf or vLLM, in this process or in a Ray rollout actor); the text of the new segment is read
for tool calls (`forge.env.parse`); no call ends the episode (unless the environment answers the reply: below),
otherwise each call is answered (`forge.env.tools.call_tool`: errors become the answer) and the answers are
appended as the chat template's tokens (`forge.env.chat`) with loss mask 0 and sampling log-prob 0. Limits:
`env.max_turns` policy turns, `env.max_tokens` tokens after the prompt, `env.episode_timeout_s` seconds (checked
after each turn); an episode cut by one is truncated, and with `env.mask_truncated` its loss mask is all 0. A turn
cut by `rollout.max_new_tokens` (no eos sampled) is counted (`Episodes.cut_turns`, the metric `env/cut_frac`) and, by
default (`env.cut_reply=end`), ends the episode as in single-turn (finish reason "length", trained, not truncated);
with `env.cut_reply=continue` it is read as a finished reply: its tool calls are answered, or it goes to `on_reply`
(or an OpenEnv text action), and the episode goes on. Departure from TRL: TRL ends an episode that runs out of its
completion budget without marking it; here it is counted (`env/truncated`) and masked by default.

The transcript (`Episodes.transcripts`, samples.jsonl, MLflow's sample tables, the dashboard) records the episode
after the row's prompt: reset's first observation (a TRL class's `reset` text, an OpenEnv server's reset observation)
as a segment of role "environment" when there is one (its tokens are part of the prompt, loss mask 0), then the
policy's turns ("assistant"), tool answers ("tool") and feedback ("user"); only assistant segments are trained.

Feedback on a reply (an extension of TRL's contract, where a turn without a tool call always ends the episode): an
environment with a method `on_reply(reply: str) -> str | None` is called with the text of such a turn; a str is the
environment's answer, appended as a user turn (the chat template's diff, loss mask 0), and the episode goes on
(e.g. "wrong, try again"); None ends it. `on_reply` is not a tool. Environments without it run exactly as before.
An OpenEnv server with text actions (`env.openenv.text_action`) is played through the same hook: its episode's
`on_reply` sends the reply as a step and returns the observation's text until the server says done.

Seeds (`episode_seeds`): episode e of a call draws its turn t from a seed of its own, `s_e + t * TURN_SEED_STRIDE`,
with `s_e = params.seed + e` (a seeded call) or `b + params.first_row + e` (b one draw from torch's RNG: an unseeded
call). The backends give each episode's turn its own generator (vLLM: the request's seed; hf:
`forge.rollout.hf.seeded_tokens`), so an episode samples the same tokens whichever episodes share its batch, and a
step the Ray adapter splits between replicas (`first_row`, the shifted seed) samples what one call would. Every
turn of a call is sampled by the policy version the worker holds (`Episodes.policy_versions`).

An OpenEnv server (`forge.env.openenv`): each episode's environment is a WebSocket session, opened at reset and
closed when the episode ends. At most the server's session cap (`OpenEnvClient.max_sessions`) of episodes are open at
once: the first ones start before sampling, the next one as soon as an episode ends (its slot is free). The server's
done ends an episode after its tool turn. An episode whose session fails (the server is gone) ends there with
finish reason "error" and `failure` set; its loss mask is all 0 and the reward stage unscores it
(`forge.workers.RewardWorker`). With a TRL environment class or tools only, every episode starts before sampling.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from forge.env.chat import ChatFormat
from forge.env.config import EnvConfig
from forge.env.openenv import OpenEnvClient, OpenEnvEpisode
from forge.env.parse import parse_tool_calls
from forge.env.tools import Tool, ToolsExhausted, call_tool, environment_tools
from forge.errors import UserError
from forge.records import Episodes, Rollouts
from forge.rollout.base import SamplingParams, cat_padded

# (token contexts, params with n=1, one seed per context or None) -> [(sampled tokens, their log-probs)]
Sampler = Callable[[list[list[int]], SamplingParams, "list[int] | None"], list[tuple[list[int], list[float]]]]
OBSERVATION_ROLE = "environment"  # the transcript segment of reset's first observation (part of the prompt)
REPLY_HOOK = "on_reply"  # optional environment method: feedback on a reply without a tool call (or None)
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
    cuts: int = 0  # turns cut by rollout.max_new_tokens (no eos sampled)
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    truncated: bool = False
    finish: str = "stop"
    done: bool = False
    failure: str = ""  # why the environment failed the episode ('' = it did not)
    started: float = field(default_factory=time.perf_counter)

    def fail(self, why: str) -> None:
        self.done, self.failure, self.finish = True, why, "error"


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
        tools += env.tools() if isinstance(env, OpenEnvEpisode) else environment_tools(env)
    prompt, messages = fmt.prompt(row, [t.schema for t in tools], observation)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ep = Episode(env, {t.name: t for t in tools}, prompt, ids, messages)
    if observation:  # in the prompt's tokens (never trained): its own segment, so a reader sees what came first
        ep.transcript.append({"role": OBSERVATION_ROLE, "content": observation})
    if isinstance(env, OpenEnvEpisode) and env.failure:
        ep.fail(env.failure)
    ep.seconds = time.perf_counter() - t0
    return ep


def end_episode(ep: Episode) -> None:
    """Close the episode's OpenEnv session (nothing to do for other environments); idempotent."""
    if isinstance(ep.env, OpenEnvEpisode):
        t0 = time.perf_counter()
        ep.env.close()
        ep.seconds += time.perf_counter() - t0


def play_turn(ep: Episode, new: list[int], logprobs: list[float], cfg: EnvConfig, budget: int, fmt: ChatFormat,
              tok, version: int) -> None:  # fmt: skip
    """Append one sampled segment to `ep`, answer its tool calls, and decide whether the episode goes on."""
    cut = not new or new[-1] != tok.eos_token_id  # rollout.max_new_tokens stopped the turn
    ep.cuts += cut
    if len(ep.ids) + len(new) > budget:  # the token budget cuts the segment
        new, logprobs, ep.truncated = new[: budget - len(ep.ids)], logprobs[: budget - len(ep.ids)], True
    ended = bool(new) and new[-1] == tok.eos_token_id
    ep.ids, ep.loss, ep.logprobs = ep.ids + new, ep.loss + [1] * len(new), ep.logprobs + logprobs
    ep.turns += 1
    text = tok.decode(new, skip_special_tokens=True)
    ep.transcript.append({"role": "assistant", "content": text, "policy_version": version})
    texts_only = isinstance(ep.env, OpenEnvEpisode) and bool(ep.env.client.text_field)  # a reply is the action
    calls = [] if texts_only else parse_tool_calls(text)
    if ep.truncated or (cut and cfg.cut_reply == "end"):
        ep.done, ep.finish = True, "length"
        return
    if not calls:
        _on_reply(ep, text, cfg, budget, fmt, ended)
        return
    late = cfg.episode_timeout_s and time.perf_counter() - ep.started > cfg.episode_timeout_s
    if ep.turns >= cfg.max_turns or late:  # it asked for more, a limit says no
        ep.done, ep.truncated, ep.finish = True, True, "length"
        return
    answers = _answer(ep, calls, cfg)
    if ep.failure:  # no thread left for a tool
        return
    remote = ep.env if isinstance(ep.env, OpenEnvEpisode) else None
    if remote is not None and remote.failure:
        ep.fail(remote.failure)
        return
    env_ids = fmt.tool_turn(ep.messages, text, answers, ended)
    over = remote is not None and remote.done  # the server ended the episode: its answer needs no next turn after it
    if len(ep.ids) + len(env_ids) >= budget + over:  # no room for the answer (and a next turn)
        ep.done, ep.truncated, ep.finish = True, True, "length"
        return
    ep.ids, ep.loss, ep.logprobs = ep.ids + env_ids, ep.loss + [0] * len(env_ids), ep.logprobs + [0.0] * len(env_ids)
    ep.done = over


def _on_reply(ep: Episode, text: str, cfg: EnvConfig, budget: int, fmt: ChatFormat, ended: bool = True) -> None:
    """A turn without a tool call ends the episode, unless its environment has `on_reply(reply)` and that returns a
    text: then the text is appended as a user turn (loss mask 0) and the episode goes on. Out of turns
    (`env.max_turns`) or time (`env.episode_timeout_s`) the reply stands as the final one (not truncated); feedback
    that does not fit the token budget cuts the episode (truncated). `ended`: the reply ended with eos (False: a
    reply cut by rollout.max_new_tokens, passed on under env.cut_reply=continue; an episode it ends has finish
    reason "length")."""
    ep.done, ep.finish = True, "stop" if ended else "length"
    hook = getattr(ep.env, REPLY_HOOK, None)
    if hook is None:
        return
    t0 = time.perf_counter()
    try:
        feedback = hook(text)
    except Exception as e:  # the user's environment: one line naming it
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise UserError(f"{type(ep.env).__name__}.{REPLY_HOOK}(reply) raised {why}") from None
    ep.seconds += time.perf_counter() - t0
    if isinstance(ep.env, OpenEnvEpisode) and ep.env.failure:  # a text action's session failed
        ep.fail(ep.env.failure)
        return
    if feedback is None:
        return
    if not isinstance(feedback, str):
        raise UserError(f"{type(ep.env).__name__}.{REPLY_HOOK} returned a {type(feedback).__name__}: return a str "
                        "(feedback, the episode goes on) or None (it ends)")  # fmt: skip
    late = cfg.episode_timeout_s and time.perf_counter() - ep.started > cfg.episode_timeout_s
    if ep.turns >= cfg.max_turns or late:
        return
    env_ids = fmt.user_turn(ep.messages, text, feedback, ended)
    if len(ep.ids) + len(env_ids) >= budget:  # no room for the feedback and a next turn
        ep.truncated, ep.finish = True, "length"
        return
    ep.transcript.append({"role": "user", "content": feedback})
    ep.ids, ep.loss, ep.logprobs = ep.ids + env_ids, ep.loss + [0] * len(env_ids), ep.logprobs + [0.0] * len(env_ids)
    ep.done = False


def _answer(ep: Episode, calls, cfg: EnvConfig) -> list[tuple[str, str]]:
    """The answers to the turn's first env.max_tool_calls_per_turn calls, and one error answer for the rest (each
    counted as a failed call). Fails the episode when no thread is left for a tool (`ToolsExhausted`)."""
    t0, answers, cap = time.perf_counter(), [], cfg.max_tool_calls_per_turn
    for call in calls[:cap]:
        ep.calls += 1
        if call.error:
            answer, failed = call.error, True
        else:
            try:
                answer, failed = call_tool(ep.tools, call.name, call.arguments, cfg.tool_timeout_s)
            except ToolsExhausted as e:
                ep.fail(str(e))
                break
        ep.errors += failed
        answers.append((call.name or "error", answer))
        ep.transcript.append({"role": "tool", "name": call.name, "content": answer, "error": failed})
    if len(calls) > cap and not ep.failure:
        ep.calls, ep.errors = ep.calls + len(calls) - cap, ep.errors + len(calls) - cap
        answer = (
            f"Error: {len(calls)} tool calls in one turn; only the first {cap} were run (env.max_tool_calls_per_turn)"
        )
        answers.append(("error", answer))
        ep.transcript.append({"role": "tool", "name": None, "content": answer, "error": True})
    ep.seconds += time.perf_counter() - t0
    return answers


@runtime_checkable
class EpisodePlayer(Protocol):
    """An environment that plays whole episodes itself (a black-box agent drives the turns, not this loop)."""

    def rollouts(self, sample: Sampler, rows: list[dict], params: SamplingParams, version: int) -> Rollouts: ...


def run_episodes(sample: Sampler, tok, rows: list[dict], params: SamplingParams, cfg: EnvConfig, fmt: ChatFormat,
                 factory: Callable | None, functions: list[Tool], version: int) -> Rollouts:  # fmt: skip
    """params.n episodes per row, grouped (row i -> prompt i // n); every environment is a fresh factory(). With an
    OpenEnv server at most its session cap are open at once: the next episode starts when one ends. A factory that
    plays its own episodes (an `EpisodePlayer`: an agent's endpoint, `forge.env.agent.AgentHost`) is handed them."""
    if isinstance(factory, EpisodePlayer):
        return factory.rollouts(sample, rows, params, version)
    todo = [r for r in rows for _ in range(params.n)]
    cap = factory.max_sessions if isinstance(factory, OpenEnvClient) else len(todo)
    episodes: list[Episode] = []
    budget = cfg.max_tokens or 4 * params.max_new_tokens
    seeds = episode_seeds(params, len(todo))
    turn = dataclasses.replace(params, n=1)
    try:
        live = _start_more(episodes, [], todo, cap, factory, functions, fmt, tok)
        while live:
            index = {id(e): i for i, e in enumerate(episodes)}  # an episode's place in the call: its seed
            turn_seeds = None if seeds is None else [seeds[index[id(e)]] + e.turns * TURN_SEED_STRIDE for e in live]
            outs = sample([e.prompt_ids + e.ids for e in live], turn, turn_seeds)
            for ep, (new, lp) in zip(live, outs, strict=True):
                play_turn(ep, new, lp, cfg, budget, fmt, tok, version)
                if ep.done:
                    end_episode(ep)
            live = _start_more(episodes, [e for e in live if not e.done], todo, cap, factory, functions, fmt, tok)
    finally:
        for ep in episodes:
            end_episode(ep)
    return to_rollouts(episodes, tok, params.n, version, cfg.mask_truncated)


def _start_more(episodes: list[Episode], live: list[Episode], todo: list[dict], cap: int, factory: Callable | None,
                functions: list[Tool], fmt: ChatFormat, tok) -> list[Episode]:  # fmt: skip
    """Start the next episodes of `todo` (appended to `episodes`) until `cap` are live or none is left; the live."""
    while len(live) < cap and len(episodes) < len(todo):
        ep = start_episode(todo[len(episodes)], factory, functions, fmt, tok)
        episodes.append(ep)
        if ep.done:  # its environment failed at reset
            end_episode(ep)
        else:
            live.append(ep)
    return live


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
    masked = [(mask_truncated and e.truncated) or bool(e.failure) for e in episodes]
    loss = [[0] * len(e.loss) if m else e.loss for e, m in zip(episodes, masked, strict=True)]
    return Rollouts(
        prompt_ids=cat_padded([_row(e.prompt_ids, pad, torch.long) for e in episodes], pad, left=True),
        prompt_mask=cat_padded([_row([1] * len(e.prompt_ids), 0, torch.long) for e in episodes], 0, left=True),
        completion_ids=cat_padded([_row(e.ids, pad, torch.long) for e in episodes], pad, left=False),
        completion_mask=cat_padded([_row([1] * len(e.ids), 0, torch.long) for e in episodes], 0, left=False),
        sampling_logprobs=cat_padded([_row(e.logprobs, 0.0, torch.float32) for e in episodes], 0.0, left=False),
        texts=[tok.decode(e.ids, skip_special_tokens=True) for e in episodes],
        finish_reasons=[e.finish for e in episodes],
        group_size=group_size,
        policy_version=version,
        prompts=[e.prompt for e in episodes],
        loss_mask=cat_padded([_row(x, 0, torch.long) for x in loss], 0, left=False),
        episodes=Episodes(
            turns=[e.turns for e in episodes],
            tool_calls=[e.calls for e in episodes],
            tool_errors=[e.errors for e in episodes],
            truncated=[e.truncated for e in episodes],
            cut_turns=[e.cuts for e in episodes],
            seconds=[e.seconds for e in episodes],
            policy_versions=[[version] * e.turns for e in episodes],
            transcripts=[e.transcript for e in episodes],
            masked=masked,
            environments=[e.env for e in episodes],
            failures=[e.failure for e in episodes],
        ),  # fmt: skip
    )


def _row(xs: list, fill, dtype: torch.dtype) -> torch.Tensor:
    """[1, max(len(xs), 1)]: an episode without a token (its environment failed at reset) gets one `fill`, masked."""
    return torch.tensor([list(xs) or [fill]], dtype=dtype)


class EpisodeBackend:
    """Evaluation's backend in a multi-turn run: `generate(prompts, params)` plays params.n episodes per prompt on
    the rollout backend (hf or vLLM), each in its own row's environment. `forge.evaluate` passes the model inputs of
    the first rows it was given, in order, so prompt i is row i: rows are matched by position, never by prompt
    text, because games and most real environments give every row the same instruction and tell the instances
    apart by the other columns (`reset(**row)`)."""

    def __init__(self, backend, tok, rows: list[dict], cfg: EnvConfig, env: tuple):
        self.backend, self.tok, self.cfg, self.env = backend, tok, cfg, env
        self.rows = list(rows)
        self.policy_version = backend.policy_version

    def generate(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        factory, functions, fmt = self.env
        rows = self.rows[: len(prompts)]
        if [r["model_input"] for r in rows] != list(prompts):  # a caller that reorders would play the wrong rows
            raise ValueError("EpisodeBackend.generate takes the model inputs of its first rows, in order")
        return run_episodes(self.backend.generate_ids, self.tok, rows, params, self.cfg, fmt, factory, functions,
                            self.policy_version)  # fmt: skip
