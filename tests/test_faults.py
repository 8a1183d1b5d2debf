"""Faults that must never cost recorded progress (issue 33): a damaged `checkpoints/latest` or checkpoint, a truncated
weight file given to `run`, `eval` or `export`, and a disk that fills up while a checkpoint is written.

Resume cases damage a copy of one finished 3-step tiny run (checkpoints at steps 1, 2 and 3) and resume it through
`flows.cli.main` in process; the disk-full case runs the CLI in a subprocess under a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored so a write fails with EFBIG), then resumes without it and compares with an
uninterrupted run, as tests/test_kill_resume.py does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from forge.checkpoint import checkpoint_problem
from forge.errors import UserError
from forge.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = ["steps=3", "threads=1", "checkpoint.every=1", "checkpoint.keep_last=5", "eval.every=0", "eval.k=0",
        "eval.max_problems=8", "rollout.prompts_per_step=2", "rollout.group_size=2", "tracking.mlflow=false",
        "model.tiny.hidden=32", "model.tiny.layers=1"]  # fmt: skip


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _new(runs: Path, name: str, *settings: str) -> list[str]:
    return ["run", "--preset", "tiny", "--name", name, "--runs-dir", str(runs), "--quiet", "--no-prefect",
            *_sets(TINY + list(settings))]  # fmt: skip


def _resume(run: Path, *settings: str) -> list[str]:
    return ["run", "--name", run.name, "--resume", "--runs-dir", str(run.parent), "--quiet", "--no-prefect",
            *_sets(list(settings))]  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 3-step tiny run with every checkpoint kept (steps 1, 2, 3), made once."""
    runs = tmp_path_factory.mktemp("faults")
    assert main(_new(runs, "base")) == 0
    return runs / "base"


def _lines_upto(run: Path, step: int, name: str = "metrics.jsonl") -> list[bytes]:
    """The lines of `name` recorded for steps <= `step`, as bytes, in file order."""
    lines = (run / name).read_bytes().splitlines()
    return [line for line in lines if json.loads(line)["step"] <= step]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "checkpoint/"))} for r in rows]


def _same_metrics(a: Path, b: Path) -> None:
    x, y = _comparable(read_metrics(a / "metrics.jsonl")), _comparable(read_metrics(b / "metrics.jsonl"))
    assert [r["step"] for r in x] == [r["step"] for r in y]
    for p, q in zip(x, y, strict=True):
        assert p.keys() == q.keys(), p["step"]
        for k in p:
            assert p[k] == pytest.approx(q[k], rel=1e-5, abs=1e-6), (p["step"], k)


# ---------------------------------------------------------------- 1. resume never discards recorded progress


def _dangling(ckpts: Path) -> None:
    shutil.rmtree(ckpts / "step-000003")  # latest names it


def _garbage(ckpts: Path) -> None:
    (ckpts / "latest").write_bytes(b"\xff\xfe\x00garbage")
    shutil.rmtree(ckpts / "step-000003")


def _escapes(ckpts: Path) -> None:
    (ckpts / "latest").write_text("../../../etc\n")
    shutil.rmtree(ckpts / "step-000003")


def _damaged_target(ckpts: Path) -> None:
    weights = ckpts / "step-000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _missing(ckpts: Path) -> None:
    (ckpts / "latest").unlink()
    shutil.rmtree(ckpts / "step-000003")


RESUME_CASES = [
    ("dangling", _dangling, "latest names step-000003, which does not exist: using step-000002"),
    ("garbage", _garbage, "latest names unreadable bytes, not a step directory: using step-000002"),
    ("escapes", _escapes, "latest names '../../../etc', not a step directory: using step-000002"),
    ("damaged-target", _damaged_target, "names step-000003, which has a damaged model.safetensors (truncated"),
    ("missing", _missing, "latest is missing: using step-000002"),
]


