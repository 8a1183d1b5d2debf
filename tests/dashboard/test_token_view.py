"""The token view on the run detail page (issue 44): a picked episode (or, single-turn, a picked sample) shown as its
tokens, sampled ones apart from what the environment or tools added (the loss mask), with each token's sampling
log-prob on hover and in a table; the samples table says per sample whether its group had zero reward std and how
stale its policy was. The episodes that call tools are played by forge's episode loop (tests.episode_samples) and
recorded by forge.rundir.append_samples; samples written before the record existed show no token view."""

import html
import json
import math
import re
import shutil

import pytest

from dashboard import tokens
from tests.dashboard.conftest import MT_RUN, open_page, texts
from tests.episode_samples import TURNS, write_tool_episodes

SPAN = re.compile(r'<span class="(fw-[a-z -]+)" title="([^"]*)">(.*?)</span>', re.DOTALL)


def _samples_table(at):
    return next(d.value for d in at.dataframe if "completion" in d.value.columns)


def _token_spans(at) -> list[tuple[str, str, str]]:
    """(class, hover text, token text) of every token span of the page's token view."""
    block = next(h.value for h in at.get("html") if 'class="fw-tokens"' in h.value)
    return [(cls, html.unescape(tip), html.unescape(text)) for cls, tip, text in SPAN.findall(block)]


def _token_table(at):
    return next(d.value for d in at.dataframe if "kind" in d.value.columns)


@pytest.fixture
def tool_run(multiturn_run, tmp_path):
    """A copy of the multi-turn run whose samples.jsonl gains a step 3 of two tool-calling episodes (rows 16, 17),
    sampled by policy v2 while the trainer was at v3."""
    run = tmp_path / "runs" / MT_RUN
    shutil.copytree(multiturn_run, run)
    write_tool_episodes(run, step=3, version=2, trainer_version=3)
    return run


def test_a_tool_episode_is_shown_as_its_tokens(tool_run, monkeypatch):
    at = open_page(tool_run.parent, monkeypatch, "run_detail")
    table = _samples_table(at)  # per sample: its group's zero-std flag and staleness, as samples.jsonl has them
    written = [json.loads(line) for line in (tool_run / "samples.jsonl").read_text().splitlines()]
    assert "tokens" not in table.columns and len(table) == 18
    assert table["zero-std group"].tolist() == [w["zero_std_group"] for w in written]
    assert table["staleness"].tolist() == [0] * 16 + [1, 1]  # the run trains on-policy; the tool episodes lag one

    next(s for s in at.selectbox if s.label == "episode").set_value(16).run()
    assert not at.exception and "Tokens" in [h.value for h in at.subheader]
    spans = _token_spans(at)
    # 252 tokens after the prompt (the char tokenizer: one a character, eos "</s>"): the policy's three turns with
    # their eos, 141, on blue; the two tool answers between them, 111, on grey
    assert len(spans) == 252 and len(_token_table(at)) == 252
    sampled = [text for cls, _, text in spans if cls.startswith("fw-sampled")]
    added = [text for cls, _, text in spans if cls == "fw-added"]
    assert "".join(sampled) == "</s>".join(TURNS) + "</s>" and len(sampled) == 141
    assert "".join(added).startswith("<tool_response>wrong</tool_response>") and len(added) == 111
    assert spans[0][1] == f"#0 · id {written[16]['tokens']['ids'][0]} · log-prob -0.5 (p 0.6065)"  # the hover text
    answer = len(TURNS[0]) + 1  # the first tool answer's first token: after the first turn and its eos
    assert spans[answer] == ("fw-added", f"#{answer} · id {written[16]['tokens']['ids'][answer]} · not trained", "<")
    assert "252 tokens: 141 sampled (trained), 111 added · mean sampling log-prob of the sampled ones -0.5" in texts(at)
    legend = next(h.value for h in at.get("html") if "loss mask 0" in h.value)
    assert "added by the environment, tools or agent" in legend
    frame = _token_table(at)
    assert frame["kind"].value_counts().to_dict() == {"sampled": 141, "added": 111}
    assert set(frame.loc[frame["kind"] == "sampled", "log-prob"]) == {-0.5}
    assert frame.loc[frame["kind"] == "added", "log-prob"].isna().all()


def test_an_episode_whose_agent_rewrote_its_history_shows_each_training_sequence(tool_run, monkeypatch):
    """A record with `more` (forge.rundir.token_record: the sequences after the first, each after its own prompt):
    the view draws each under a line that says which sequence it is and why."""
    path = tool_run / "samples.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    second = {"prompt_tokens": 9, "ids": [7, 8, 9], "text": ["x", "y", "z"], "loss": [1, 1, 0],
              "logprob": [-0.25, -0.5, 0.0]}  # fmt: skip
    lines[16]["tokens"]["more"] = [second]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    at = open_page(tool_run.parent, monkeypatch, "run_detail")
    next(s for s in at.selectbox if s.label == "episode").set_value(16).run()
    assert not at.exception
    blocks = [h.value for h in at.get("html") if 'class="fw-tokens"' in h.value]
    assert len(blocks) == 2
    spans = [(cls, text) for cls, _, text in SPAN.findall(blocks[1])]
    assert spans == [("fw-sampled", "x"), ("fw-sampled", "y"), ("fw-added", "z")]
    line = next(c for c in texts(at).splitlines() if c.startswith("training sequence 2 of 2"))
    assert "its new prompt (9 tokens, not shown)" in line and "3 tokens: 2 sampled (trained), 1 added" in line


