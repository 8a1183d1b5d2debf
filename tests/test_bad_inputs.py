"""The bad-input suite: each malformed input a careless or hostile user may give the CLI exits non-zero with exactly
one line on stderr naming the file/field/row, and leaves the existing run directory byte-for-byte unchanged.

Table-driven: a case is (id, setup, argv, expected text). `setup(base, tmp)` may write input files or damage a
copy of a finished tiny run (`base`: a resume case points the CLI at that copy; every other case at a new name
beside it) and returns the argv tail. The tree of the run directory is hashed before and after. Everything runs
in process through `flows.cli.main` with `--no-prefect` where a run starts (fast, and no Prefect log handlers).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["steps=2", "threads=1", "checkpoint.every=1", "eval.every=0", "eval.k=0", "eval.max_problems=8",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "tracking.mlflow=false", "model.tiny.hidden=32",
        "model.tiny.layers=1"]  # fmt: skip


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step tiny run (checkpoints at steps 1 and 2), made once."""
    runs = tmp_path_factory.mktemp("pristine")
    args = ["run", "--preset", "tiny", "--name", "base", "--runs-dir", str(runs), "--quiet", "--no-prefect"]
    assert main(args + _sets(TINY)) == 0
    return runs / "base"


def tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}  # fmt: skip


# ---------------------------------------------------------------- case builders: (tmp, run) -> argv


def new_run(*sets: str, name: str = "new") -> callable:
    def argv(tmp: Path, run: Path) -> list[str]:
        return ["run", "--preset", "tiny", "--name", name, "--runs-dir", str(run.parent), "--quiet", "--no-prefect",
                *_sets(TINY), *_sets([s.format(tmp=tmp) for s in sets])]  # fmt: skip

    return argv


def with_file(name: str, content: bytes, *sets: str) -> callable:
    def argv(tmp: Path, run: Path) -> list[str]:
        (tmp / name).write_bytes(content)
        return new_run(*sets)(tmp, run)

    return argv


def yaml_config(content: bytes) -> callable:
    def argv(tmp: Path, run: Path) -> list[str]:
        (tmp / "c.yaml").write_bytes(content)
        return ["run", "--config", str(tmp / "c.yaml"), "--name", "new", "--runs-dir", str(run.parent), "--no-prefect"]

    return argv


def resume(*damages: callable) -> callable:
    def argv(tmp: Path, run: Path) -> list[str]:
        for damage in damages:
            damage(run)
        return ["run", "--name", run.name, "--resume", "--runs-dir", str(run.parent), "--quiet", "--no-prefect"]

    return argv


def raw(*args: str) -> callable:
    def argv(tmp: Path, run: Path) -> list[str]:
        return [a.format(tmp=tmp, run=run, runs=run.parent) for a in args]

    return argv


def truncate(rel: str, keep: float = 0.5):
    def damage(run: Path) -> None:
        p = run / rel
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])

    return damage


NONE_INTACT = "and no checkpoint is intact (step-000001 has"


def every_checkpoint(damage: callable, name: str, *args) -> callable:
    """`damage(f"checkpoints/step-N/{name}", *args)` applied to every checkpoint of the run."""

    def each(run: Path) -> None:
        for ckpt in sorted((run / "checkpoints").glob("step-*")):
            damage(str(ckpt.relative_to(run) / name), *args)(run)

    return each


def write(rel: str, content: bytes):
    def damage(run: Path) -> None:
        (run / rel).write_bytes(content)

    return damage


def dataset_dict(*splits: str, sets: tuple[str, ...] = ()) -> callable:
    """A real `datasets` DatasetDict directory {tmp}/dd with these splits (20 valid rows each)."""

    def argv(tmp: Path, run: Path) -> list[str]:
        from datasets import Dataset, DatasetDict

        rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
        DatasetDict({s: Dataset.from_list(rows) for s in splits}).save_to_disk(str(tmp / "dd"))
        return new_run("data.source={tmp}/dd", *sets)(tmp, run)

    return argv


