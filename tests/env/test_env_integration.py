"""The episode loop on the real hf backend (sampled tokens and their log-probs kept as sampled, the trainer's
log-probs agree at every sampled position, also after a tool turn), the env config's rules, env_reward by name."""

from __future__ import annotations

import pytest
import torch

from forge.config import ConfigError, EnvConfig, RunConfig
from forge.env.chat import ChatFormat
from forge.env.episode import load_environment, run_episodes
from forge.errors import UserError
from forge.models import build_tiny_model
from forge.rewards.registry import resolve_verifier
from forge.rollout.base import SamplingParams
from forge.rollout.hf import HFBackend
from forge.trainer import token_logprobs
from tests.env.test_episode import CALL, CounterEnv

torch.set_num_threads(1)


def test_the_trainer_sees_the_log_probs_the_sampler_recorded_after_a_tool_turn(tok):
    model = build_tiny_model(tok, hidden=32, layers=1, seed=0)
    backend = HFBackend(model, tok, batch_size=8)
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def sample(contexts, params):  # turn 1 forced to a tool call, later turns the model's own
        first = [c for c in contexts if tok.eos_token_id not in c]
        if first:
            return [(call, [-1.0] * len(call)) for _ in contexts]
        return backend.generate_ids(contexts, params)

    rows = [{"prompt": "1+2=", "model_input": "1+2=", "answer": "3"}, {"prompt": "4+4=", "model_input": "4+4=",
                                                                       "answer": "8"}]  # fmt: skip
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3)
    ro = run_episodes(sample, tok, rows, params, EnvConfig(max_turns=3, max_tokens=200), ChatFormat(tok, False),
                      CounterEnv, [], version=0)  # fmt: skip
    assert ro.episodes.turns == [2, 2, 2, 2] and ro.episodes.tool_calls == [1, 1, 1, 1]
    logp = token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask).logp
    second = ro.loss_mask.bool().clone()
    second[:, : len(call)] = False  # the model's own turn, after the tool answer
    assert second.sum() > 0
    assert torch.allclose(logp[second], ro.sampling_logprobs[second], atol=1e-4)
    assert torch.all(ro.sampling_logprobs[~ro.loss_mask.bool()] == 0)


def test_env_runs_only_where_it_is_built_for(tok):
    cfg = RunConfig()
    cfg.env.environment_factory = "tests.env.test_episode:CounterEnv"
    cfg.validate()
    cfg.rollout.backend = "vllm"
    with pytest.raises(ConfigError, match="env.environment_factory"):
        cfg.validate()


def test_load_environment_names_what_is_wrong(tok):
    cfg = RunConfig()
    cfg.env.environment_factory = "tests.env.test_episode:NoSuchEnv"
    with pytest.raises(UserError, match="has no attribute 'NoSuchEnv'"):
        load_environment(cfg, tok)
    cfg.env.environment_factory, cfg.env.tools = "", ["tests.env.test_episode:scripted"]  # no Args section
    with pytest.raises(UserError, match="tool scripted"):
        load_environment(cfg, tok)


def test_env_reward_is_a_builtin_verifier():
    name, fn = resolve_verifier("env_reward")
    env = CounterEnv()
    env.reward = 1.0
    assert name == "env_reward" and fn(prompts=["q"], completions=["a"], environments=[env]) == [1.0]


class NoReset:
    def check(self, guess: int) -> str:
        """Check.

        Args:
            guess: a guess
        """
        return "wrong"


def undocumented_tool(x: int) -> int:
    return x


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"environment_factory": NoReset}, "environment .*NoReset has no reset method"),
        ({"tools": [undocumented_tool]}, "tool .*undocumented_tool.*docstring"),
    ],  # fmt: skip
)
def test_forge_train_refuses_a_bad_environment_or_tool_in_one_line(tmp_path, kwargs, message):
    import forge

    sets = ["steps=1", "tracking.mlflow=false", "data.train_size=50", "data.eval_size=5"]
    with pytest.raises(UserError, match=message) as err:
        forge.train(preset="tiny-multiturn", overrides=sets, run_dir=tmp_path / "run", progress=False, **kwargs)
    assert "\n" not in str(err.value)


def test_evaluation_plays_episodes_and_hands_verifiers_their_environments(tok):
    from forge.env.episode import EpisodeBackend
    from forge.evaluate import evaluate

    model = build_tiny_model(tok, hidden=32, layers=1, seed=0)
    cfg = RunConfig()
    cfg.env.environment_factory = "tests.env.test_episode:CounterEnv"
    rows = [{"prompt": f"{a}+1=", "model_input": f"{a}+1=", "answer": str(a + 1)} for a in range(3)]
    backend = EpisodeBackend(HFBackend(model, tok), tok, rows, cfg.env, load_environment(cfg, tok))
    seen = []

    def env_check(prompts, completions, environments=None, **kwargs):
        seen.append([type(e).__name__ for e in environments])
        return [1.0] * len(completions)

    cfg.eval.k, cfg.rollout.max_new_tokens = 2, 3
    report = evaluate(backend, rows, cfg.eval, cfg.rollout, [("env_check", env_check)], seed=1)
    assert report["verifiers"] == ["math_answer"]  # pass@1 by the default judge, on the whole episode's text
    assert report["mean_reward"] == 1.0 and seen == [["CounterEnv"] * 3]
    assert report["pass@2"] >= 0 and report["problems"] == 3