@pytest.mark.parametrize("case", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_a_damaged_latest_resumes_from_the_newest_intact_checkpoint(case, finished, tmp_path, capsys):
    """Step 3's checkpoint is gone or damaged (or `latest` is): the resume continues from step 2 with one line,
    keeps every line recorded up to step 2 byte for byte, and redoes step 3 exactly."""
    _, damage, expected = case
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    damage(run / "checkpoints")
    kept, samples = _lines_upto(run, 2), _lines_upto(run, 2, "samples.jsonl")
    capsys.readouterr()
    assert main(_resume(run)) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forgeweave")]
    assert len(err) == 1 and expected in err[0], err
    assert err[0].endswith("using step-000002, the newest intact checkpoint")
    assert _lines_upto(run, 2) == kept and _lines_upto(run, 2, "samples.jsonl") == samples  # nothing rewritten
    _same_metrics(finished, run)  # step 3 redone exactly
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    assert checkpoint_problem(run / "checkpoints" / "step-000003") == ""


def test_a_damaged_newest_step_directory_without_latest_is_skipped(finished, tmp_path, capsys):
    """`latest` names step 2 (intact): used as it is, whatever a newer step directory holds (a killed copy)."""
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    (run / "checkpoints" / "step-000003" / "trainer_state.json").write_text("{")
    assert main(_resume(run)) == 0
    assert "newest intact" not in capsys.readouterr().err
    _same_metrics(finished, run)


def test_no_step_directory_starts_from_step_0(finished, tmp_path, capsys):
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    for ckpt in (run / "checkpoints").glob("step-*"):
        shutil.rmtree(ckpt)
    capsys.readouterr()
    assert main(_resume(run)) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forgeweave")]
    assert err == ["forgeweave: base has no checkpoint yet (" + str(run / "checkpoints" / "latest") + " names "
                   "step-000003, which does not exist): starting it from step 0"]  # fmt: skip
    _same_metrics(finished, run)


def test_no_intact_checkpoint_stops_with_one_line_and_changes_nothing(finished, tmp_path, capsys):
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    for ckpt in (run / "checkpoints").glob("step-*"):
        (ckpt / "checkpoint.json").write_text("not json")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_resume(run)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("forgeweave: error: "), err
    assert "latest names step-000003, which has a damaged checkpoint.json (missing, or not JSON), and no " in err
    assert "is intact (step-000002 has a damaged checkpoint.json (missing, or not JSON); step-000001 has" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_export_of_a_run_with_a_dangling_latest_exports_the_newest_intact_checkpoint(finished, tmp_path, capsys):
    """`forgeweave export RUN` follows a resume's rule: step 3 is gone, so step 2 is exported, with one line."""
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    _dangling(run / "checkpoints")
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forgeweave")]
    assert len(err) == 1 and "names step-000003, which does not exist: using step-000002" in err[0], err
    exported = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert exported == (run / "checkpoints" / "step-000002" / "model.safetensors").read_bytes()


def test_a_rollback_to_a_damaged_checkpoint_uses_the_newest_intact_one_before_it(finished, tmp_path, capsys):
    """The collapse guard's target is checked like a resume's: damaged -> the newest intact one before it."""
    from forge.guard import CollapseGuard
    from forge.loop import rollback_target

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        shutil.copytree(finished / "checkpoints" / "step-000001", root / f"step-{step:06d}")
        for name in ("checkpoint.json", "trainer_state.json"):
            info = json.loads((root / f"step-{step:06d}" / name).read_text())
            (root / f"step-{step:06d}" / name).write_text(json.dumps({**info, "step": step, "eval_pass@1": 0.25}))
    (root / "step-000004" / "model.safetensors").write_bytes(b"\x08")
    guard = CollapseGuard("rollback", best_step=4, held=(6, 0.5))

    class Record:
        run_dir = tmp_path

    ckpt, held = rollback_target(6, Record, guard)
    assert ckpt == root / "step-000002"
    err = capsys.readouterr().err.strip()
    assert err == (
        "forgeweave: step 6: collapse guard: the best probe's checkpoint step-000004 has a damaged model.safetensors "
        "(truncated: 1 bytes, shorter than its header says): using step-000002, the newest intact checkpoint before it"
    )
    assert held.score_at(6) == 0.25 and guard.score_at(6) == 0.5  # step 6's checkpoint: the weights it holds
    shutil.rmtree(root / "step-000002")
    with pytest.raises(UserError, match="there is no checkpoint before it to roll back to: set collapse.action=warn"):
        rollback_target(6, Record, guard)


# ---------------------------------------------------------------- 2. every weight file read is checked


@pytest.fixture
def truncated(finished, tmp_path) -> Path:
    """A copy of step 3's checkpoint whose model.safetensors is cut in half."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(finished / "checkpoints" / "step-000003", ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    return ckpt


@pytest.mark.parametrize("entry", ["model.path", "eval", "export", "export-in-place"])
def test_a_truncated_weight_file_is_one_line_naming_it(entry, truncated, tmp_path, capsys):
    argv = {
        "model.path": _new(tmp_path / "runs", "new", f"model.path={truncated}"),
        "eval": ["eval", str(truncated)],
        "export": ["export", str(truncated), str(tmp_path / "out")],
        "export-in-place": ["export", str(truncated)],
    }[entry]
    before = {p.name: p.read_bytes() for p in truncated.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"forgeweave: error: weight file '{truncated / 'model.safetensors'}' "
                                              "is damaged (truncated: its tensors need"), err  # fmt: skip
    assert "Traceback" not in err and ("copy the checkpoint again" in err or "set model.path to another" in err)
    assert {p.name: p.read_bytes() for p in truncated.iterdir() if p.is_file()} == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs" / "new").exists()


def test_a_weight_file_cut_inside_its_header_is_one_line(truncated, tmp_path, capsys):
    (truncated / "model.safetensors").write_bytes((truncated / "model.safetensors").read_bytes()[:100])
    assert main(_new(tmp_path / "runs", "new", f"model.path={truncated}")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.safetensors' is damaged (truncated: 100 bytes, shorter than its header" in err


def test_safetensors_problem_reads_headers_only(tmp_path):
    import torch
    from safetensors.torch import save_file

    from forge.io import safetensors_problem

    f = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.ones(2, 3)}, f)
    assert safetensors_problem(f) == ""
    data = f.read_bytes()
    f.write_bytes(data + b"\0")
    assert safetensors_problem(f).startswith("its tensors need 40 bytes of data and the file holds 41")
    f.write_bytes(data[:-1])
    assert safetensors_problem(f).startswith("truncated: its tensors need 40 bytes")
    f.write_bytes(b"\x10\0\0\0\0\0\0\0{not json at all")
    assert "not valid JSON" in safetensors_problem(f)


# ---------------------------------------------------------------- 3. disk full during a checkpoint write

LIMITED = """
import resource, signal, sys
import forge.checkpoint as ckpt
from flows.cli import main

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
limit, commit = int(sys.argv[1]), ckpt.commit

def commit_then_limit(tmp, final):  # the first checkpoint fits; from then on no file may grow past `limit`
    commit(tmp, final)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

ckpt.commit = commit_then_limit
sys.exit(main(sys.argv[2:]))
"""


def test_a_checkpoint_on_a_full_disk_is_one_line_and_resume_is_exact(tmp_path, capsys):
    """Checkpoint 2 meets a 40 kB file-size limit (its shard and weights are larger; metrics.jsonl stays below):
    one line naming the directory, the space needed and the intact previous checkpoint; `latest`, step 1 and every
    recorded line are intact; resumed without the limit, the run ends as the uninterrupted one."""
    runs = tmp_path / "runs"
    assert main(_new(runs, "straight", "steps=4")) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", LIMITED, "40000", *_new(runs, "full", "steps=4")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    run = runs / "full"
    assert proc.returncode == 2, proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert err[0].startswith(f"forgeweave: error: checkpoint step-000002 could not be written under '{run}/"
                             "checkpoints': File too large (it needs about "), err[0]  # fmt: skip
    assert err[0].endswith("checkpoints/latest still names step-000001, which is intact: free space (or raise the "
                           "file-size limit), then --resume")  # fmt: skip
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000001" and checkpoint_problem(ckpts / "step-000001") == ""
    assert not (ckpts / "step-000002").exists() and not list(ckpts.glob(".step-*"))  # the partial save is removed
    assert json.loads((run / "status.json").read_text())["state"] == "failed"
    recorded = (run / "metrics.jsonl").read_bytes()
    assert recorded.endswith(b"\n") and [json.loads(x)["step"] for x in recorded.splitlines()][:3] == [0, 1, 2]
    kept = _lines_upto(run, 1)
    capsys.readouterr()
    assert main(_resume(run)) == 0  # the limit is lifted (in-process: no limit here)
    assert _lines_upto(run, 1) == kept
    _same_metrics(runs / "straight", run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]  # every step once


APPEND = """
import resource, signal, sys
from forge.errors import DiskFull
from forge.io import append_text

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    append_text(sys.argv[1], '{"step": 2, "reward/mean": 0.25}\\n')
except DiskFull as e:
    print(e)
"""


def test_a_metrics_append_over_the_size_limit_leaves_no_half_line(tmp_path):
    """The limit lets 10 bytes of the 33-byte row through: they are cut back, and the error names the file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", APPEND, str(path), "22"], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == (f"cannot write '{path}': File too large (the write needed 33 B); free space (or "
                                  "raise the quota / file-size limit), then --resume"), out.stderr  # fmt: skip
    assert path.read_text() == '{"step": 1}\n'


# ---------------------------------------------------------------- a storage that fails is not a damaged checkpoint


def fail_reads(monkeypatch, bad: Path, times: int | None = None) -> dict[str, int]:
    """Make the first `times` reads of `bad` (None: every one) fail with EIO, through the ways forge reads a file
    (Path.read_text / read_bytes, open); returns the counts of reads of it ("read") and of those that failed."""
    import builtins
    import errno
    import pathlib

    import forge.io

    monkeypatch.setattr(forge.io, "READ_BACKOFF_S", 0.01)  # the tries, not the waits
    count = {"read": 0, "failed": 0}
    read_text, read_bytes, real_open = pathlib.Path.read_text, pathlib.Path.read_bytes, builtins.open

    def eio(path):
        if Path(path) == bad:
            count["read"] += 1
            if times is None or count["failed"] < times:
                count["failed"] += 1
                raise OSError(errno.EIO, "Input/output error", str(path))

    def failing_read_text(self, *args, **kwargs):
        eio(self)
        return read_text(self, *args, **kwargs)

    def failing_read_bytes(self):
        eio(self)
        return read_bytes(self)

    def failing_open(path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)):
            eio(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", failing_read_text)
    monkeypatch.setattr(pathlib.Path, "read_bytes", failing_read_bytes)
    monkeypatch.setattr(builtins, "open", failing_open)
    return count


def _in_run(run: Path, failing: str) -> Path:
    if failing == "metrics.jsonl":
        return run / "metrics.jsonl"
    return run / "checkpoints" / ("latest" if failing == "latest" else f"step-000003/{failing}")


@pytest.mark.parametrize("failing", ["latest", "checkpoint.json", "trainer_state.json", "model.safetensors"])
def test_a_read_error_on_resume_stops_and_changes_nothing(finished, tmp_path, monkeypatch, failing):
    """An I/O error (EIO) reading the newest checkpoint that persists through forge.io.READ_ATTEMPTS reads is the
    storage, not damage: no fall back to an older checkpoint (whose resume would cut the run's records and let
    retention delete the newer ones), one line."""
    from forge.checkpoint import resume_checkpoint
    from forge.errors import StorageError
    from forge.io import READ_ATTEMPTS

    root = tmp_path / "checkpoints"
    shutil.copytree(finished / "checkpoints", root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    reads = fail_reads(monkeypatch, _in_run(tmp_path, failing))
    with pytest.raises(StorageError, match=r"Input/output error while reading it: the storage failed, not the file "
                       r"\(3 reads failed\); retry once it answers \(nothing was changed\)$") as err:  # fmt: skip
        resume_checkpoint(root)
    assert "\n" not in str(err.value) and reads == {"read": READ_ATTEMPTS, "failed": READ_ATTEMPTS} == {
        "read": 3,
        "failed": 3,
    }
    monkeypatch.undo()
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert resume_checkpoint(root) == (root / "step-000003", "")  # once the storage answers: the newest, as before


@pytest.mark.parametrize("failing", ["latest", "checkpoint.json", "trainer_state.json", "model.safetensors",
                                     "metrics.jsonl"])  # fmt: skip
def test_a_read_that_fails_once_on_resume_is_retried_and_resumes_from_the_newest_checkpoint(
    finished, tmp_path, monkeypatch, capsys, failing
):
    """Issue 46, acceptance 5: the first read of a file the resume depends on fails with EIO, the second succeeds:
    the run resumes from step 3 (the newest checkpoint, no fall back, no line about it) and goes on to step 4;
    metrics.jsonl and samples.jsonl up to step 3 are kept byte for byte."""
    run = tmp_path / "runs" / "base"
    shutil.copytree(finished, run)
    kept, samples = _lines_upto(run, 3), _lines_upto(run, 3, "samples.jsonl")
    reads = fail_reads(monkeypatch, _in_run(run, failing), times=1)
    capsys.readouterr()
    assert main(_resume(run, "steps=4")) == 0
    assert reads["failed"] == 1 and reads["read"] >= 2  # failed once, read again
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("forgeweave")] == []
    assert _lines_upto(run, 3) == kept and _lines_upto(run, 3, "samples.jsonl") == samples  # history intact
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]  # step 4 after step 3, nothing redone
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-00000{i}" for i in range(1, 5)]


