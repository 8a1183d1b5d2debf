"""Tests for forge.data (prep stage, loaders, validation, sampler), the arithmetic generator (forge.tasks.arith) and
the atomic writers in forge.io."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forge.compose import data_sources
from forge.config import ConfigError, DataConfig, RunConfig
from forge.data import (
    load_rows,
    next_row,
    prepare,
    prompt_batch,
    read_split,
    sampler_state,
    validate_rows,
)
from forge.errors import UserError
from forge.io import write_json
from forge.tasks.arith import generate_arithmetic

TEMPLATE = "{a} {op} {b}"


def count_words(s: str) -> int:
    return len(s.split())


def identity(s: str) -> str:
    return s


def arith(**kw) -> DataConfig:
    return DataConfig(**{"prompt_template": TEMPLATE, **kw})


def parse(row: dict) -> tuple[int, str, int]:
    a, op, b = re.fullmatch(r"(\d+) ([-+*]) (\d+)", row["prompt"]).groups()
    return int(a), op, int(b)


def file_cfg(tmp_path: Path, source: Path, **kw) -> RunConfig:
    cfg = RunConfig(seed=3)
    cfg.data = DataConfig(source=str(source), **kw)
    return cfg


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_deterministic_unique_and_disjoint():
    cfg = arith(operations=["+", "-", "*"], train_size=300, eval_size=50)
    train, eval_ = generate_arithmetic(cfg, seed=1)
    assert (train, eval_) == generate_arithmetic(cfg, seed=1)
    assert train != generate_arithmetic(cfg, seed=2)[0]
    assert (len(train), len(eval_)) == (300, 50)
    keys = [parse(r) for r in train + eval_]
    assert len(set(keys)) == 350  # no problem twice, so none in both splits
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in eval_)
    assert {op for _, op, _ in keys} == {"+", "-", "*"}


def test_arithmetic_answers_correct_and_in_range():
    train, eval_ = generate_arithmetic(arith(operations=["+", "-", "*"], train_size=200, eval_size=20), seed=0)
    for row in train + eval_:
        a, op, b = parse(row)
        assert 10 <= a <= 99 and 10 <= b <= 99  # digits=2, min_operand=-1 -> smallest 2-digit number
        assert row["answer"] == str({"+": a + b, "-": a - b, "*": a * b}[op])
        assert int(row["answer"]) >= 0  # allow_negative=False
    assert set(train[0]) == {"id", "prompt", "answer"}


def test_arithmetic_allow_negative_and_min_operand():
    train, _ = generate_arithmetic(arith(operations=["-"], allow_negative=True, min_operand=50), seed=0)
    assert any(int(r["answer"]) < 0 for r in train)
    assert min(min(parse(r)[0], parse(r)[2]) for r in train) >= 50


def test_arithmetic_max_result_filter():
    train, eval_ = generate_arithmetic(arith(max_result=40, train_size=50, eval_size=10), seed=0)
    assert all(int(r["answer"]) <= 40 for r in train + eval_)
    # 2-digit a + b <= 40: a in 10..30 gives b in 10..40-a, i.e. 21 + 20 + ... + 1 = 231 problems >= 60 needed
    assert (len(train), len(eval_)) == (50, 10)


def test_arithmetic_small_space_uses_every_problem_once():
    # digits=1 '+': a, b in 0..9 -> 100 problems; asked for 1000 + 100 -> eval min(100, 25), train the other 75
    train, eval_ = generate_arithmetic(arith(digits=1, train_size=1000, eval_size=100), seed=0)
    assert (len(train), len(eval_)) == (75, 25)
    assert len({parse(r) for r in train + eval_}) == 100


def test_arithmetic_sampled_space_for_many_digits():
    cfg = arith(digits=5, operations=["+", "*"], train_size=40, eval_size=10)
    train, eval_ = generate_arithmetic(cfg, seed=4)
    assert (train, eval_) == generate_arithmetic(cfg, seed=4)
    assert len({parse(r) for r in train + eval_}) == 50
    for row in train + eval_:
        a, op, b = parse(row)
        assert 10_000 <= min(a, b) and max(a, b) <= 99_999
        assert row["answer"] == str(a + b if op == "+" else a * b)


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"operations": ["/"]}, "data.operations"),
        ({"digits": 0}, "data.digits"),
        ({"prompt_template": "{x} + {y}"}, "data.prompt_template"),
        ({"max_result": 5}, "data"),  # 2-digit sums are >= 20: no problem matches
    ],
)
def test_arithmetic_bad_settings_are_config_errors(kw, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        generate_arithmetic(arith(**{"train_size": 10, "eval_size": 2, **kw}), seed=0)


# ---------------------------------------------------------------- loading


ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "topic": "math"},
    {"prompt": "Capital of France?", "answer": "Paris", "topic": "geo"},
]


def test_load_jsonl_json_csv_parquet_agree(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "d.csv").write_text("prompt,answer,topic\nWhat is 2+2?,4,math\nCapital of France?,Paris,geo\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    for ext in ("jsonl", "json", "csv", "parquet"):
        assert load_rows(tmp_path / f"d.{ext}", "prompt", "answer") == ROWS, ext


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(UserError, match=r"bad\.jsonl: line 2 is not valid JSON") as e:
        load_rows(path, "prompt", "answer")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, content, pattern",
    [
        ("missing.jsonl", None, "does not exist"),
        ("d.txt", "hello", "unknown extension '.txt'"),
        ("d.jsonl", '{"question": "q", "answer": "1"}\n', "no column 'prompt' in any row .*data.prompt_column"),
        ("d.jsonl", "[1, 2]\n", "line 1 is a JSON list, not an object"),
        ("d.json", '{"prompt": "q"}', "expected a JSON list of objects"),
        ("d.csv", "prompt,answer\nq,1,extra\n", "line 2 has more fields than the header"),
        ("d.jsonl", "\n", "has no rows"),
    ],
)
def test_load_errors(tmp_path, name, content, pattern):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=pattern):
        load_rows(tmp_path / name, "prompt", "answer")


# ---------------------------------------------------------------- validation


def test_validate_reports_each_bad_row_by_number():
    rows = [
        {"prompt": "fine prompt", "answer": 7, "id": "a", "meta": {"k": 1}},  # 1 ok; answer -> "7", meta kept a dict
        {"prompt": "no answer"},  # 2
        {"prompt": "   ", "answer": "1"},  # 3
        {"prompt": 5, "answer": "1"},  # 4
        {"prompt": "list answer", "answer": [1]},  # 5
        {"prompt": "blank answer", "answer": ""},  # 6
        {"prompt": "one two three four five", "answer": "1"},  # 7: 5 words > 4
        {"prompt": "dup", "answer": "1", "id": "a"},  # 8
        {"prompt": "also fine", "answer": "x"},  # 9 ok, id from file stem
    ]
    good, _, rejected = validate_rows(
        rows,
        source="data/qa.jsonl",
        prompt_column="prompt",
        answer_column="answer",
        count_tokens=count_words,
        max_prompt_tokens=4,
    )
    assert rejected == [
        {"row": 2, "reason": "missing field 'answer'"},
        {"row": 3, "reason": "empty prompt"},
        {"row": 4, "reason": "prompt is not a string or a list of messages (got int)"},
        {"row": 5, "reason": "answer is not a string or number (got list)"},
        {"row": 6, "reason": "empty answer"},
        {"row": 7, "reason": "prompt has 5 tokens > data.max_prompt_tokens=4"},
        {"row": 8, "reason": "duplicate id 'a' (first at row 1)"},
    ]
    assert good == [
        {"id": "a", "prompt": "fine prompt", "answer": "7", "meta": {"k": 1}},
        {"id": "qa-9", "prompt": "also fine", "answer": "x"},
    ]


def test_validate_uses_configured_columns():
    good, _, rejected = validate_rows(
        [{"q": "hi", "a": "1", "prompt": "stale"}, {"q": "x"}],
        source="s.csv",
        prompt_column="q",
        answer_column="a",
        count_tokens=count_words,
        max_prompt_tokens=10,
    )
    assert good == [{"id": "s-1", "prompt": "hi", "answer": "1", "a": "1"}]  # the answer under its own name too
    assert rejected == [{"row": 2, "reason": "missing field 'a'"}]


# ---------------------------------------------------------------- prepare


def arith_run(**kw) -> RunConfig:
    cfg = RunConfig(seed=5)
    cfg.data = arith(train_size=40, eval_size=8, **kw)
    return cfg


def test_prepare_writes_files_and_hash_is_stable(tmp_path):
    cfg = arith_run()
    first = prepare(data_sources(cfg), tmp_path / "run1", identity, count_words)
    second = prepare(data_sources(cfg), tmp_path / "run2", lambda s: f"<user>{s}", count_words)
    third = prepare(data_sources(cfg), tmp_path / "run3", identity, count_words)
    assert sorted(p.name for p in (tmp_path / "run1" / "data").iterdir()) == [
        "eval.parquet",
        "manifest.json",
        "train.parquet",
    ]
    manifest = json.loads((tmp_path / "run1" / "data" / "manifest.json").read_text())
    assert manifest["content_hash"] == third.manifest["content_hash"]
    assert manifest["content_hash"] != second.manifest["content_hash"]  # model_input is part of the content
    assert (manifest["train_rows"], manifest["eval_rows"], manifest["rejected_count"]) == (40, 8, 0)
    assert manifest["columns"] == ["id", "prompt", "model_input", "answer"]
    assert read_split(tmp_path / "run1", "train") == first.train
    assert read_split(tmp_path / "run1", "eval") == first.eval
    assert second.train[0]["model_input"] == "<user>" + second.train[0]["prompt"]


def test_prepare_bad_rows_error_writes_nothing(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    rows[2] = {"prompt": "", "answer": "1"}
    rows[6] = {"prompt": "q6"}
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows), eval_size=2)
    with pytest.raises(UserError) as e:
        prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert str(e.value) == (
        f"{tmp_path / 'src.jsonl'}: 2 invalid rows (row 3: empty prompt; row 7: missing field "
        "'answer'); fix them or set data.on_bad_rows=skip"
    )
    assert not (tmp_path / "run" / "data").exists()


def test_prepare_skip_records_rejected_and_holds_out_eval(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i), "level": i % 3} for i in range(10)]
    rows[4] = {"prompt": "q4", "answer": None}
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows), eval_size=3, on_bad_rows="skip")
    data = prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    m = data.manifest
    assert (m["train_rows"], m["eval_rows"], m["rejected_count"]) == (6, 3, 1)
    assert m["rejected"] == [{"file": str(tmp_path / "src.jsonl"), "row": 5, "reason": "missing field 'answer'"}]
    assert m["columns"] == ["id", "prompt", "model_input", "answer", "level"]
    assert {r["id"] for r in data.train}.isdisjoint(r["id"] for r in data.eval)
    train_numbers = [int(r["id"].removeprefix("src-")) for r in data.train]
    assert train_numbers == sorted(train_numbers)  # hold-out keeps the file's order
    by_id = {r["id"]: r for r in data.train + data.eval}
    assert by_id["src-3"] == {"id": "src-3", "prompt": "q2", "model_input": "q2", "answer": "2", "level": 2}  # int kept
    again = prepare(data_sources(cfg), tmp_path / "run2", identity, count_words)
    assert (again.train, again.eval) == (data.train, data.eval)  # seeded hold-out


def test_prepare_separate_eval_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(5)])
    evalf = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "q0", "answer": "1"}, {"prompt": "new", "answer": "2"}])
    cfg = file_cfg(tmp_path, train, eval_source=str(evalf))
    data = prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert (len(data.train), len(data.eval)) == (5, 2)
    assert [r["id"] for r in data.eval] == ["eval-1", "eval-2"]
    assert data.manifest["eval_prompts_in_train"] == 1


def test_prepare_token_limit_applies_to_formatted_prompt(tmp_path):
    cfg = arith_run(max_prompt_tokens=3, on_bad_rows="skip")
    # raw "12 + 34" is 3 words; with a 2-word wrapper it is 5 > 3, so every row is invalid
    with pytest.raises(UserError, match=r"arithmetic:train: all 40 invalid rows \(row 1: prompt has 5 tokens"):
        prepare(data_sources(cfg), tmp_path / "run", lambda s: f"User: {s} Assistant:", count_words)


def test_read_split_missing_says_to_run_prep(tmp_path):
    with pytest.raises(UserError, match="run the prep stage first"):
        read_split(tmp_path, "train")


def test_write_json_is_atomic_and_leaves_no_temp(tmp_path):
    write_json(tmp_path / "sub" / "m.json", {"a": 1})
    write_json(tmp_path / "sub" / "m.json", {"a": 2})
    assert json.loads((tmp_path / "sub" / "m.json").read_text()) == {"a": 2}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["m.json"]


# ---------------------------------------------------------------- sampler


def test_prompt_order_epochs_are_permutations_and_any_row_is_derived():
    rows = [{"id": str(i)} for i in range(7)]
    first_epoch = [r["id"] for r in prompt_batch(rows, 11, 0, 7)]
    assert sorted(first_epoch) == [str(i) for i in range(7)]
    # the old stateful sampler's order: batches of 4 from row 12 on cross two epoch boundaries
    batches = [[r["id"] for r in prompt_batch(rows, 11, 12 + 4 * k, 4)] for k in range(5)]
    assert [i for b in batches for i in b] == [r["id"] for r in prompt_batch(rows, 11, 12, 20)]
    epoch2 = [r["id"] for r in prompt_batch(rows, 11, 14, 7)]
    assert sorted(epoch2) == sorted(first_epoch) and epoch2 != first_epoch  # epoch 2: another permutation
    assert prompt_batch(rows, 12, 0, 7) != prompt_batch(rows, 11, 0, 7)  # another seed, another order
    got = prompt_batch(rows, 11, 0, 1)
    got[0]["id"] = "changed"
    assert rows[0]["id"] == "0" and prompt_batch(rows, 11, 0, 7)[0]["id"] == first_epoch[0]  # copies


def test_sampler_state_round_trips_and_rejects_state_for_other_data():
    state = json.loads(json.dumps(sampler_state(11, 7, 12)))  # must survive a checkpoint as JSON
    assert (state["epoch"], state["cursor"]) == (1, 5) and next_row(state, 7) == 12
    assert next_row({"epoch": 2, "cursor": 3, "seed": 0}, 7) == 17  # an older checkpoint without num_rows
    with pytest.raises(UserError, match="2 training rows but the data has 1"):
        next_row(sampler_state(0, 2, 1), 1)


# ---------------------------------------------------------------- typed columns, chat messages, datasets sources

TYPED = {"n": 3, "x": 0.25, "tags": ["a", "b"], "meta": {"k": 1, "s": "v"}, "flag": True}


def typed_rows(k: int = 6) -> list[dict]:
    return [{"prompt": f"q{i}", "answer": str(i), **TYPED, "n": i} for i in range(k)]


def test_typed_columns_round_trip_through_parquet_and_hash_stays(tmp_path):
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", typed_rows()), eval_size=2)
    data = prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    back = read_split(tmp_path / "run", "train") + read_split(tmp_path / "run", "eval")
    assert back == data.train + data.eval  # what build returned is what read_split gives
    row = next(r for r in back if r["id"] == "src-4")
    assert {k: row[k] for k in TYPED} == {**TYPED, "n": 3}  # row 4 holds i=3
    assert all(type(row[k]) is type(v) for k, v in TYPED.items())
    schema = pq.read_schema(tmp_path / "run" / "data" / "train.parquet")
    assert str(schema.field("n").type) == "int64" and str(schema.field("flag").type) == "bool"
    assert data.manifest["column_types"]["tags"] == "list<item: string>"
    again = prepare(data_sources(cfg), tmp_path / "run2", identity, count_words)
    assert again.manifest["content_hash"] == data.manifest["content_hash"]


def test_mixed_column_types_name_the_column_and_two_rows(tmp_path):
    rows = typed_rows()
    rows[4]["n"] = "four"
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows), eval_size=2)
    with pytest.raises(UserError, match=r"column 'n' mixes types \(row 1: int, row 5: str\)"):
        prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    rows[4]["n"] = 4.5  # ints with a float: stored as floats
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src2.jsonl", rows), eval_size=2)
    data = prepare(data_sources(cfg), tmp_path / "run2", identity, count_words)
    assert sorted(r["n"] for r in data.train + data.eval) == [0.0, 1.0, 2.0, 3.0, 4.5, 5.0]


def test_answer_column_is_also_kept_under_its_own_name_with_its_type(tmp_path):
    rows = [{"prompt": f"q{i}", "target": i} for i in range(5)]
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows), eval_size=1, answer_column="target")
    data = prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert all(r["answer"] == str(r["target"]) and type(r["target"]) is int for r in data.train + data.eval)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ([], "empty prompt (no messages)"),
        (["1+1="], "prompt message 1 is not a {role, content} object (got str)"),
        ([{"role": "user", "content": "ok"}, {"role": "tool", "content": "x"}], "prompt message 2 has role 'tool'"),
        ([{"content": "x"}], "prompt message 1 has role None"),
        ([{"role": "user", "content": 3}], "prompt message 1 content is not a string (got int)"),
        ([{"role": "user", "content": "  "}], "empty prompt (every message is blank)"),
        ({"role": "user"}, "prompt is not a string or a list of messages (got dict)"),
    ],
)
def test_message_prompts_are_validated_by_row(prompt, reason):
    rows = [{"prompt": MESSAGES, "answer": "2"}, {"prompt": prompt, "answer": "2"}]
    good, _, rejected = validate_rows(rows, source="d.jsonl", prompt_column="prompt", answer_column="answer",
                                   count_tokens=lambda p: len(p), max_prompt_tokens=10)  # fmt: skip
    assert good == [{"id": "d-1", "prompt": MESSAGES, "answer": "2"}]
    assert len(rejected) == 1 and rejected[0]["row"] == 2 and rejected[0]["reason"].startswith(reason)


def save_dict(path: Path, **splits: list[dict]) -> Path:
    from datasets import Dataset, DatasetDict

    DatasetDict({k: Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return path


def test_dataset_dict_split_and_eval_split(tmp_path):
    chat = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "n": i} for i in range(8)]
    src = save_dict(tmp_path / "dd", train=chat[:6], test=chat[6:])
    fmt = lambda p: p if isinstance(p, str) else "|".join(m["content"] for m in p)  # noqa: E731
    cfg = file_cfg(tmp_path, src, eval_split="test")
    data = prepare(data_sources(cfg), tmp_path / "run", fmt, count_words)
    assert [r["n"] for r in data.train] == [0, 1, 2, 3, 4, 5] and [r["n"] for r in data.eval] == [6, 7]
    assert data.eval[0]["prompt"] == [{"role": "user", "content": "q6"}] and data.eval[0]["model_input"] == "q6"
    assert data.eval[0]["id"] == "dd:test-1" and data.manifest["eval_split"] == "test"
    held = prepare(
        data_sources(file_cfg(tmp_path, src, eval_size=2)), tmp_path / "run2", fmt, count_words
    )  # no eval_split
    assert (len(held.train), len(held.eval)) == (4, 2)
    other = prepare(
        data_sources(file_cfg(tmp_path, src, split="test", eval_size=1)), tmp_path / "run3", fmt, count_words
    )
    assert sorted(r["n"] for r in other.train + other.eval) == [6, 7]


def test_plain_dataset_directory_and_file_sets_through_datasets(tmp_path):
    from datasets import Dataset

    rows = typed_rows(6)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "parts").mkdir()
    Dataset.from_list(rows[:3]).to_parquet(str(tmp_path / "parts" / "a.parquet"))
    Dataset.from_list(rows[3:]).to_parquet(str(tmp_path / "parts" / "b.parquet"))
    write_jsonl(tmp_path / "j-1.jsonl", rows[:3]), write_jsonl(tmp_path / "j-2.jsonl", rows[3:])
    for source in (tmp_path / "ds", tmp_path / "parts", f"{tmp_path}/j-*.jsonl"):
        got = load_rows(str(source), "prompt", "answer")
        assert got == rows, source  # every type as written, the files in name order


def test_eval_split_needs_a_dataset_dict(tmp_path):
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", typed_rows()), eval_split="test")
    with pytest.raises(ConfigError, match="data.eval_split.*not a `datasets` DatasetDict"):
        prepare(data_sources(cfg), tmp_path / "run", identity, count_words)


# ---------------------------------------------------------------- unlabeled training data (issue 17)

UNLABELED = [{"prompt": f"{i}+1=", "level": i % 3} for i in range(6)]
LABELLED_EVAL = [{"prompt": "7+1=", "answer": "8", "level": 1}, {"prompt": "8+1=", "answer": 9, "level": 2}]


def write_unlabeled(tmp_path: Path, kind: str) -> tuple[str, dict]:
    """An unlabeled training source of `kind` and the data keys that name a labelled eval split for it."""
    eval_file = {"eval_source": str(write_jsonl(tmp_path / "e.jsonl", LABELLED_EVAL))}
    if kind == "jsonl":
        return str(write_jsonl(tmp_path / "u.jsonl", UNLABELED)), eval_file
    if kind == "csv":  # csv holds text: the eval file's levels are text too (one type per column)
        (tmp_path / "u.csv").write_text("prompt,level\n" + "".join(f"{r['prompt']},{r['level']}\n" for r in UNLABELED))
        (tmp_path / "e.csv").write_text("prompt,answer,level\n7+1=,8,1\n8+1=,9,2\n")
        return str(tmp_path / "u.csv"), {"eval_source": str(tmp_path / "e.csv")}
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(UNLABELED), tmp_path / "u.parquet")
        return str(tmp_path / "u.parquet"), eval_file
    evals = [{**r, "answer": str(r["answer"])} for r in LABELLED_EVAL]  # one type per column in a Dataset
    return str(save_dict(tmp_path / "dd", train=UNLABELED, test=evals)), {"eval_split": "test"}


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "datasets"])
def test_unlabeled_source_trains_with_label_free_and_round_trips(tmp_path, kind):
    from forge.data import check_data_hash

    source, eval_keys = write_unlabeled(tmp_path, kind)
    cfg = file_cfg(tmp_path, source, **eval_keys)
    cfg.reward.label_free = True
    data = prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert [r["answer"] for r in data.train] == [None] * 6 and [r["answer"] for r in data.eval] == ["8", "9"]
    assert data.train[2]["prompt"] == "2+1=" and data.train[2]["level"] == ("2" if kind == "csv" else 2)
    m = data.manifest
    assert (m["train_rows"], m["eval_rows"], m["train_labelled"]) == (6, 2, False)
    assert m["columns"] == ["id", "prompt", "model_input", "answer", "level"]
    assert m["column_types"]["answer"] == "string"
    assert str(pq.read_schema(tmp_path / "run" / "data" / "train.parquet").field("answer").type) == "string"
    train, eval_ = read_split(tmp_path / "run", "train"), read_split(tmp_path / "run", "eval")
    assert (train, eval_) == (data.train, data.eval)  # the all-null answer column round-trips
    assert check_data_hash(tmp_path / "run", train, eval_) == m["content_hash"]
    assert (
        prepare(data_sources(cfg), tmp_path / "run2", identity, count_words).manifest["content_hash"]
        == m["content_hash"]
    )


def test_labelled_source_with_label_free_keeps_its_answers(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    cfg = file_cfg(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows), eval_size=1)
    cfg.reward.label_free = True  # hides answers from the reward, not from the data
    data = prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert data.manifest["train_labelled"] and all(r["answer"] is not None for r in data.train + data.eval)


def test_unlabeled_source_errors_are_one_line(tmp_path):
    src = write_jsonl(tmp_path / "u.jsonl", UNLABELED)
    cfg = file_cfg(tmp_path, src, eval_source=str(write_jsonl(tmp_path / "e.jsonl", LABELLED_EVAL)))
    with pytest.raises(UserError) as e:  # without label_free an answer column is required
        prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert str(e.value) == (
        f"{src}: no column 'answer' in any row (found 'prompt', 'level'); set data.answer_column or set "
        "reward.label_free=true"
    )
    cfg = file_cfg(tmp_path, src, answer_column="solution")
    cfg.reward.label_free = True
    with pytest.raises(UserError) as e:  # no eval source: nothing labelled to evaluate on
        prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert str(e.value) == (
        f"{src}: no answer column 'solution' to hold out eval rows from; set data.eval_source to a labelled file"
    )
    cfg.data.answer_column, cfg.data.eval_source = "answer", str(src)
    with pytest.raises(UserError) as e:  # the eval source must have answers, label_free or not
        prepare(data_sources(cfg), tmp_path / "run", identity, count_words)
    assert str(e.value) == f"{src}: no column 'answer' in any row (found 'prompt', 'level'); set data.answer_column"
    assert not (tmp_path / "run" / "data").exists()
