"""Agents written against the OpenAI API as environments (`env.agent`): each episode runs the user's function
`agent(base_url, row) -> float | None` in a thread of its own, against an OpenAI-compatible endpoint that
forgeweave serves from the policy (`forge.env.openai_server`, one base URL per episode), and records every request's
prompt token ids, sampled token ids and sampling log-probs. The function's return value is the episode's reward
(`agent_rewards`; None: the verifiers score the final reply's text).

One call of `AgentHost.rollouts` plays params.n episodes per data row (grouped as `forge.env.episode.run_episodes`
groups them). The calling thread is the only one that renders, tokenises and samples: the server's threads queue
each request and wait; the calling thread takes the queue once every running episode has a request waiting, or
`env.agent.batch_wait_ms` after the first one came, and samples them together (one `generate_ids` call per distinct
sampling setting; a request's `n` choices are n contexts). Each choice draws from a seed of its own, the episode's
seed plus its draw count times `TURN_SEED_STRIDE`, as episode turns do.

The training sequences (`episode_sequences`): the first request's prompt, then its reply (loss mask 1, its sampling
log-probs), then the tokens the next request's prompt adds after it (loss mask 0, log-prob 0), its reply, and so on,
as long as each request's prompt ids start with an earlier request's prompt ids plus one of its replies' ids (the
choice the agent kept). `forge.env.agent_chat.AgentChat.bridge` makes that the case for a chat loop that appends: the
sampled ids are reused, only the template's text is tokenised. A request that extends no earlier one (the agent
rewrote, summarised or dropped history, or a template re-renders earlier turns) is a prefix break: it begins a
training sequence of its own (its whole prompt, loss 0, then its reply), which later requests may continue; a
request continues the latest sequence whose last request it extends (agents that interleave two conversations keep
two sequences). The episode's first sequence is its `Rollouts` row; the others are `Episodes.more_sequences`, trained
with the episode's one reward and advantage (`forge.sequences`: an episode counts once in the loss normalisers);
`Episodes.prefix_breaks` (the metric `env/agent_prefix_breaks`) counts them per episode.

Limits: `env.max_turns` requests per episode and `env.max_tokens` tokens after the first prompt (0 = 4 x
rollout.max_new_tokens); a request past one is answered 400 (code `episode_limit`) and the episode is truncated (out
of the loss with env.mask_truncated). A request's max_tokens is capped by rollout.max_new_tokens and the room left.
An agent that raises, returns something that is not a number or None, makes no request, or runs past
`env.agent.timeout_s` fails its episode with a one-line reason (finish reason "error", out of the loss, unscored, the
run goes on; the step's `env/failed` counts them). A thread that hangs cannot be stopped: its URL answers 404 from
then on. Temperature and top_p are the step's unless `env.agent.request_sampling`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from forge.env.agent_chat import AgentChat, cut_at_stop, reply_message, same_message
from forge.env.config import EnvConfig
from forge.env.episode import TURN_SEED_STRIDE, Episode, episode_seeds, to_rollouts
from forge.env.openai_server import (
    ChatRequest,
    OpenAIServer,
    RequestError,
    _message,
    chat_response,
    new_episode_id,
)
from forge.records import Episodes, Rollouts, SamplingParams, TokenSequence

MODEL_ALIAS = "policy"  # a model id every agent may use, beside the run's model.path
IDLE_WAKE_S = 0.2  # how often the calling thread looks at the agents' clocks while nothing is queued


@dataclass(frozen=True)
class AgentResult:
    """What an agent episode leaves for the reward stage (its `Episodes.environments` entry; `env_reward` reads
    `reward`)."""

    reward: float | None  # the agent's return value (None: the verifiers score the final reply)
    requests: int  # chat completion requests answered
    failure: str = ""


@dataclass
class Choice:
    ids: list[int]  # sampled, eos included when sampled (cut after a stop string)
    logprobs: list[float]
    ended: bool  # the ids end with eos
    message: dict  # the assistant message the agent got, normalised (to recognise it in the next request)
    wire: dict  # the same as OpenAI sends it
    text: str
    finish: str  # OpenAI's: stop | length | tool_calls


@dataclass
class Call:
    messages: list[dict]
    tools: list[dict]
    prompt_ids: list[int]
    choices: list[Choice]
    version: int


@dataclass
class AgentEpisode:
    """One agent episode in progress (mutable; guarded by its host's lock while agents run)."""

    id: str
    row: dict
    index: int  # its place in the call: its seed
    calls: list[Call] = field(default_factory=list)
    thread: threading.Thread | None = None
    started: float = 0.0
    draws: int = 0  # choices sampled so far (the seed offset of the next)
    done: bool = False
    reward: float | None = None
    failure: str = ""
    truncated: bool = False
    seconds: float = 0.0
    refused: int = 0  # requests answered with an error while it ran
    timed_out: bool = False


@dataclass
class _Pending:
    episode: str
    request: ChatRequest
    event: threading.Event = field(default_factory=threading.Event)
    response: dict | None = None
    error: RequestError | None = None


@dataclass(frozen=True)
class _Job:
    pending: _Pending
    episode: AgentEpisode
    prompt_ids: list[int]
    params: SamplingParams
    seeds: list[int] | None


class AgentHost:
    """The `env.agent` environment of a rollout worker: the endpoint (started here, on a free port of 127.0.0.1;
    `close` stops it) and the episodes of the call in progress."""

    def __init__(self, agent: Callable, tok, cfg: EnvConfig, model: str, use_template: bool = True):
        self.agent, self.tok, self.fmt, self.cfg = agent, tok, AgentChat(tok, use_template), cfg
        self.name = getattr(agent, "__qualname__", repr(agent))
        self.models_served = [model, MODEL_ALIAS]
        self.cond = threading.Condition()
        self.live: dict[str, AgentEpisode] = {}  # episode id -> episode, while its call runs
        self.queue: list[_Pending] = []
        self.step = SamplingParams()  # the call in progress's sampling (temperature, max_new_tokens, seeds)
        self.seeds: list[int] | None = None
        self.version = 0
        self.server = OpenAIServer(self)

    # --- the endpoint's side (server threads) ---
    def models(self, episode: str) -> list[str]:
        with self.cond:
            self._episode(episode)
        return list(self.models_served)

    def chat(self, episode: str, request: ChatRequest) -> dict:
        pending = _Pending(episode, request)
        with self.cond:
            self._episode(episode)
            self.queue.append(pending)
            self.cond.notify_all()
        if not pending.event.wait(self.cfg.agent.timeout_s + 10):
            raise RequestError(504, "the request was not answered in time", None, "timeout")
        if pending.error is not None:
            raise pending.error
        return pending.response

    def refused(self, episode: str, error: RequestError) -> None:
        """Count a request of a running episode that was answered with `error` (malformed, unsupported, past a
        limit); requests to unknown or ended episodes are not anyone's."""
        with self.cond:
            ep = self.live.get(episode)
            if ep is not None and not ep.done:
                ep.refused += 1

    def _episode(self, episode: str) -> AgentEpisode:
        ep = self.live.get(episode)
        if ep is None or ep.done:
            raise RequestError(404, "no such episode (or it has ended)", None, "episode_not_found")
        return ep

    # --- the calling thread ---
    def rollouts(self, sample: Callable, rows: list[dict], params: SamplingParams, version: int) -> Rollouts:
        """params.n agent episodes per row of `rows`, sampled by `sample` (`forge.env.episode.Sampler`), as one
        record (row i -> prompt i // n)."""
        episodes = [
            AgentEpisode(new_episode_id(), r, i) for i, r in enumerate(r for r in rows for _ in range(params.n))
        ]
        self.step, self.version = params, version
        self.seeds = episode_seeds(params, len(episodes))
        try:
            while (batch := self._next_batch(episodes)) is not None:
                self._serve(batch, sample)
        finally:
            self._end(episodes)
        return agent_rollouts(episodes, self.tok, params.n, version, self.cfg.mask_truncated)

    def _next_batch(self, episodes: list[AgentEpisode]) -> list[_Pending] | None:
        """The queued requests, once every running episode has one waiting or the batch wait is over; None when
        every episode has ended. Starts episodes up to env.agent.max_concurrent and fails those out of time."""
        wait, first = self.cfg.agent.batch_wait_ms / 1000, None
        cap = self.cfg.agent.max_concurrent or len(episodes)
        with self.cond:
            while True:
                running = self._start_and_expire(episodes, cap)
                if not running and all(e.done for e in episodes):
                    return None
                if self.queue:
                    first = first or time.monotonic()
                    waiting = {p.episode for p in self.queue}
                    if len(waiting) >= len(running) or time.monotonic() - first >= wait:
                        batch, self.queue = self.queue, []
                        return batch
                    self.cond.wait(max(first + wait - time.monotonic(), 0.0))
                else:
                    self.cond.wait(IDLE_WAKE_S)

    def _start_and_expire(self, episodes: list[AgentEpisode], cap: int) -> list[AgentEpisode]:
        """(lock held) Start episodes up to `cap` running; fail those past env.agent.timeout_s; the running ones."""
        now = time.perf_counter()
        for ep in episodes:
            if ep.thread is not None and not ep.done and now - ep.started > self.cfg.agent.timeout_s:
                ep.timed_out = True
                self._finish(ep, None, f"agent {self.name} did not return within env.agent.timeout_s="
                                       f"{self.cfg.agent.timeout_s:g} s")  # fmt: skip
        running = [e for e in episodes if e.thread is not None and not e.done]
        for ep in episodes:
            if len(running) >= cap:
                break
            if ep.thread is None:
                self.live[ep.id], ep.started = ep, now
                ep.thread = threading.Thread(target=self._play, args=(ep,), name="forge-agent", daemon=True)
                ep.thread.start()
                running.append(ep)
        return running

    def _play(self, ep: AgentEpisode) -> None:
        """(an agent's thread) Run the agent on its episode's URL and row; its reward or failure ends the episode."""
        reward, failure = None, ""
        try:
            value = self.agent(self.server.base_url(ep.id), dict(ep.row))
            if inspect.isawaitable(value):  # an async agent
                value = asyncio.run(_awaited(value))
            reward, failure = _checked_reward(value, self.name)
        except Exception as e:  # the user's agent: one line, the episode fails, the run goes on
            failure = " ".join(f"agent {self.name} raised {type(e).__name__}: {e}".split())[:300]
        with self.cond:
            if not ep.done:
                self._finish(ep, reward, failure)

    def _finish(self, ep: AgentEpisode, reward: float | None, failure: str) -> None:
        """(lock held) End an episode: its reward or failure, its seconds; queued requests of it are refused."""
        if not failure and not ep.calls:
            failure = f"agent {self.name} made no request to its base URL"
        ep.done, ep.reward, ep.failure = True, reward if not failure else None, failure
        ep.seconds = time.perf_counter() - ep.started
        for p in [p for p in self.queue if p.episode == ep.id]:
            self.queue.remove(p)
            _answer(p, error=RequestError(404, "the episode has ended", None, "episode_not_found"))
        self.cond.notify_all()

    def _end(self, episodes: list[AgentEpisode]) -> None:
        with self.cond:
            for ep in episodes:
                if not ep.done:
                    self._finish(ep, None, f"agent {self.name}: the rollout call ended first")
                self.live.pop(ep.id, None)

    def _serve(self, batch: list[_Pending], sample: Callable) -> None:
        """Render the batch's requests, sample them (one call per distinct sampling setting), answer each."""
        jobs: list[_Job] = []
        for pending in batch:
            try:
                jobs.append(self._job(pending))
            except RequestError as e:
                _answer(pending, error=e)
        groups: dict[SamplingParams, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.params, []).append(job)
        for params, group in groups.items():
            contexts = [job.prompt_ids for job in group for _ in range(job.pending.request.n)]
            seeds = None if group[0].seeds is None else [s for job in group for s in job.seeds]
            outs = iter(sample(contexts, params, seeds))
            for job in group:
                self._reply(job, [next(outs) for _ in range(job.pending.request.n)])

    def _job(self, pending: _Pending) -> _Job:
        """A request's prompt ids, sampling and seeds; a RequestError where the episode is over or out of room."""
        req, cfg = pending.request, self.cfg
        with self.cond:
            ep = self._episode(pending.episode)
        if len(ep.calls) >= cfg.max_turns:
            ep.truncated = True
            raise RequestError(400, f"the episode has made env.max_turns={cfg.max_turns} requests", None,
                               "episode_limit")  # fmt: skip
        ids = self._prompt_ids(ep, req)
        first = len(ep.calls[0].prompt_ids) if ep.calls else len(ids)
        room = first + (cfg.max_tokens or 4 * self.step.max_new_tokens) - len(ids)
        if room <= 0:
            ep.truncated = True
            raise RequestError(400, f"the episode is past its token budget (env.max_tokens) with {len(ids)} tokens",
                               "messages", "episode_limit")  # fmt: skip
        step = self.step
        own = cfg.agent.request_sampling
        temperature = req.temperature if own and req.temperature is not None else step.temperature
        top_p = req.top_p if own and req.top_p is not None else step.top_p
        limit = min(req.max_tokens or step.max_new_tokens, step.max_new_tokens, room)
        params = SamplingParams(max_new_tokens=limit, temperature=temperature, top_p=top_p, n=1,
                                batch_size=step.batch_size)  # fmt: skip
        seeds = None
        if self.seeds is not None and temperature > 0:
            seeds = [self.seeds[ep.index] + (ep.draws + j) * TURN_SEED_STRIDE for j in range(req.n)]
        ep.draws += req.n
        return _Job(pending, ep, ids, params, seeds)

    def _prompt_ids(self, ep: AgentEpisode, req: ChatRequest) -> list[int]:
        """The request's token ids: bridged from the latest earlier request it extends, else rendered whole."""
        for last in reversed(ep.calls):
            if (ids := self._bridged(last, req)) is not None:
                return ids
        return self.fmt.ids(req.messages, req.tools)

    def _bridged(self, last: Call, req: ChatRequest) -> list[int] | None:
        """`last`'s prompt ids, the sampled ids of the reply `req` continues and the template's diff after it; None
        where `req`'s messages are not `last`'s, one of its replies and more (or the tools changed)."""
        size = len(last.messages)
        if len(req.messages) <= size or req.tools != last.tools:
            return None
        if not all(same_message(a, b) for a, b in zip(req.messages[:size], last.messages, strict=True)):
            return None
        for choice in last.choices:
            if same_message(req.messages[size], choice.message):
                tail = self.fmt.bridge(req.messages[:size], req.messages[size], req.messages[size + 1 :], req.tools,
                                        choice.ended)  # fmt: skip
                if tail is not None:
                    return last.prompt_ids + choice.ids + tail
        return None

    def _reply(self, job: _Job, outs: list[tuple[list[int], list[float]]]) -> None:
        """Record the sampled choices against the episode and answer the request."""
        req, eos = job.pending.request, self.tok.eos_token_id
        choices = []
        for ids, logprobs in outs:
            keep, text = cut_at_stop(self.tok, ids, req.stop)
            stopped, ids, logprobs = text is not None, ids[:keep], logprobs[:keep]
            ended = bool(ids) and ids[-1] == eos
            text = self.tok.decode(ids, skip_special_tokens=True) if text is None else text
            wire, finish = reply_message(text, bool(req.tools) and req.parse_tools, ended or stopped)
            choices.append(Choice(ids, logprobs, ended, _message(wire, "reply"), wire, text, finish))
        with self.cond:
            job.episode.calls.append(Call(req.messages, req.tools, job.prompt_ids, choices, self.version))
        response = chat_response(req.model, [(c.wire, c.finish) for c in choices], len(job.prompt_ids),
                                 sum(len(c.ids) for c in choices))  # fmt: skip
        _answer(job.pending, response=response)

    def close(self) -> None:
        """Stop the endpoint; idempotent."""
        self.server.close()


def load_agent(spec: str) -> Callable:
    """The agent function `env.agent.fn` names; one line if it is not a function of (base_url, row)."""
    from forge.env.tools import load_object
    from forge.errors import UserError

    fn = load_object(spec, "env.agent.fn")
    try:
        inspect.signature(fn).bind("http://127.0.0.1/v1", {})
    except (TypeError, ValueError):
        raise UserError(
            f"config key 'env.agent.fn': {spec} must be a function agent(base_url: str, row: dict) -> float | None"
        ) from None
    return fn


def _answer(pending: _Pending, response: dict | None = None, error: RequestError | None = None) -> None:
    pending.response, pending.error = response, error
    pending.event.set()


async def _awaited(value):
    return await value


def _checked_reward(value: object, name: str) -> tuple[float | None, str]:
    """(the reward, '') for a number or None; (None, why) for anything else.

    >>> _checked_reward(1, "f"), _checked_reward(None, "f"), _checked_reward("1", "f")[1]
    ((1.0, ''), (None, ''), 'agent f returned a str: return a float or None')
    """
    if value is None:
        return None, ""
    if not isinstance(value, int | float):
        return None, f"agent {name} returned a {type(value).__name__}: return a float or None"
    if not math.isfinite(value):
        return None, f"agent {name} returned {value}: return a finite number or None"
    return float(value), ""


def episode_sequences(calls: list[Call]) -> list[TokenSequence]:
    """The episode's training sequences, in the order they began: each request continues the sequence whose last
    request's prompt plus one of its replies its prompt extends (the latest such), or begins one (a prefix break). A
    sequence is its first prompt, then per request its reply (the choice the next request kept; loss 1, its
    log-probs) and what the next request's prompt adds after it (loss 0, log-prob 0).

    >>> c = lambda p, *outs: Call([], [], p, [Choice(o, [-0.5] * len(o), True, {}, {}, "", "stop") for o in outs], 0)
    >>> calls = [c([1, 2], [3], [4]), c([1, 2, 4, 9], [5]), c([7], [8]), c([1, 2, 4, 9, 5, 6], [0])]
    >>> [(s.prompt_ids, s.ids, s.loss, s.turns) for s in episode_sequences(calls)]
    [([1, 2], [4, 9, 5, 6, 0], [1, 0, 1, 0, 1], 3), ([7], [8], [1], 1)]
    """
    parents = _parents(calls)
    kept = {p[0]: p[1] for p in parents if p is not None}
    head: list[int] = []  # each request's sequence's first request
    chains: dict[int, list[int]] = {}
    for k, parent in enumerate(parents):
        head.append(k if parent is None else head[parent[0]])
        chains.setdefault(head[k], []).append(k)
    return [_sequence(calls, chain, kept) for chain in chains.values()]


def _parents(calls: list[Call]) -> list[tuple[int, int] | None]:
    """Per request, (the earlier request it continues, the index of the choice it kept), or None where it begins a
    sequence. Only a sequence's last request can be continued (a second continuation of one begins a sequence)."""
    parents: list[tuple[int, int] | None] = []
    tails: list[int] = []  # the last request of each sequence so far
    for k, call in enumerate(calls):
        found = next(((j, i) for j in reversed(tails) if (i := _kept(calls[j], call)) is not None), None)
        if found is not None:
            tails.remove(found[0])
        tails.append(k)
        parents.append(found)
    return parents


def _sequence(calls: list[Call], chain: list[int], kept: dict[int, int]) -> TokenSequence:
    prompt = calls[chain[0]].prompt_ids
    ids: list[int] = []
    loss: list[int] = []
    logprobs: list[float] = []
    for i, k in enumerate(chain):
        if i:  # what this request's prompt adds after the last reply: the agent's messages, the template's text
            added = calls[k].prompt_ids[len(prompt) + len(ids) :]
            ids, loss, logprobs = ids + added, loss + [0] * len(added), logprobs + [0.0] * len(added)
        choice = calls[k].choices[kept.get(k, 0)]
        ids, loss, logprobs = ids + choice.ids, loss + [1] * len(choice.ids), logprobs + choice.logprobs
    return TokenSequence(prompt, ids, loss, logprobs, turns=len(chain))


def _kept(call: Call, after: Call) -> int | None:
    """The index of `call`'s choice whose tokens `after`'s prompt continues (None: it continues none)."""
    for j, choice in enumerate(call.choices):
        head = call.prompt_ids + choice.ids
        if after.prompt_ids[: len(head)] == head:
            return j
    return None


def agent_rollouts(episodes: list[AgentEpisode], tok, group_size: int, version: int, mask_truncated: bool) -> Rollouts:
    """The episodes as one record (`forge.env.episode.to_rollouts`): each its first training sequence as its row, the
    others in `Episodes.more_sequences` (all out of the loss where the episode is), the verifiers' text its final
    reply, `Episodes.requests` and `prefix_breaks` per episode, an `AgentResult` as its environment."""
    played = [_as_episode(ep, tok, version) for ep in episodes]
    ro = to_rollouts([e for e, _ in played], tok, group_size, version, mask_truncated)
    more = [[dataclasses.replace(s, loss=[0] * len(s.loss)) for s in seqs] if masked else seqs
            for (_, seqs), masked in zip(played, ro.episodes.masked, strict=True)]  # fmt: skip
    finals = [ep.calls[-1].choices[0].text if ep.calls else "" for ep in episodes]
    counts = dict(requests=[len(ep.calls) for ep in episodes], prefix_breaks=[len(s) for s in more],
                  more_sequences=more, refused=[ep.refused for ep in episodes],
                  timed_out=[ep.timed_out for ep in episodes])  # fmt: skip
    return dataclasses.replace(ro, texts=finals, episodes=dataclasses.replace(ro.episodes, **counts))


def _as_episode(ep: AgentEpisode, tok, version: int) -> tuple[Episode, list[TokenSequence]]:
    """(the loop's `Episode` record of an agent episode: its first sequence, its further sequences)."""
    result = AgentResult(ep.reward, len(ep.calls), ep.failure)
    if not ep.calls:  # failed before its first request: the row's text stands as the prompt, nothing is trained
        ids = tok(ep.row.get("model_input", ""), add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
        out = Episode(result, {}, tok.decode(ids), ids, [], seconds=ep.seconds, done=True)
        out.fail(ep.failure)
        return out, []
    first, *more = episode_sequences(ep.calls)
    last = ep.calls[-1].choices[0]
    out = Episode(result, {}, tok.decode(first.prompt_ids), first.prompt_ids, [], ids=first.ids, loss=first.loss,
                  logprobs=first.logprobs, transcript=_transcript(ep.calls, version), turns=len(ep.calls),
                  cuts=sum(c.finish == "length" for call in ep.calls for c in call.choices[:1]),
                  calls=sum(len(c.message.get("tool_calls", [])) for call in ep.calls for c in call.choices[:1]),
                  seconds=ep.seconds, truncated=ep.truncated, done=True,
                  finish="length" if ep.truncated or last.finish == "length" else "stop")  # fmt: skip
    if ep.failure:
        out.fail(ep.failure)
    return out, more


def _transcript(calls: list[Call], version: int) -> list[dict]:
    """The segments a reader sees: the first request's messages (role "environment": the prompt), then per request
    the messages it added to the request it continues (a request that begins a training sequence: a note, then all
    its messages; one that goes back to an earlier sequence: a note) and its first choice's reply."""
    out = [{"role": "environment", "content": f"[{m['role']}] {m['content']}"} for m in calls[0].messages]
    parents, begun = _parents(calls), [0]  # begun: the first request of each sequence
    for k, (call, parent) in enumerate(zip(calls, parents, strict=True)):
        if k and parent is None:
            begun.append(k)
            out.append({"role": "environment", "content": f"(history rewritten: training sequence {len(begun)} "
                        "begins here)"})  # fmt: skip
        elif k and parent[0] != k - 1:
            out.append({"role": "environment", "content": f"(continues request {parent[0] + 1})"})
        start = 0 if parent is None else len(calls[parent[0]].messages) + 1
        if k:
            out += [{"role": "tool" if m["role"] == "tool" else "user", "content": m["content"]}
                    for m in call.messages[start:]]  # fmt: skip
        out.append({"role": "assistant", "content": call.choices[0].text, "policy_version": call.version})
    return out


def agent_rewards(episodes: Episodes | None, rewards: torch.Tensor) -> torch.Tensor:
    """[N] `rewards` with each agent episode's own reward where its agent returned one.

    >>> e = Episodes([1, 1], [0, 0], [0, 0], [False] * 2, [0.0] * 2, [[0], [0]], [[], []],
    ...              environments=[AgentResult(1.0, 1), AgentResult(None, 1)])
    >>> agent_rewards(e, torch.tensor([0.0, 0.5])).tolist()
    [1.0, 0.5]
    """
    if episodes is None:
        return rewards
    own = [e.reward if isinstance(e, AgentResult) else None for e in episodes.environments]
    given = torch.tensor([r is not None for r in own], dtype=torch.bool)
    if not given.any():
        return rewards
    values = torch.tensor([r if r is not None else 0.0 for r in own], dtype=rewards.dtype)
    return torch.where(given, values, rewards)
