"""Reward aggregation: the label-free ensemble over a rolling window of recent scored rollouts, and two baselines.

`reward.aggregate` picks how a completion's reward is made (forge.workers.RewardWorker.score):

- weighted: sum_v w_v * score_v (forge.rewards.score; NaN counts as 0);
- mean: `mean_scores`, the naive average of the verifier scores, ignoring NaN (every score NaN: 0), the
  baseline an ensemble must beat;
- majority: `majority_rewards`, test-time RL by majority vote (TTRL, Zuo et al. 2025): in each group the most
  common final answer (`forge.rewards.math.answer_key`) gets 1, every other completion 0. Departures from the
  paper: the vote is over the G training samples themselves (TTRL can vote over more samples than it trains
  on), a tie goes to the answer seen first, and a group where no completion has an answer gets 0 throughout.
  The verifiers still run (their scores are logged) but do not enter the reward;
- ensemble: below.

With `reward.aggregate: ensemble` the reward of a completion is P(correct | its verifier scores), from a
`WeakVerifierEnsemble` (`reward.ensemble.model: gaussian`, any scores) or a `LatentClassEnsemble` (`latent_class`,
discrete checks; `reward.ensemble.necessary_checks` names the checks every correct answer passes), refit every
`reward.ensemble.refit_every` steps on the last `reward.ensemble.window_steps` steps' score matrices (the current
one included). The window and the fitted ensemble are part of the checkpoint, so a resumed run
predicts with the same fit and refits on the same data. No reference answer is read here.

A refit is accepted only if it still separates candidates and agrees in direction with the ensemble in use
(`refit_verdict`). In RL the scored data drift with the policy: once most samples of a prompt look alike (a
collapsed or converged policy), EM can land on a flat fit (every weight 0: every reward equal, no learning signal
ever again) or flip which class it calls correct (rewarding what it punished a step before). A rejected refit
keeps the previous ensemble and is logged with the reason (`ensemble/accepted` = 0).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from forge.errors import UserError
from forge.rewards.ensemble import EnsembleConfig, RewardEnsembleConfig, WeakVerifierEnsemble
from forge.rewards.latent_class import LatentClassConfig, LatentClassEnsemble
from forge.rewards.math import answer_key


def mean_scores(scores: torch.Tensor) -> torch.Tensor:
    """scores [N, V] (NaN = missing) -> rewards [N]: each completion's mean score over the verifiers that scored it
    (0 where none did).

    >>> nan = float("nan")
    >>> mean_scores(torch.tensor([[1.0, 0.0, 0.5], [nan, 1.0, nan], [nan, nan, nan]])).tolist()
    [0.5, 1.0, 0.0]
    """
    return scores.double().nanmean(dim=1).nan_to_num(nan=0.0).float()


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common answer that is not None (a tie goes to the one seen first); None when none has one.

    >>> majority_vote(["8", None, "7", "7", "8"]), majority_vote([None, None]) is None
    ('8', True)
    """
    counts = Counter(a for a in answers if a is not None)
    return max(counts, key=counts.__getitem__) if counts else None  # max keeps the first of equal counts


def majority_rewards(texts: list[str], group_size: int) -> torch.Tensor:
    """texts [N] (G consecutive completions per prompt) -> rewards [N]: 1 where a completion's final answer is
    its group's majority answer, else 0 (also when it has no answer).

    >>> majority_rewards(["so 4", "4", "5", "I do not know"], 4).tolist()
    [1.0, 1.0, 0.0, 0.0]
    >>> majority_rewards(["no idea", "none"], 2).tolist()
    [0.0, 0.0]
    """
    keys = [answer_key(t) for t in texts]
    rewards = []
    for start in range(0, len(keys), group_size):
        group = keys[start : start + group_size]
        winner = majority_vote(group)
        rewards += [float(winner is not None and k == winner) for k in group]
    return torch.tensor(rewards, dtype=torch.float32)


