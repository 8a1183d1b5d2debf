"""How good are the weak verifiers, and their aggregates, on a real policy's samples? Hidden labels, one run.

Samples B prompts x G completions from SmolLM2-135M-Instruct (the `smollm2-arith-unlabeled` preset's prompts and
sampling settings), scores them with the preset's verifiers, and reports, against the true answers (which no
verifier sees): each verifier's AUROC over all samples and within a prompt's group (the part GRPO's advantages
use), then the same for the rewards of the mean, majority vote and the label-free ensembles fit on these samples.

Usage: python bench/label_free_signals.py [--prompts 32] [--group 8] [--seed 0] [--verifiers a,b,...]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from label_free_rl import true_sum  # bench/ is on sys.path when this file runs as a script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PRESET = "smollm2-arith-unlabeled"


def auroc(scores: np.ndarray, truth: np.ndarray) -> float:
    """P(a right sample scores above a wrong one), ties counting half (Mann-Whitney); NaN scores left out."""
    ok = ~np.isnan(scores)
    pos, neg = scores[ok & (truth == 1)], scores[ok & (truth == 0)]
    if not len(pos) or not len(neg):
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0) + 0.5 * (diff == 0)).mean())


def within_group_auroc(scores: np.ndarray, truth: np.ndarray, group: int) -> float:
    """Mean AUROC over the groups that hold both right and wrong samples."""
    values = [auroc(scores[i : i + group], truth[i : i + group]) for i in range(0, len(truth), group)]
    values = [v for v in values if not np.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


def sample(cfg, prompts: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """(model inputs, completions, reference answers) for `prompts` training-file prompts x G samples."""
    from forge.models import format_prompt_fn, load_policy
    from forge.rollout.base import SamplingParams
    from forge.rollout.hf import HFBackend
    from forge.tasks.arith import TRAIN_FILE

    rows = [json.loads(line) for line in TRAIN_FILE.read_text().splitlines()[:prompts]]
    model, tok = load_policy(cfg.model, seed=seed)
    model.eval()
    fmt = format_prompt_fn(tok, cfg.model)
    torch.manual_seed(seed)
    r, g = cfg.rollout, cfg.rollout.group_size
    out = HFBackend(model, tok, batch_size=r.batch_size).generate(
        [fmt(row["prompt"]) for row in rows], SamplingParams(r.max_new_tokens, r.temperature, r.top_p, n=g)
    )
    answers = [true_sum(row["prompt"]) for row in rows for _ in range(g)]
    return [row["prompt"] for row in rows for _ in range(g)], out.texts, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verifiers", default="", help="comma-separated; default: the preset's")
    args = ap.parse_args()
    from forge.presets import get_preset
    from forge.rewards.aggregate import majority_rewards, mean_scores
    from forge.rewards.ensemble import EnsembleConfig, WeakVerifierEnsemble
    from forge.rewards.latent_class import LatentClassConfig, LatentClassEnsemble
    from forge.rewards.registry import resolve_verifiers
    from forge.rewards.score import score_completions
    from forge.rewards.verifiers import math_answer

    cfg = get_preset(PRESET)
    cfg.rollout.group_size = args.group
    specs = args.verifiers.split(",") if args.verifiers else cfg.reward.verifiers
    t0 = time.perf_counter()
    prompts, texts, answers = sample(cfg, args.prompts, args.seed)
    truth = np.array(math_answer(prompts, texts, answer=answers), dtype=float)  # [N] hidden labels
    res = score_completions(resolve_verifiers(specs, cfg.reward), None, prompts, texts, {})
    scores = res.scores.double().numpy()  # [N, V]
    print(f"{len(texts)} samples ({args.prompts} prompts x {args.group}) in {time.perf_counter() - t0:.0f} s; "
          f"{truth.mean():.1%} right")  # fmt: skip
    print(f"{'signal':<40}{'AUROC':>8}{'within group':>14}")
    for v, name in enumerate(res.names):
        print(
            f"{name:<40}{auroc(scores[:, v], truth):>8.3f}{within_group_auroc(scores[:, v], truth, args.group):>14.3f}"
        )
    groups = np.arange(len(texts)) // args.group
    rewards = {
        "mean": mean_scores(res.scores).numpy(),
        "majority vote": majority_rewards(texts, args.group).numpy(),
    }
    for k in (2, 3):
        gauss = WeakVerifierEnsemble(EnsembleConfig(classes=k, seed=args.seed)).fit(scores, groups, names=res.names)
        rewards[f"gaussian ensemble, {k} classes"] = gauss.predict_proba(scores, groups)
        lc = LatentClassEnsemble(LatentClassConfig(classes=k, seed=args.seed)).fit(scores, groups, names=res.names)
        rewards[f"latent class ensemble, {k} classes"] = lc.predict_proba(scores, groups)
    for name, r in rewards.items():
        print(f"{name:<40}{auroc(r, truth):>8.3f}{within_group_auroc(r, truth, args.group):>14.3f}")


if __name__ == "__main__":
    main()
