"""How the update ranks are launched and how a failure is told (no processes started here)."""

from __future__ import annotations

import json

from forge.config import RunConfig
from forge.distributed.remote import diagnose, launch_args, update_processes, worker_env

LAUNCHER_REPORT = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  time      : 2026-11-29_18:42:46
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 25359)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_18:42:46
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 25360)  (SIGKILL)
"""


def test_cpu_ranks_are_launched_synchronised():
    # `--cpu --num_processes 2` starts ONE process; --multi_gpu + ACCELERATE_USE_CPU=1 starts 2 synced gloo ranks
    args = launch_args(2, 29555, gpu=False)
    assert args[:3] == ["--multi_gpu", "--num_processes", "2"] and "--cpu" not in args
    assert args[args.index("--mixed_precision") + 1] == "no"
    env = worker_env(RunConfig(threads=1), 2, gpu=False, plan=None)
    assert env["ACCELERATE_USE_CPU"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert launch_args(8, 29555, gpu=True)[launch_args(8, 29555, gpu=True).index("--mixed_precision") + 1] == "bf16"


def test_process_count_comes_from_config_then_plan_then_one():
    plan = {"assignments": [{"stage": "update", "kind": "gpu", "placements": [{"processes": 4}, {"processes": 4}]}]}
    cfg = RunConfig()
    assert cfg.update.num_processes == 0
    assert update_processes(cfg, plan) == 8
    assert update_processes(cfg, None) == 1
    cfg.update.num_processes = 2
    assert update_processes(cfg, plan) == 2


def test_a_peer_error_is_not_blamed_when_another_rank_was_killed(tmp_path):
    """Rank 1 was SIGKILLed mid-update; rank 0's collective then failed ("closed by peer") and the launcher
    stopped it: the message names rank 1."""
    (tmp_path / "rank-0.error.json").write_text(
        json.dumps({"rank": 0, "time": 1.0, "error": "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]"})
    )
    log = tmp_path / "trainer.log"
    log.write_text(LAUNCHER_REPORT)
    msg = diagnose(tmp_path, log, 2, 1, "rank 0 closed its connection")
    assert msg.startswith("update rank 1 of 2 failed: killed by SIGKILL (exit code -9)"), msg
    assert str(log) in msg


def test_a_rank_own_error_is_named(tmp_path):
    (tmp_path / "rank-1.error.json").write_text(json.dumps({"rank": 1, "time": 2.0, "error": "ValueError: bad"}))
    (tmp_path / "rank-0.error.json").write_text(
        json.dumps({"rank": 0, "time": 3.0, "error": "DistBackendError: remote worker crashed"})
    )
    msg = diagnose(tmp_path, tmp_path / "missing.log", 2, 1, "x")
    assert msg.startswith("update rank 1 of 2 failed: ValueError: bad")


def test_no_information_still_says_what_happened(tmp_path):
    msg = diagnose(tmp_path, tmp_path / "missing.log", 2, 3, "the update processes did not start")
    assert msg.startswith("update failed: the update processes did not start (launcher exit code 3)")
