"""Reward aggregation with the label-free ensemble over a rolling window of recent scored rollouts.

With `reward.aggregate: ensemble` the reward of a completion is P(correct | its verifier scores), from a
`WeakVerifierEnsemble` refit every `reward.refit_every` steps on the last `reward.window_steps` steps' score
matrices (the current one included). The window is part of the checkpoint, so a resumed run refits on the same
data. No reference answer is read here.
"""

from __future__ import annotations

import numpy as np
import torch

from forge.rewards.ensemble import WeakVerifierEnsemble


class EnsembleAggregator:
    def __init__(self, names: list[str], window_steps: int, refit_every: int, seed: int = 0):
        self.names = names
        self.window_steps = window_steps
        self.refit_every = refit_every
        self.seed = seed
        self.window: list[tuple[np.ndarray, np.ndarray]] = []  # per step: scores [N, V], groups [N]
        self.ensemble: WeakVerifierEnsemble | None = None
        self.refits = 0

    def __call__(self, scores: torch.Tensor, group_size: int, step: int) -> tuple[torch.Tensor, dict | None]:
        """scores [N, V] (NaN = missing) -> (rewards [N], the ensemble report when it was refit this step)."""
        s = scores.double().numpy()
        groups = step * 1_000_000 + np.arange(len(s)) // group_size  # unique prompt ids across the window
        self.window = [*self.window, (s, groups)][-self.window_steps :]
        report = None
        if self.ensemble is None or step % self.refit_every == 0:
            from forge.rewards.ensemble import EnsembleConfig

            self.ensemble = WeakVerifierEnsemble(EnsembleConfig(seed=self.seed)).fit(
                np.concatenate([w[0] for w in self.window]),
                np.concatenate([w[1] for w in self.window]),
                names=self.names,
            )
            self.refits += 1
            report = self.ensemble.report()
        p = self.ensemble.predict_proba(s, groups)  # [N]
        return torch.as_tensor(p, dtype=torch.float32), report

    def state_dict(self) -> dict:
        return {"window": self.window, "refits": self.refits}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.refits = state["window"], state["refits"]
        self.ensemble = None  # refit on the restored window at the next step


def report_metrics(report: dict) -> dict[str, float]:
    """Namespaced scalars from an ensemble report, for metrics.jsonl."""
    m = {
        "ensemble/class_balance": float(report["class_balance"]),
        "ensemble/dependent_groups": float(len(report["dependent_groups"])),
    }
    for name, w, auc in zip(report["names"], report["weights"], report["est_auroc"], strict=True):
        m[f"ensemble/{name}/weight"] = float(w)
        m[f"ensemble/{name}/est_auroc"] = float(auc)
    return m
