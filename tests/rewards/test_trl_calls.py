"""Reward calls in TRL's convention (issue 13, part 2): what a verifier receives, for string and chat prompts,
from `score_completions` and from the reward stage (`RewardWorker`) on a prepared run's typed rows."""

from __future__ import annotations

import json

import torch

from forge.compose import data_sources, reward_worker
from forge.config import RunConfig
from forge.data import prepare, read_split
from forge.records import Rollouts
from forge.rewards.registry import provided
from forge.rewards.score import score_completions
from forge.rewards.verifiers import math_answer

CHAT = [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+2="}]]


def recorder(calls: list):
    def seen(prompts, completions, **kwargs):
        calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return [1.0] * len(completions)

    return seen


def test_chat_prompts_give_message_completions_and_builtins_keep_text():
    calls = []
    res = score_completions(
        [("seen", recorder(calls)), ("math_answer", math_answer)],
        None,
        ["<t>1+1=", "<t>2+2="],  # what the model saw
        ["2", "5"],
        {"answer": ["2", "4"], "n": [1, 2]},
        raw_prompts=CHAT,
        completion_ids=[[7], [8, 9]],
        trainer_state={"global_step": 4},
    )
    (call,) = calls
    assert call["prompts"] == CHAT
    assert call["completions"] == [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "5"}]]
    assert call["completion_ids"] == [[7], [8, 9]] and call["trainer_state"] == {"global_step": 4}
    assert call["n"] == [1, 2]
    assert res.scores[:, 1].tolist() == [1.0, 0.0]  # math_answer got the text
    assert res.errors == {} and res.errored == {"seen": 0, "math_answer": 0}


def test_string_prompts_give_string_completions_and_the_item_retry_keeps_fixed_arguments():
    calls = []

    def picky(prompts, completions, completion_ids, trainer_state, **kwargs):
        calls.append((completions, completion_ids, trainer_state))
        if len(completions) > 1:
            raise RuntimeError("batch refused")
        return [float(len(completion_ids[0]))]

    res = score_completions([("picky", picky)], None, ["a", "b"], ["x", "y"], {}, raw_prompts=["A", "B"],
                            completion_ids=[[1], [1, 2]], trainer_state="state")  # fmt: skip
    assert res.scores[:, 0].tolist() == [1.0, 2.0]  # per item: one completion_ids list each
    assert calls[1:] == [(["x"], [[1]], "state"), (["y"], [[1, 2]], "state")]
    assert res.errors == {"picky": "RuntimeError('batch refused')"} and res.errored == {"picky": 0}


def test_errors_are_counted_per_item_and_none_is_not_an_error():
    def conversational(prompts, completions, **kwargs):
        return [1.0 if c[0]["content"] == "4" else 0.0 for c in completions]  # TRL-style, given strings

    def declines(prompts, completions, **kwargs):
        return [None, 0.5]

    res = score_completions([("conversational", conversational), ("declines", declines)], None, ["p", "q"],
                            ["4", "5"], {})  # fmt: skip
    assert res.errored == {"conversational": 2, "declines": 0} and res.failures == {"conversational": 2, "declines": 1}
    assert res.errors["conversational"].startswith("TypeError(") and "declines" not in res.errors


def fake_rollouts(n_prompts: int, g: int, texts: list[str]) -> Rollouts:
    n = n_prompts * g
    ids = torch.tensor([[5, 6, 0]] * n)  # [N, T]; the last token is padding
    mask = torch.tensor([[1, 1, 0]] * n)
    return Rollouts(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long), ids, mask,
                    torch.zeros(n, 3), texts, ["stop"] * n, g, 0, ["model input"] * n)  # fmt: skip


def test_reward_stage_passes_typed_columns_raw_prompts_and_trainer_state(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "target": i + 1, "x": i / 2, "tags": ["t", str(i)],
         "meta": {"k": i}, "flag": i % 2 == 0}
        for i in range(6)
    ]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig(steps=10)
    cfg.data.source, cfg.data.answer_column, cfg.data.eval_size = str(tmp_path / "d.jsonl"), "target", 2
    cfg.rollout.prompts_per_step = 2
    fmt = lambda p: "".join(m["content"] for m in p)  # noqa: E731
    prepare(data_sources(cfg), tmp_path / "run", fmt, lambda s: len(s))
    train = read_split(tmp_path / "run", "train")
    calls = []
    spec = "tests.rewards:seen"
    cfg.reward.verifiers = cfg.reward.callables = [spec]
    with provided({spec: recorder(calls)}):
        worker = reward_worker(cfg, train_rows=len(train))
        worker.score(train[:2], fake_rollouts(2, 2, ["2", "3", "4", "5"]), step=3)
        cfg.reward.label_free = True
        worker.score(train[:2], fake_rollouts(2, 2, ["2", "3", "4", "5"]), step=4)
    call, hidden = calls
    first = train[0]
    assert call["prompts"] == [first["prompt"]] * 2 + [train[1]["prompt"]] * 2  # the data's messages, G times
    assert call["completions"][0] == [{"role": "assistant", "content": "2"}]
    assert call["completion_ids"] == [[5, 6]] * 4  # padding dropped
    for column, kind in (("target", int), ("x", float), ("tags", list), ("meta", dict), ("flag", bool)):
        assert call[column][0] == first[column] and type(call[column][0]) is kind, column
    assert call["answer"][0] == str(first["target"])
    state = call["trainer_state"]
    # step 3 is scored after 2 updates; 2 updates x 2 prompts drawn of 4 training rows = epoch 1.0
    assert (state.global_step, state.max_steps, state.epoch) == (2, 10, 1.0)
    assert "answer" not in hidden and "target" not in hidden and hidden["tags"] == call["tags"]  # label_free
    assert hidden["trainer_state"].epoch == 1.5  # 3 updates x 2 prompts / 4 rows


def test_eval_mean_reward_calls_the_reward_verifiers_without_hidden_columns():
    """Evaluation runs the reward verifiers for `mean_reward`: under label_free they get what the reward stage gives
    them (no answer columns); the eval verifiers that decide pass@1 still score against the answers."""
    from forge.config import EvalConfig, RolloutConfig
    from forge.evaluate import evaluate
    from tests.test_eval_verifiers import _ScriptedBackend

    rows = [{"id": "a", "prompt": "1+1=", "model_input": "1+1=", "answer": "2", "target": 2, "n": 5}]
    calls = []
    report = evaluate(_ScriptedBackend(["2"], []), rows, EvalConfig(k=0), RolloutConfig(),
                      verifiers=[("seen", recorder(calls))], hidden=("answer", "target"))  # fmt: skip
    (call,) = calls
    assert "answer" not in call and "target" not in call and call["n"] == [5] and call["id"] == ["a"]
    assert report["pass@1"] == 1.0 and report["verifiers"] == ["math_answer"] and report["mean_reward"] == 1.0
