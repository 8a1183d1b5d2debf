"""The collapse guard: a small labelled probe set watches a (label-free) reward for a collapse.

A label-free reward (`reward.label_free`, the weak-verifier ensemble) can be gamed: the policy settles on a confident
wrong answer that the checks agree on, and the reward keeps rising while accuracy falls. The run measures greedy
pass@1 on a labelled probe set (`collapse.probe_source`, prepared into data/probe.parquet; the reward never sees it)
every `collapse.probe_every` steps and at step 0, and hands each result to a `CollapseGuard`, which decides.

The rule, at a probe step s with probe pass@1 p_s, where the best probe so far is p_b at step b (the first probe that
reached that value: a later equal one does not replace it, as checkpoint retention keeps the earliest of equal
scores):

    fire  when  p_b - p_s > drop   (collapse.drop, absolute)
           and  R_since > R_at_b   (the reward rose meanwhile)

R_since is the mean `reward/mean` over the steps since the best probe step (b, s]; R_at_b is the mean `reward/mean`
over the probe interval that ended at b (the steps after the probe before b, up to b), or, for b = 0, of step 1,
whose rollouts come from the step-0 policy. A probe above p_b becomes the new best. A probe that falls without the
reward rising (training simply got worse) does not fire: that is not the reward being gamed.

Actions (`collapse.action`): "warn" reports; "rollback" asks the run to restore the best probe's checkpoint
(weights, optimizer, reward state) and go on with new prompts: the steps since b start again, from the restored
weights; after `max_rollbacks` rollbacks the next firing is a "stop", which ends the run with the best probe's
weights; "off" never fires. The guard is pure data: each method returns a new guard, the recipe acts
(`forge.recipes.grpo`) and keeps the guard in its loop state, and its state travels in checkpoints (`state_dict` /
`loaded`), so a resumed run decides exactly as the uninterrupted one.

>>> g, event = CollapseGuard("rollback", drop=0.05, max_rollbacks=1).probe(0, 0.0)
>>> event is None                                       # step 0: the first best
True
>>> g = g.observe(1, 0.2).observe(2, 0.3)
>>> g, event = g.probe(2, 0.40)                         # new best at step 2; R_at_b = (0.2 + 0.3) / 2 = 0.25
>>> event is None, g.best_step
(True, 2)
>>> g = g.observe(3, 0.5).observe(4, 0.7)
>>> g, event = g.probe(4, 0.20)                         # 0.40 - 0.20 > 0.05 and R_since = 0.6 > 0.25
>>> event.action, event.best_step, g.rollbacks
('rollback', 2, 1)
>>> print(event.line())
forgeweave: step 4: collapse guard: probe pass@1 0.40 -> 0.20 while reward/mean 0.25 -> 0.60; rolled back to step 2 (rollback 1 of 1)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from forge.config_base import ranged

Action = Literal["off", "warn", "stop", "rollback"]


@dataclass(kw_only=True)
class CollapseConfig:
    """`collapse`: the probe set and what the guard does when probe pass@1 falls while the reward rises."""

    action: Action = "warn"
    """With a probe set (collapse.probe_source): what the collapse guard does when probe pass@1 falls more than
    collapse.drop below its best while reward/mean rose (rule: forge/guard.py): warn (one stderr line), rollback
    (restore the best-probe checkpoint's weights, optimizer and reward state, go on with new prompts), stop (end with
    the best-probe weights), off. stop and rollback also checkpoint at step 0 and at every probe step."""
    drop: float = ranged(0.05, "in [0, 1)", "(a fall of probe pass@1, absolute)")
    """How far (absolute) probe pass@1 may fall below its best before it counts as a collapse."""
    max_rollbacks: int = ranged(2, ">= 0")
    """rollback: rollbacks per run; the next firing stops the run (as collapse.action=stop)."""
    probe_source: str = ""
    """Labelled probe file (formats and prompt/answer columns as data.eval_source), prepared into data/probe.parquet:
    greedy pass@1 on it (`probe/pass@1`) feeds only the collapse guard (collapse.action), never the reward;
    empty = no probe."""
    probe_every: int = ranged(0, ">= 0", "(0 = eval.every)")
    """Probe every this many steps (and at step 0 and the last step); 0 = eval.every."""
    probe_max_problems: int = ranged(200, ">= 1")
    """Probe rows used (the first ones of data/probe.parquet)."""


@dataclass(frozen=True)
class GuardEvent:
    """One firing of the guard: a line of guard.jsonl."""

    step: int  # the probe step it fired at
    action: str  # what the run does: warn, rollback or stop
    best_step: int  # the best probe's step (a rollback restores its checkpoint; a stop ends with its weights)
    probe_before: float  # best probe pass@1 so far
    probe_after: float  # this probe's pass@1
    reward_before: float  # R_at_b: mean reward/mean of the probe interval that ended at the best probe step
    reward_after: float  # R_since: mean reward/mean over the steps since the best probe step
    rollbacks: int  # rollbacks done, this one included
    max_rollbacks: int  # collapse.max_rollbacks when it fired

    def line(self) -> str:
        """The one stderr line the run prints."""
        head = (
            f"forgeweave: step {self.step}: collapse guard: probe pass@1 {self.probe_before:.2f} -> "
            f"{self.probe_after:.2f} while reward/mean {self.reward_before:.2f} -> {self.reward_after:.2f}"
        )
        if self.action == "rollback":
            return f"{head}; rolled back to step {self.best_step} (rollback {self.rollbacks} of {self.max_rollbacks})"
        if self.action == "stop":
            return f"{head}; stopping: the run ends with the weights of step {self.best_step}"
        return head


@dataclass(frozen=True)
class CollapseGuard:
    """The guard's state as data: the best probe and the reward since it. Every method that learns something returns
    a new guard (`observe`, `probe`, `holding`); the loop keeps the current one in its `LoopState`."""

    action: Action = "warn"
    drop: float = 0.05
    max_rollbacks: int = 2
    best_step: int | None = None  # None until the first probe
    best: float = 0.0  # best probe pass@1 so far
    reward_at_best: float | None = None  # R_at_b; None until a step's reward is known (b = 0)
    since: tuple[float, int] = (0.0, 0)  # sum and count of reward/mean over the steps since the best probe step
    interval: tuple[float, int] = (0.0, 0)  # the same since the last probe
    held: tuple[int, float | None] = (0, 0.0)  # (step, probe pass@1) of the weights the run holds
    rollbacks: int = 0
    events: tuple[dict, ...] = ()  # every firing, as guard.jsonl lines

    @classmethod
    def for_run(cls, cfg: CollapseConfig) -> CollapseGuard:
        """The guard collapse.action / drop / max_rollbacks ask for."""
        return cls(cfg.action, cfg.drop, cfg.max_rollbacks)

    def observe(self, step: int, reward_mean: float) -> CollapseGuard:
        """The guard after a training step's reward/mean (every step, in order)."""
        first = self.reward_at_best if self.reward_at_best is not None else reward_mean
        return dataclasses.replace(self, reward_at_best=first, since=_add(self.since, reward_mean),
                                   interval=_add(self.interval, reward_mean))  # fmt: skip

    def probe(self, step: int, pass1: float) -> tuple[CollapseGuard, GuardEvent | None]:
        """Decide at a probe step: the guard after it, and None or the event (its action: warn, rollback or stop)
        the run must act on."""
        event = self._fires(step, pass1)
        g = dataclasses.replace(self, held=(step, pass1), interval=(0.0, 0))
        if event is None and (self.best_step is None or pass1 > self.best):
            g = dataclasses.replace(g, best_step=step, best=pass1, reward_at_best=_mean(self.interval), since=(0.0, 0))
        if event is not None:
            g = dataclasses.replace(g, events=(*g.events, dataclasses.asdict(event)), rollbacks=event.rollbacks)
            if event.action in ("rollback", "stop"):  # the run restores the best probe's weights
                g = dataclasses.replace(g, held=(step, self.best), since=(0.0, 0))
        return g, event

    def holding(self, step: int, pass1: float | None) -> CollapseGuard:
        """After a firing at `step`, the run restored other weights than the best probe's (its checkpoint was
        damaged): their probe pass@1 `pass1` (None: unknown) is the score of the checkpoint written at `step`."""
        return dataclasses.replace(self, held=(step, pass1))

    def metrics(self, event: GuardEvent | None) -> dict[str, float]:
        """`guard/fired` (0/1), `guard/rollbacks` and, for a rollback, `guard/rollback_to` of a probe step."""
        m = {"guard/fired": float(event is not None), "guard/rollbacks": float(self.rollbacks)}
        if event is not None and event.action == "rollback":
            m["guard/rollback_to"] = float(event.best_step)
        return m

    def score_at(self, step: int) -> float | None:
        """The checkpoint score of step `step`: probe pass@1 of the weights held then (None: not probed)."""
        return self.held[1] if self.held[0] == step else None

    def summary(self, stopped: str = "") -> dict:
        """summary.json's `probe` entry; after a stop (`stopped`: why) also `stopped` and `final_model_step`, the
        step whose weights the final checkpoint holds."""
        out: dict = {"probe": {"best_step": self.best_step, "best_pass@1": self.best, "rollbacks": self.rollbacks,
                               "guard_events": len(self.events)}}  # fmt: skip
        if stopped:
            out.update(stopped=stopped, final_model_step=self.best_step)
        return out

    def _fires(self, step: int, pass1: float) -> GuardEvent | None:
        if self.action == "off" or self.best_step is None or self.reward_at_best is None or not self.since[1]:
            return None
        after = _mean(self.since)
        if not (self.best - pass1 > self.drop and after > self.reward_at_best):
            return None
        action, rollbacks = self.action, self.rollbacks
        if action == "rollback":
            action = "rollback" if rollbacks < self.max_rollbacks else "stop"
            rollbacks += action == "rollback"
        return GuardEvent(step, action, self.best_step, self.best, pass1, self.reward_at_best, after,
                          rollbacks, self.max_rollbacks)  # fmt: skip

    def state_dict(self) -> dict:
        """Everything it decides on (JSON-ready), for the checkpoint payload."""
        return {
            "best_step": self.best_step, "best": self.best, "reward_at_best": self.reward_at_best,
            "since": list(self.since), "interval": list(self.interval), "held": list(self.held),
            "rollbacks": self.rollbacks, "events": [dict(e) for e in self.events],
        }  # fmt: skip

    def loaded(self, state: dict | None) -> CollapseGuard:
        """This guard's settings with the state `state_dict` gave (None: a checkpoint written without a probe:
        this guard unchanged)."""
        if state is None:
            return self
        return dataclasses.replace(
            self, best_step=state["best_step"], best=state["best"], reward_at_best=state["reward_at_best"],
            since=tuple(state["since"]), interval=tuple(state["interval"]), held=tuple(state["held"]),
            rollbacks=state["rollbacks"], events=tuple(dict(e) for e in state["events"]),
        )  # fmt: skip


def _add(acc: tuple[float, int], value: float) -> tuple[float, int]:
    return acc[0] + value, acc[1] + 1


def _mean(acc: tuple[float, int]) -> float | None:
    return acc[0] / acc[1] if acc[1] else None