def test_a_runs_own_episode_shows_its_tokens_without_picking(multiturn_run, monkeypatch):
    """The run's first sample (one policy turn): every token sampled, log-probs as samples.jsonl has them."""
    at = open_page(multiturn_run.parent, monkeypatch, "run_detail")
    first = json.loads((multiturn_run / "samples.jsonl").read_text().splitlines()[0])["tokens"]
    spans = _token_spans(at)
    assert [text for _, _, text in spans] == first["text"]
    assert _token_table(at)["log-prob"].tolist() == first["logprob"]
    # sampled, and marked unlikely where the sampler gave it under 0.1 (a random tiny model: about 1/100 each)
    unlikely = [math.exp(lp) < 0.1 for lp in first["logprob"]]
    assert [cls for cls, _, _ in spans] == ["fw-sampled fw-unlikely" if u else "fw-sampled" for u in unlikely]


def test_a_single_turn_run_picks_a_sample_for_its_tokens(tiny_run, monkeypatch):
    at = open_page(tiny_run.parent, monkeypatch, "run_detail")
    box = next(s for s in at.selectbox if s.label == "sample")
    lines = [json.loads(line) for line in (tiny_run / "samples.jsonl").read_text().splitlines()]
    box.set_value(len(lines) - 1).run()  # the last sample of the last step
    assert not at.exception
    assert [text for _, _, text in _token_spans(at)] == lines[-1]["tokens"]["text"]
    assert len(_token_table(at)) == len(lines[-1]["tokens"]["ids"]) and not at.chat_message
    # the update recorded the trainer's log-prob gap to the sampler on each token (first rows of every step)
    gap = lines[-1]["tokens"]["gap"]
    assert len(gap) == len(lines[-1]["tokens"]["ids"]) and all(g is not None and abs(g) < 5 for g in gap)
    assert _token_table(at)["trainer gap"].tolist() == gap
    assert any("mean |trainer gap|" in c.value for c in at.caption)


def test_samples_written_before_the_record_show_no_token_view(tool_run, monkeypatch):
    """Older runs' lines: no tokens, no zero-std flag, no staleness; the page reads them as before."""
    path = tool_run / "samples.jsonl"
    old = [json.loads(line) for line in path.read_text().splitlines()]
    for row in old:
        for key in ("tokens", "zero_std_group", "staleness", "policy_version"):
            row.pop(key, None)
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    at = open_page(tool_run.parent, monkeypatch, "run_detail")
    table = _samples_table(at)
    assert "zero-std group" not in table.columns and "staleness" not in table.columns
    assert not [h for h in at.get("html") if 'class="fw-tokens"' in h.value]
    assert "Tokens" not in [h.value for h in at.subheader] and len(at.chat_message) == 2  # the transcript stays


def test_token_text_is_escaped_and_the_doctests_hold():
    import doctest

    assert doctest.testmod(tokens).failed == 0
    record = {"ids": [1, 2], "text": ['<img src=x onerror="alert(1)">', "&"], "loss": [1, 0], "logprob": [-1.0, 0]}
    block = tokens.token_html(record)
    assert "<img" not in block and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in block and "&amp;" in block


def test_a_distilled_samples_teacher_log_ratio_is_in_the_table_and_on_hover():
    record = {"ids": [1, 2], "text": ["a", "b"], "loss": [1, 0], "logprob": [-1.0, 0.0], "teacher": [0.75, 0.0]}
    assert tokens.token_table(record)["teacher log-ratio"].tolist() == [0.75, 0.0]
    (sampled, tip, _), (added, added_tip, _) = [
        (cls, html.unescape(t), x) for cls, t, x in SPAN.findall(tokens.token_html(record))
    ]
    assert "teacher log-ratio 0.75" in tip and "teacher" not in added_tip  # only sampled tokens carry one


def test_the_token_record_is_read_for_the_picked_sample_only(tmp_path):
    """The cached samples frame says which samples have tokens; `sample_tokens` reads one record, by the frame's index
    (a garbled line skipped by both)."""
    from dashboard import data

    record = {"ids": [7], "text": ["x"], "loss": [1], "logprob": [-0.25]}
    lines = [json.dumps({"step": 1, "reward": 0.0}), '{"step": 1, "rew', json.dumps({"step": 2, "tokens": record})]
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(lines) + "\n")
    frame = data.samples_frame(data.read_jsonl(path))
    assert frame[data.TOKENS].tolist() == [False, True] and "tokens" not in frame.columns
    assert data.sample_tokens(path, 1) == record and data.sample_tokens(path, 0) is None
    assert data.sample_tokens(path, 2) is None  # past the end


def test_the_trainer_gap_is_in_the_table_and_a_large_one_is_marked():
    record = {"ids": [1, 2, 3], "text": ["a", "b", "c"], "loss": [1, 1, 0], "logprob": [-1.0, -2.0, 0.0],
              "gap": [0.01, -0.75, 0.0]}  # fmt: skip
    assert tokens.token_table(record)["trainer gap"].tolist() == [0.01, -0.75, 0.0]
    spans = [(cls, html.unescape(t)) for cls, t, _ in SPAN.findall(tokens.token_html(record))]
    assert [cls for cls, _ in spans] == ["fw-sampled", "fw-sampled fw-gap", "fw-added"]  # |-0.75| > GAP = 0.5
    assert "trainer gap -0.75" in spans[1][1] and "gap" not in spans[2][1]  # only sampled tokens carry one
    assert tokens.summary(record).endswith("mean |trainer gap| 0.38")