def files(contents: dict[str, bytes], *sets: str) -> callable:
    def argv(tmp: Path, run: Path) -> list[str]:
        for name, content in contents.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(content)
        return new_run(*sets)(tmp, run)

    return argv


def garbage_metrics_line(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    lines.insert(1, b'{"step": "two", oops')
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))


def other_data(run: Path) -> None:
    """Swap the train split for a valid parquet file with other rows: the content hash no longer matches."""
    import pyarrow.parquet as pq

    table = pq.read_table(run / "data" / "train.parquet")
    pq.write_table(table.slice(1), run / "data" / "train.parquet")


class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FORGEWEAVE_PLANTED']}",))


def legacy_pickle(run: Path) -> None:
    """Only a pickled trainer_state.pt (what forgeweave wrote before issue 19) in every checkpoint, planted: never
    unpickled."""
    for ckpt in (run / "checkpoints").glob("step-*"):
        (ckpt / "trainer_state.json").unlink()
        (ckpt / "trainer_state.pt").write_bytes(pickle.dumps(_Planted()))
    (run / "batch.pt").write_bytes(pickle.dumps(_Planted()))


CSV_NUL = b"prompt,answer\n" + b"".join(f"{i}+1=,{i + 1}\n".encode() for i in range(20)) + b"4\x00+1=,5\n"
JSONL = b"".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}).encode() + b"\n" for i in range(20))
JSONL_DUP = JSONL + b'{"prompt": "1+1=", "answer": "2", "answer": "3"}\n'
JSONL_INF = JSONL + b'{"prompt": "1+1=", "answer": Infinity}\n'
SRC = "data.source={tmp}/"
JSONL_TOOL_ROLE = JSONL + json.dumps({"prompt": [{"role": "tool", "content": "4+1="}], "answer": "5"}).encode() + b"\n"
JSONL_MESSAGES = b"".join(
    json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": i + 1}).encode() + b"\n"
    for i in range(20)
)
JSONL_MIXED = b"".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1, "n": i}).encode() + b"\n" for i in range(20))
JSONL_MIXED += json.dumps({"prompt": "x+1=", "answer": 1, "n": "many"}).encode() + b"\n"

