"""samples.jsonl's token record (forge.rundir.append_samples, issue 44): each sample's tokens after the prompt as the
rollout holds them (ids, loss mask, sampling log-probs; per-token advantages where the step has them), each token's
text, and per sample its group's zero-std flag, the policy version that sampled it and its staleness. The tracker's
rows leave the tokens out; a line without them is what older runs wrote."""

import json

import pytest
import torch

from forge.records import Rollouts, ScoredBatch
from forge.rundir import append_samples
from tests.episode_samples import TURNS, token_text, tool_episodes


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_a_tool_episodes_tokens_are_the_rollouts(tmp_path):
    rows, ro, batch, tok = tool_episodes(version=2)
    returned = append_samples(tmp_path, 3, rows, ro, batch, trainer_version=3, token_text=token_text(tok))
    written = _lines(tmp_path)
    assert len(written) == 2 and all("tokens" not in r for r in returned)  # the tracker's table stays as it was
    assert [{k: v for k, v in w.items() if k != "tokens"} for w in written] == returned
    for i, line in enumerate(written):
        t, real = line["tokens"], ro.completion_mask[i].bool()
        assert t["ids"] == ro.completion_ids[i][real].tolist()
        assert t["loss"] == ro.loss_mask[i][real].tolist()
        assert t["logprob"] == ro.sampling_logprobs[i][real].tolist()
        assert "advantage" not in t  # one advantage per episode: the line's own `advantage`
        # the char tokenizer: one character a token, eos "</s>"; the three turns are the trained tokens, each with
        # its eos (4 characters, 1 token); the two tool answers between them are not: 141 sampled of 252
        sampled = "".join(x for x, keep in zip(t["text"], t["loss"], strict=True) if keep)
        assert sampled == "</s>".join(TURNS) + "</s>" and sum(t["loss"]) == len(sampled) - 3 * 3 == 141
        added = "".join(x for x, keep in zip(t["text"], t["loss"], strict=True) if not keep)
        assert added.startswith("<tool_response>wrong</tool_response>") and len(t["ids"]) == 252
        assert set(t["logprob"][j] for j in range(252) if t["loss"][j]) == {-0.5}  # the scripted sampler's
        assert set(t["logprob"][j] for j in range(252) if not t["loss"][j]) == {0.0}
        # both episodes of the group scored 1: no learning signal; sampled by v2, trainer at v3 when checked
        assert (line["zero_std_group"], line["policy_version"], line["staleness"]) == (True, 2, 1)
        assert line["episode"]["masked"] is False


def _single_turn(rewards: list[float], advantages: torch.Tensor) -> tuple[Rollouts, ScoredBatch]:
    """Four single-turn completions of 3, 2, 3 and 1 tokens in two groups of two (right-padded to T = 3)."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    ids = torch.arange(12).view(4, 3) * mask
    logp = -torch.arange(1, 13, dtype=torch.float).view(4, 3) / 7 * mask
    ro = Rollouts(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), ids, mask, logp, ["abc", "de", "fgh", "i"],
                  ["stop"] * 4, group_size=2, policy_version=5)  # fmt: skip
    r = torch.tensor(rewards)
    return ro, ScoredBatch(["v"], r[:, None], r, advantages, verifier_failures={})


def test_single_turn_tokens_per_token_advantages_and_zero_std_groups(tmp_path):
    per_token = torch.tensor([[0.5, 0.25, 0.125], [1.0, -1.0, 9.0], [0.0, 0.0, 0.0], [2.0, 9.0, 9.0]])  # [N, T]
    ro, batch = _single_turn([1.0, 0.0, 1.0, 1.0], per_token)
    rows = [{"prompt": "p0"}, {"prompt": "p1"}]
    append_samples(tmp_path, 7, rows, ro, batch, token_text=lambda ids: [f"<{t}>" for t in ids])
    lines = _lines(tmp_path)
    assert [x["tokens"]["ids"] for x in lines] == [[0, 1, 2], [3, 4], [6, 7, 8], [9]]
    assert [x["tokens"]["text"] for x in lines][3] == ["<9>"]
    assert [x["tokens"]["loss"] for x in lines] == [[1, 1, 1], [1, 1], [1, 1, 1], [1]]  # single-turn: all sampled
    assert lines[1]["tokens"]["logprob"] == [-0.5714, -0.7143]  # -4/7, -5/7 to 4 decimals
    # per-token advantages on the real tokens only (the 9.0s sit on padding); the row's mean is `advantage`
    assert [x["tokens"]["advantage"] for x in lines] == [[0.5, 0.25, 0.125], [1.0, -1.0], [0.0, 0.0, 0.0], [2.0]]
    assert lines[0]["advantage"] == pytest.approx((0.5 + 0.25 + 0.125) / 3)
    # group 0 scored 1 and 0 (signal), group 1 scored 1 and 1 (none); one policy version for the batch
    assert [x["zero_std_group"] for x in lines] == [False, False, True, True]
    assert [x["policy_version"] for x in lines] == [5] * 4 and all("staleness" not in x for x in lines)
    assert all("teacher" not in x["tokens"] for x in lines)  # not distilling


def test_distilling_the_record_holds_the_teachers_log_ratio_on_the_sampled_tokens(tmp_path):
    """log p_teacher - log p_sampler per sampled token (the distillation reward), on the real tokens only."""
    from forge.rewards.teacher import TeacherScores

    ro, batch = _single_turn([1.0, 0.0, 1.0, 1.0], torch.zeros(4))
    teacher = TeacherScores(ro.sampling_logprobs + torch.tensor([[0.5, -0.25, 1.0]]))  # [N, T]
    append_samples(tmp_path, 2, [{"prompt": "p0"}, {"prompt": "p1"}], ro, batch, teacher=teacher)
    assert [x["tokens"]["teacher"] for x in _lines(tmp_path)] == [[0.5, -0.25, 1.0], [0.5, -0.25], [0.5, -0.25, 1.0],
                                                                  [0.5]]  # fmt: skip


def test_without_a_decoder_the_record_keeps_ids_only(tmp_path):
    ro, batch = _single_turn([0.0, 0.0, 1.0, 0.0], torch.zeros(4))
    append_samples(tmp_path, 1, [{"prompt": "p0"}, {"prompt": "p1"}], ro, batch, trainer_version=5)
    first = _lines(tmp_path)[0]
    assert list(first["tokens"]) == ["ids", "loss", "logprob"] and first["staleness"] == 0