def test_only_a_read_the_storage_failed_is_tried_again(finished, tmp_path, monkeypatch):
    """forge.io.read_retrying retries an OSError that is not absence, READ_ATTEMPTS times in all; a missing file and
    what the read returned being damaged are not retried: a damaged checkpoint.json is read once and is damage."""
    import errno

    import forge.io
    from forge.io import read_retrying

    monkeypatch.setattr(forge.io, "READ_BACKOFF_S", 0.01)

    def failing(e: Exception):
        def read():
            tries.append(1)
            raise e

        return read

    for e, expected, n in [
        (OSError(errno.ESTALE, "Stale file handle"), "StorageError", 3),
        (OSError(errno.ENOENT, "No such file or directory"), "FileNotFoundError", 1),  # OSError picks the class
        (FileNotFoundError("No such file"), "FileNotFoundError", 1),  # as safetensors raises it: no errno
        (ValueError("not JSON"), "ValueError", 1),
    ]:
        tries: list[int] = []
        with pytest.raises(Exception) as err:
            read_retrying(tmp_path / "f", failing(e))
        assert (type(err.value).__name__, len(tries)) == (expected, n)
    ckpt = tmp_path / "step-000003"
    shutil.copytree(finished / "checkpoints" / "step-000003", ckpt)
    (ckpt / "checkpoint.json").write_text("{")
    reads = fail_reads(monkeypatch, ckpt / "checkpoint.json", times=0)
    assert checkpoint_problem(ckpt) == "has a damaged checkpoint.json (missing, or not JSON)"
    assert reads == {"read": 1, "failed": 0}
