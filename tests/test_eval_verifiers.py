"""eval.verifiers: which verifiers decide pass@1/pass@k, the all-score-1.0 rule, the old eval.check key."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from forge.config import ConfigError, EvalConfig, RewardConfig, RolloutConfig, RunConfig, apply_overrides, from_dict
from forge.evaluate import eval_verifier_specs, evaluate
from forge.presets import PRESETS
from forge.records import Rollouts


def _specs(reward_verifiers: list[str], **eval_fields) -> list[str]:
    return eval_verifier_specs(EvalConfig(**eval_fields), RewardConfig(verifiers=reward_verifiers))


@pytest.mark.parametrize(
    "reward_verifiers, expected",
    [
        (["math_answer", "format_integer"], ["math_answer"]),  # format scores form, not correctness
        (["format_tags", "code_exec"], ["code_exec"]),
        (["code_exec", "math_answer"], ["code_exec", "math_answer"]),
        # TRL-style user rewards: the accuracy one decides, format/length ones do not
        (["m.r:accuracy_reward", "m.r:format_reward", "m.r:len_reward", "m.r:length_penalty"], ["m.r:accuracy_reward"]),
        (["math_answer", "m.r:accuracy_reward"], ["math_answer"]),  # a built-in correctness check comes first
        # label-free checks, reward models and judges never decide: math_answer against the reference does
        (["parity_check", "residue3_check", "group_agreement"], ["math_answer"]),
        (["reward_model=/models/rm", "llm_judge=/models/judge"], ["math_answer"]),
        (["format_tags"], ["math_answer"]),
    ],
)
def test_default_eval_verifiers_are_the_runs_correctness_verifiers(reward_verifiers, expected):
    assert _specs(reward_verifiers) == expected


def test_explicit_eval_verifiers_and_the_old_check_key():
    assert _specs(["math_answer"], verifiers=["format_tags", "math_answer"]) == ["format_tags", "math_answer"]
    assert apply_overrides(RunConfig(), ["eval.check=code_exec"]).eval.verifiers == ["code_exec"]
    # a config.yaml written before eval.verifiers holds check: math_answer (the old default): eval is unchanged
    old = from_dict({"reward": {"verifiers": ["code_exec"]}, "eval": {"verifiers": [], "check": "math_answer"}})
    assert eval_verifier_specs(old.eval, old.reward) == ["math_answer"]
    assert from_dict({"eval": {"check": ""}}).eval.verifiers == []  # an empty check chose nothing


def test_check_and_verifiers_together_or_a_duplicate_are_config_errors():
    with pytest.raises(ConfigError, match="eval.check.*old form of eval.verifiers.*set only one"):
        apply_overrides(RunConfig(), ["eval.verifiers=[code_exec]", "eval.check=math_answer"])
    with pytest.raises(ConfigError, match="eval.check.*old form of eval.verifiers.*set only one"):
        from_dict({"eval": {"check": "math_answer", "verifiers": ["code_exec"]}})
    with pytest.raises(ConfigError, match="eval.verifiers.*twice"):
        apply_overrides(RunConfig(), ["eval.verifiers=[math_answer, math_answer]"]).validate()


def test_presets_keep_their_eval_verifiers():
    picked = {name: eval_verifier_specs(p().eval, p().reward) for name, p in PRESETS.items()}
    assert picked == {
        "tiny": ["math_answer"],
        "tiny-unlabeled": ["math_answer"],  # scored against the answers the reward never saw
        "tiny-code": ["code_exec"],
        "tiny-multiturn": ["math_answer"],  # the episode's final number against the answer
        "smollm2-arith": ["math_answer"],
        "smollm2-arith-lora": ["math_answer"],
        "smollm2-arith-unlabeled": ["math_answer"],
        "smollm2-code": ["code_exec"],
        "smollm2-multiturn": ["math_answer"],  # each turn's number against the answer (first / final turn)
    }


class _ScriptedBackend:
    """Returns fixed completions: greedy = `greedy[i]` per prompt, sampled = `sampled[i]` (k per prompt)."""

    def __init__(self, greedy: list[str], sampled: list[list[str]]):
        self.greedy, self.sampled = greedy, sampled

    def generate(self, prompts, params):
        texts = self.greedy if params.temperature == 0.0 else [t for ts in self.sampled for t in ts]
        n = len(texts)
        return Rollouts(
            prompt_ids=torch.zeros(n, 1, dtype=torch.long),
            prompt_mask=torch.ones(n, 1, dtype=torch.long),
            completion_ids=torch.zeros(n, 2, dtype=torch.long),
            completion_mask=torch.ones(n, 2, dtype=torch.long),
            sampling_logprobs=torch.zeros(n, 2),
            texts=list(texts),
            finish_reasons=["stop"] * n,
            group_size=params.n,
            policy_version=3,
            prompts=[p for p in prompts for _ in range(params.n)],
        )


@pytest.fixture
def user_rewards(monkeypatch):
    """A TRL-style module: accuracy on the answer column, a format reward, one that always raises."""
    mod = types.ModuleType("trl_style_rewards")

    def accuracy_reward(completions, answer, **kwargs):
        return [1.0 if c.strip().endswith(str(a)) else 0.0 for c, a in zip(completions, answer, strict=True)]

    def format_reward(completions, **kwargs):
        return [1.0 if c.startswith("<think>") else 0.0 for c in completions]

    def broken_reward(completions, **kwargs):
        raise KeyError("score")

    mod.accuracy_reward, mod.format_reward, mod.broken_reward = accuracy_reward, format_reward, broken_reward
    monkeypatch.setitem(sys.modules, "trl_style_rewards", mod)
    return mod


ROWS = [{"prompt": f"q{i}", "model_input": f"q{i}", "answer": str(a)} for i, a in enumerate([4, 7, 9])]
GREEDY = ["<think>x</think> 4", "it is 7", "<think>x</think> 8"]  # right, right without format, wrong
SAMPLED = [["1", "2"], ["3", "4"], ["9", "0"]]  # problem 0 and 1 miss in both samples, problem 2 hits once


def test_user_accuracy_reward_decides_pass_at_1_and_k_and_the_report_names_it(user_rewards):
    reward = RewardConfig(verifiers=["trl_style_rewards:accuracy_reward", "trl_style_rewards:format_reward"])
    report = evaluate(_ScriptedBackend(GREEDY, SAMPLED), ROWS, EvalConfig(k=2), RolloutConfig(), reward=reward)
    assert report["verifiers"] == ["accuracy_reward"]
    assert report["pass@1"] == pytest.approx(2 / 3) and report["pass@2"] == pytest.approx(1 / 3)
    assert [s["correct"] for s in report["samples"]] == [True, True, False]
    assert "verifier_errors" not in report


def test_every_listed_verifier_must_score_one(user_rewards):
    ev = EvalConfig(k=0, verifiers=["trl_style_rewards:accuracy_reward", "trl_style_rewards:format_reward"])
    report = evaluate(_ScriptedBackend(GREEDY, SAMPLED), ROWS, ev, RolloutConfig())
    # only the first completion is both right and well formatted
    assert report["verifiers"] == ["accuracy_reward", "format_reward"] and report["pass@1"] == pytest.approx(1 / 3)


def test_a_verifier_that_raises_counts_as_not_correct_and_its_error_is_reported(user_rewards):
    ev = EvalConfig(k=0, verifiers=["math_answer", "trl_style_rewards:broken_reward"])
    report = evaluate(_ScriptedBackend(GREEDY, SAMPLED), ROWS, ev, RolloutConfig())
    assert report["pass@1"] == 0.0 and "KeyError" in report["verifier_errors"]["broken_reward"]


def test_math_answer_by_default_uses_the_runs_own_instance_and_math_verify():
    calls = []

    def math_answer(prompts, completions, answer, **kwargs):  # the run's resolved instance, reused by name
        calls.append(len(completions))
        return [1.0] * len(completions)

    rows = [{"prompt": "q", "model_input": "q", "answer": r"\frac{1}{2}"}]
    backend = _ScriptedBackend([r"so \boxed{0.5}"], [[r"\boxed{2}", r"\boxed{\tfrac12}"]])
    report = evaluate(backend, rows, EvalConfig(k=2), RolloutConfig())
    assert report["pass@1"] == 1.0 and report["pass@2"] == 1.0 and report["verifiers"] == ["math_answer"]
    report = evaluate(backend, rows, EvalConfig(k=2), RolloutConfig(), verifiers=[("math_answer", math_answer)])
    assert calls == [1, 1, 2]  # greedy (correctness), greedy again (mean_reward), sampled (pass@k)