CASES = [
    # config values (-> the dotted key)
    ("lr-inf", new_run("update.lr=inf"), "update.lr"),
    ("weights-nan", new_run("reward.weights=[nan]"), "reward.weights[0]"),
    ("weight-decay-nan", new_run("update.weight_decay=nan"), "update.weight_decay"),
    ("betas-one-value", new_run("update.adam_betas=[0.9]"), "update.adam_betas"),
    ("betas-out-of-range", new_run("update.adam_betas=[0.9, 1.5]"), "update.adam_betas[1]"),
    ("adaptive-target-0", new_run("update.adaptive.target=0"), "update.adaptive.target"),
    ("negative-seed", new_run("seed=-1"), "'seed'"),
    ("negative-size", new_run("rollout.prompts_per_step=-2"), "rollout.prompts_per_step"),
    ("negative-keep-last", new_run("checkpoint.keep_last=-1"), "checkpoint.keep_last"),
    ("negative-eval-every", new_run("eval.every=-1"), "eval.every"),
    ("negative-max-grad-norm", new_run("update.max_grad_norm=-1"), "update.max_grad_norm"),
    ("empty-eval-split", new_run("eval.max_problems=0"), "eval.max_problems"),
    ("unknown-key", new_run("update.lrr=1"), "update.lrr"),
    # config and pools files
    ("yaml-not-utf8", yaml_config(b"steps: 3\nseed: \xff\xfe\n"), "not UTF-8"),
    ("yaml-syntax", yaml_config(b"steps: [3\n"), "not valid YAML"),
    ("yaml-not-a-mapping", yaml_config(b"- 1\n- 2\n"), "must be a mapping"),
    ("pools-not-utf8", with_file("p.yaml", b"\xff"), None),  # replaced below: plan --pools
    # names and paths
    ("name-dotdot", new_run(name="../x"), "'../x' is not a plain directory name"),
    ("name-absolute", new_run(name="/tmp/x"), "is not a plain directory name"),
    ("name-nested", new_run(name="a/b"), "'a/b' is not a plain directory name"),
    (
        "eval-out-missing-dir",
        raw("eval", "{run}/checkpoints/step-000002", "--out", "{tmp}/no/r.json"),
        "does not exist",
    ),
    ("eval-out-not-json", raw("eval", "{run}/checkpoints/step-000002", "--out", "{run}/config.yaml"), ".json"),
    (
        "eval-out-a-record",
        raw("eval", "{run}/checkpoints/step-000002", "--out", "{run}/summary.json"),
        "is not an eval report",
    ),
    (
        "eval-empty-split",
        raw("eval", "{run}/checkpoints/step-000002", "--set", "eval.max_problems=0"),
        "eval.max_problems",
    ),
    # data files (-> file and row/line)
    ("jsonl-duplicate-key", with_file("d.jsonl", JSONL_DUP, SRC + "d.jsonl"), "line 21: duplicate key 'answer'"),
    ("jsonl-infinity", with_file("d.jsonl", JSONL_INF, SRC + "d.jsonl"), "line 21: Infinity is not a JSON number"),
    ("jsonl-not-utf8", with_file("d.jsonl", JSONL + b"\xff\xfe\n", SRC + "d.jsonl"), "not UTF-8"),
    ("csv-nul-byte", with_file("d.csv", CSV_NUL, SRC + "d.csv"), "row 21: prompt contains a NUL byte"),
    ("parquet-corrupt", with_file("d.parquet", b"PAR1 not really", SRC + "d.parquet"), "not a readable parquet"),
    # datasets sources, chat-message prompts, typed columns (-> directory / split / column and rows)
    ("dataset-dir-garbage", files({"ds/state.json": b"{garbage"}, SRC + "ds"), "not a readable `datasets` directory"),
    ("dataset-dict-no-split", dataset_dict("test"), "has no split 'train' (splits: 'test'); set data.split"),
    ("dataset-dict-bad-eval-split", dataset_dict("train", sets=("data.eval_split=dev",)), "set data.eval_split"),
    ("eval-split-not-a-dict", with_file("d.jsonl", JSONL, SRC + "d.jsonl", "data.eval_split=test"), "DatasetDict"),
    ("file-set-mixed-kinds", files({"fs/a.jsonl": JSONL, "fs/b.csv": CSV_NUL}, SRC + "fs"), "files of kinds"),
    ("file-glob-matches-nothing", new_run(SRC + "none-*.parquet"), "matches no files"),
    ("messages-bad-role", with_file("d.jsonl", JSONL_TOOL_ROLE, SRC + "d.jsonl"), "row 21: prompt message 1 has role"),
    ("messages-no-template", with_file("d.jsonl", JSONL_MESSAGES, SRC + "d.jsonl"), "has no chat template"),
    ("column-mixed-types", with_file("d.jsonl", JSONL_MIXED, SRC + "d.jsonl"), "column 'n' mixes types (row 1: int"),
    (
        "model-config-garbage",
        with_file("m/config.json", b"{garbage", "model.path={tmp}/m"),
        "config.json': Expecting property name",
    ),
    # resuming a run whose every checkpoint is damaged (-> each one; one damaged checkpoint is resumed from the newest
    # intact one: tests/test_faults.py)
    ("metrics-corrupt", resume(garbage_metrics_line), "metrics.jsonl: line 2 is not a metrics row"),
    ("state-json-truncated", resume(every_checkpoint(truncate, "trainer_state.json")), NONE_INTACT),
    ("state-tensors-truncated", resume(every_checkpoint(truncate, "trainer_state.safetensors")), "damaged trainer_st"),
    ("weights-truncated", resume(every_checkpoint(truncate, "model.safetensors", 0.9)), "damaged model.safetensors"),
    (
        "latest-garbage-none-intact",
        resume(write("checkpoints/latest", b"\xff\xfe\x00"), every_checkpoint(truncate, "model.safetensors")),
        "names unreadable bytes, not a step directory, and no checkpoint is intact",
    ),
    ("split-corrupt", resume(truncate("data/train.parquet")), "train.parquet: not a readable parquet"),
    ("data-changed", resume(other_data), "splits changed since data/manifest.json"),
    ("planted-pickle", resume(legacy_pickle), "a pickled trainer_state.pt from an older forgeweave is never loaded"),
]


