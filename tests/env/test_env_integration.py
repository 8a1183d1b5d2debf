"""The episode loop on the real hf backend (sampled tokens and their log-probs kept as sampled, the trainer's
log-probs agree at every sampled position, also after a tool turn), the env config's rules, env_reward by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forge.compose import environment
from forge.config import EnvConfig, RunConfig
from forge.env.chat import ChatFormat
from forge.env.episode import TURN_SEED_STRIDE, run_episodes
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

    def sample(contexts, params, seeds=None):  # turn 1 forced to a tool call, later turns the model's own
        first = [c for c in contexts if tok.eos_token_id not in c]
        if first:
            return [(call, [-1.0] * len(call)) for _ in contexts]
        return backend.generate_ids(contexts, params, seeds)

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


def test_env_validates_with_every_backend_and_execution_mode():
    cfg = RunConfig()
    cfg.env.environment_factory = "tests.env.test_episode:CounterEnv"
    cfg.rollout.backend, cfg.rollout.replicas, cfg.orchestration.execution = "vllm", 2, "ray"
    cfg.algo.max_staleness, cfg.model.lora.rank = 1, 4
    cfg.validate()


def test_an_episode_samples_what_one_call_would_whichever_episodes_share_its_call(tok):
    """A step split between two replicas (the second half labelled first_row=2n, each replica's stream in the same
    state, as the Ray adapter sends them) plays the episodes one call plays: each episode's turn draws from a seed of
    its own, turn 2 from its turn-1 seed + TURN_SEED_STRIDE; a seeded step likewise (the second half's seed shifted)."""
    model = build_tiny_model(tok, hidden=32, layers=1, seed=0)
    backend = HFBackend(model, tok, batch_size=8)
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seen = []

    def sample(contexts, params, seeds):  # turn 1 forced to a tool call, turn 2 the model's own
        seen.append(seeds)
        if not any(tok.eos_token_id in c for c in contexts):
            return [(call, [-1.0] * len(call)) for _ in contexts]
        return backend.generate_ids(contexts, params, seeds)

    rows = [{"prompt": f"{a}+4=", "model_input": f"{a}+4=", "answer": str(a + 4)} for a in (1, 22, 3, 456)]
    env = EnvConfig(max_turns=3, max_tokens=200)

    def play(rows, params):
        torch.manual_seed(7)  # the rollout worker's stream: in the same state on every replica
        ro = run_episodes(sample, tok, rows, params, env, ChatFormat(tok, False), CounterEnv, [], version=0)
        return ro.texts, [lp[m.bool()].tolist() for lp, m in zip(ro.sampling_logprobs, ro.loss_mask, strict=True)]

    for params, second in [(SamplingParams(max_new_tokens=6, n=2), {"first_row": 4}),
                           (SamplingParams(max_new_tokens=6, n=2, seed=11), {"first_row": 4, "seed": 15})]:  # fmt: skip
        seen.clear()
        whole = play(rows, params)
        assert len(seen) == 2 and seen[1] == [s + TURN_SEED_STRIDE for s in seen[0]]
        halves = [play(rows[:2], params), play(rows[2:], dataclasses.replace(params, **second))]
        assert whole[0] == halves[0][0] + halves[1][0]
        for a, b in zip(whole[1], halves[0][1] + halves[1][1], strict=True):
            assert a == pytest.approx(b, abs=1e-5)
    assert len(set(whole[0])) > 2  # the episodes did not all sample the same turn


def test_load_environment_names_what_is_wrong(tok):
    cfg = RunConfig()
    cfg.env.environment_factory = "tests.env.test_episode:NoSuchEnv"
    with pytest.raises(UserError, match="has no attribute 'NoSuchEnv'"):
        environment(cfg, tok)
    cfg.env.environment_factory, cfg.env.tools = "", ["tests.env.test_episode:scripted"]  # no Args section
    with pytest.raises(UserError, match="tool scripted"):
        environment(cfg, tok)


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
    backend = EpisodeBackend(HFBackend(model, tok), tok, rows, cfg.env, environment(cfg, tok))
    seen = []

    def env_check(prompts, completions, environments=None, **kwargs):
        seen.append([type(e).__name__ for e in environments])
        return [1.0] * len(completions)

    cfg.eval.k, cfg.rollout.max_new_tokens = 2, 3
    report = evaluate(backend, rows, cfg.eval, cfg.rollout, [("env_check", env_check)], seed=1)
    assert report["verifiers"] == ["math_answer"]  # pass@1 by the default judge, on the whole episode's text
    assert report["mean_reward"] == 1.0 and seen == [["CounterEnv"] * 3]
    assert report["pass@2"] >= 0 and report["problems"] == 3


def test_lora_with_episodes_trains_the_adapter_only(tmp_path):
    """model.lora.rank > 0 with the tiny-multiturn preset in-process: the episodes are sampled by the peft module
    itself (adapter on), the update moves the adapter (B starts at 0) and no base weight, and the checkpoint holds
    the adapter alone."""
    from forge.checkpoint import ADAPTER, WEIGHTS, shard_keys
    from forge.compose import local_stages
    from forge.presets import tiny_multiturn
    from forge.recipes.grpo import run
    from forge.tracking import read_metrics

    cfg = tiny_multiturn()
    cfg.steps, cfg.eval.every, cfg.checkpoint.every, cfg.tracking.mlflow = 2, 0, 2, False
    cfg.data.train_size, cfg.eval.max_problems, cfg.rollout.max_new_tokens = 100, 5, 3
    cfg.reward.verifiers = ["tests.env.graded:reward_func"]  # a signal from step 1 (0.25 for a digit)
    cfg.model.lora.rank, cfg.update.lr = 4, 1e-2
    made, frozen = [], {}

    def stages(*args):
        made.append(local_stages(*args))
        model = made[-1].trainer.trainer.unwrapped
        frozen.update({n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad})
        return made[-1]

    run(cfg, tmp_path / "run", progress=False, stages=stages)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert len(rows) == 2 and all(r["env/turns"] >= 1 and r["train/grad_norm"] > 0 for r in rows)
    params = dict(made[0].trainer.trainer.unwrapped.named_parameters())
    assert frozen and all(torch.equal(params[n], p) for n, p in frozen.items())
    assert {n for n, p in params.items() if p.requires_grad} == {n for n in params if ".lora_" in n}
    assert any(float(p.abs().sum()) > 0 for n, p in params.items() if "lora_B" in n)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (ckpt / ADAPTER).is_file() and not (ckpt / WEIGHTS).exists()
    assert all(".lora_" in k for k in shard_keys(ckpt))


def test_evaluation_reports_first_and_final_turn_success(tok):
    from forge.evaluate import evaluate
    from forge.metrics import eval_metrics
    from tests.env.test_episode import FeedbackEnv, replies

    class Episodes:  # each episode replies 1, 2, 3 until FeedbackEnv says it is right
        def generate(self, prompts, params):
            rows = [r for r in data if r["model_input"] in prompts]
            return run_episodes(replies(tok, ["1", "2", "3"]), tok, rows, params, EnvConfig(max_turns=3, max_tokens=99),
                                ChatFormat(tok, use_template=False), FeedbackEnv, [], version=0)  # fmt: skip

    data = [{"prompt": f"q{a}", "model_input": f"q{a}", "answer": a} for a in ("1", "2", "9")]
    cfg = RunConfig()
    cfg.eval.k = 0
    report = evaluate(Episodes(), data, cfg.eval, cfg.rollout)
    # right at turn 1 / at turn 2 / never in 3 turns: first 1 of 3, final 2 of 3, turns (1 + 2 + 3) / 3
    assert (report["first_turn@1"], report["final_turn@1"], report["mean_turns"]) == (1 / 3, 2 / 3, 2.0)
    assert eval_metrics(report)["eval/first_turn@1"] == 1 / 3 and "eval/mean_turns" not in eval_metrics(report)


def test_evaluation_plays_each_rows_own_environment_when_every_prompt_is_the_same(tok):
    """Games give every row one instruction and tell the instances apart by the other columns (`reset(**row)`).
    Each episode replies 1, 2, 3 until FeedbackEnv says it is right; the targets 1, 9, 2 and 3 are reached by rows
    0, 2 and 3 within 3 turns (env_reward 1, 0, 1, 1: pass@1 0.75). Rows keyed by prompt text played row 3's
    environment four times (pass@1 1.0), the defect issue 44 measured."""
    from forge.env.episode import EpisodeBackend
    from forge.evaluate import evaluate
    from tests.env.test_episode import FeedbackEnv, replies

    class Sampler:  # the rollout backend's part that episodes use
        policy_version = 0
        generate_ids = staticmethod(replies(tok, ["1", "2", "3"]))

    rows = [{"prompt": "Guess the number", "model_input": "Guess the number", "answer": a} for a in "1923"]
    cfg = RunConfig()
    cfg.env.max_turns, cfg.eval.k, cfg.eval.verifiers = 3, 2, ["env_reward"]
    env = (FeedbackEnv, [], ChatFormat(tok, use_template=False))
    report = evaluate(EpisodeBackend(Sampler(), tok, rows, cfg.env, env), rows, cfg.eval, cfg.rollout, seed=1)
    assert report["pass@1"] == 0.75 and report["pass@2"] == 0.75
    assert [s["answer"] for s in report["samples"] if s["correct"]] == ["1", "2", "3"]