class EnsembleAggregator:
    def __init__(self, names: list[str], cfg: RewardEnsembleConfig, seed: int = 0):
        """`names`: the verifiers, in score-column order; `cfg`: reward.ensemble; `seed`: the run's seed."""
        self.names = names
        self.model, self.classes = cfg.model, cfg.classes
        if unknown := [n for n in cfg.necessary_checks if n not in names]:
            raise UserError(f"reward.ensemble.necessary_checks: {unknown} are not among the verifiers {names}")
        self.necessary = tuple(names.index(n) for n in cfg.necessary_checks)
        self.window_steps = cfg.window_steps
        self.refit_every = cfg.refit_every
        self.seed = seed
        self.window: list[tuple[np.ndarray, np.ndarray]] = []  # per step: scores [N, V], groups [N]
        self.ensemble: WeakVerifierEnsemble | LatentClassEnsemble | None = None
        self.refits = 0
        self.rejected = 0

    def __call__(self, scores: torch.Tensor, group_size: int, step: int) -> tuple[torch.Tensor, dict | None]:
        """scores [N, V] (NaN = missing) -> (rewards [N], the ensemble report when it was refit this step)."""
        s = scores.double().numpy()
        groups = step * 1_000_000 + np.arange(len(s)) // group_size  # unique prompt ids across the window
        # a repeated call for the same step (a retried stage) replaces that step's entry instead of adding one
        others = [w for w in self.window if int(w[1][0]) // 1_000_000 != step]
        self.window = [*others, (s, groups)][-self.window_steps :]
        report = None
        if self.ensemble is None or step % self.refit_every == 0:
            report = self._refit()
        p = self.ensemble.predict_proba(s, groups)  # [N]
        if self.necessary and self.model == "gaussian":
            p = p * passes_necessary(s, self.necessary)
        return torch.as_tensor(p, dtype=torch.float32), report

    def _refit(self) -> dict:
        candidate = self._new_model().fit(
            np.concatenate([w[0] for w in self.window]),
            np.concatenate([w[1] for w in self.window]),
            names=self.names,
        )
        report = candidate.report()
        previous = self.ensemble.report() if self.ensemble is not None else None
        reason = refit_verdict(report, previous)
        self.refits += 1
        if reason is None or previous is None:
            self.ensemble = candidate
        else:
            self.rejected += 1
            report = {**previous, "rejected_refit": reason}
        report["accepted"] = reason is None or previous is None
        return report

    def _new_model(self) -> WeakVerifierEnsemble | LatentClassEnsemble:
        if self.model == "latent_class":
            return LatentClassEnsemble(
                LatentClassConfig(classes=self.classes, seed=self.seed, necessary=self.necessary)
            )
        return WeakVerifierEnsemble(EnsembleConfig(classes=self.classes, seed=self.seed))

    def state_dict(self) -> dict:
        """The window and the fitted ensemble in use: a resumed run predicts with the same fit until its next
        refit (with refit_every > 1, refitting on resume would change the rewards)."""
        model = self.ensemble.state_dict() if self.ensemble is not None else None
        return {"window": self.window, "refits": self.refits, "rejected": self.rejected, "model": model}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.refits, self.rejected = state["window"], state["refits"], state.get("rejected", 0)
        self.window = [(np.asarray(s), np.asarray(g)) for s, g in self.window]  # JSON turned the pairs into lists
        model = state.get("model")
        # an older checkpoint without the fit: refit on the restored window at the next step
        self.ensemble = self._new_model().load_state_dict(model) if model is not None else None


def passes_necessary(scores: np.ndarray, necessary: tuple[int, ...]) -> np.ndarray:
    """[N] 1.0 where no declared-necessary check failed (score < 1), else 0.0; a missing score (NaN) fails nothing.

    The Gaussian ensemble's posterior is linear in the (normal) scores, so strong soft signals can outweigh a
    failed check: on SmolLM2 it paid ~1.0 for bare echoes of an operand ("78" for 78 + 37), short and well formatted
    but failing parity and digit count. A check that every right answer passes makes P(correct | failed it) = 0.

    >>> passes_necessary(np.array([[1.0, 1.0, 0.3], [0.0, 1.0, 0.9], [np.nan, 1.0, 0.1]]), (0, 1)).tolist()
    [1.0, 0.0, 1.0]
    """
    checks = scores[:, list(necessary)]
    return (~(checks < 1.0)).all(axis=1).astype(float)


def refit_verdict(report: dict, previous: dict | None, min_weight: float = 1e-3) -> str | None:
    """Why a refit should be rejected (None: accept it). See the module docstring.

    >>> refit_verdict({"weights": [0.0, -0.0]}, None)
    'flat fit: every weight is 0'
    >>> refit_verdict({"weights": [1.0, -0.5]}, {"weights": [0.8, 0.4]}) is None
    True
    >>> refit_verdict({"weights": [-1.0, 0.1]}, {"weights": [0.8, 0.4]})
    'direction flipped: cosine -0.85 with the weights in use'
    """
    w = np.asarray(report["weights"], dtype=float)
    if np.abs(w).max() < min_weight:
        return "flat fit: every weight is 0"
    if previous is None:
        return None
    w0 = np.asarray(previous["weights"], dtype=float)
    cos = float(w @ w0 / max(np.linalg.norm(w) * np.linalg.norm(w0), 1e-12))
    return None if cos > 0 else f"direction flipped: cosine {cos:.2f} with the weights in use"


def report_metrics(report: dict) -> dict[str, float]:
    """Namespaced scalars from an ensemble report, for metrics.jsonl."""
    m = {
        "ensemble/accepted": float(report.get("accepted", True)),
        "ensemble/class_balance": float(report["class_balance"]),
        "ensemble/dependent_groups": float(len(report["dependent_groups"])),
    }
    for name, w, auc in zip(report["names"], report["weights"], report["est_auroc"], strict=True):
        m[f"ensemble/{name}/weight"] = float(w)
        m[f"ensemble/{name}/est_auroc"] = float(auc)
    return m