def _pools_case(tmp: Path, run: Path) -> list[str]:
    (tmp / "p.yaml").write_bytes(b"pools: [\xff")
    return ["plan", "--preset", "tiny", "--pools", str(tmp / "p.yaml")]


CASES = [c if c[0] != "pools-not-utf8" else (c[0], _pools_case, "pools file") for c in CASES]
CASES.append(("pools-not-a-list", raw("plan", "--preset", "tiny", "--set", "pools=oops"), "pools"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, finished, tmp_path, capsys, monkeypatch):
    name, argv_of, expected = case
    monkeypatch.setenv("FORGEWEAVE_PLANTED", str(tmp_path / "executed"))
    runs = tmp_path / "runs"
    run = runs / "base"
    shutil.copytree(finished, run)
    inputs = tmp_path / "in"
    (inputs / "m").mkdir(parents=True)
    argv = argv_of(inputs, run)
    before = tree_hash(run)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgeweave: error: "), err
    assert expected in lines[0], lines[0]
    assert tree_hash(run) == before  # the existing run (damaged or not) is exactly as it was
    assert not (tmp_path / "executed").exists()  # no pickle ran
    assert not (tmp_path / "x").exists() and not (Path("/tmp/x") / "config.yaml").exists()


def test_run_name_that_is_a_file(finished, tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "f").write_text("not a run")
    assert main(new_run(name="f")(tmp_path, runs / "base")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'" + str(runs / "f") + "' is a file" in err
    assert (runs / "f").read_text() == "not a run"


def test_a_full_disk_reports_the_disk_error_not_the_status_write(tmp_path, capsys, monkeypatch):
    """ENOSPC from the 4th write on (simulated): one line naming the disk error, exit 2; the failure path's own
    status.json write fails too and is not what the user sees."""
    import forge.io

    real, calls = forge.io.atomic_write_bytes, []

    def full(path, data):
        calls.append(Path(path).name)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(forge.io, "atomic_write_bytes", full)
    code = main(new_run(name="full")(tmp_path, tmp_path / "runs" / "base"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert "No space left on device" in err and "cannot write" in err
    assert "status.json" in calls[4:]  # the failed-status write was attempted, failed, and did not mask the error


def test_a_second_process_on_the_run_is_refused_and_changes_nothing(finished, tmp_path, capsys):
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    hold = "import sys,time; from forge.rundir import RunLock; RunLock.acquire(sys.argv[1]); print('ok', flush=True);" \
           " time.sleep(120)"  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        before = tree_hash(run)
        assert main(resume()(tmp_path, run)) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"is in use by process {holder.pid}" in err, err
        assert tree_hash(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_sync_against_a_server_that_never_answers_gives_up_quickly(finished, tmp_path, capsys, monkeypatch):
    """A black-holed MLflow server (accepts the connection, never replies): the client timeout bounds the wait
    (MLflow's own defaults, 120 s and 7 retries with backoff, would take minutes)."""
    from flows.tracking.outbox import Outbox

    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    Outbox(run).append("log_metrics", step=1, metrics={"x": 1.0})
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        t0 = time.perf_counter()
        code = main(["sync", str(run), "--uri", f"http://127.0.0.1:{server.getsockname()[1]}"])
        took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "could not reach MLflow" in err, err
    assert took < 60
