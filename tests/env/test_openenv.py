"""OpenEnv environment servers (forge/env/openenv.py) against real openenv-core servers on 127.0.0.1, never a
stand-in: tests/env/openenv_server.py (the sum task's MCP environment, its typed-action twin, a 2-session cap, a slow
tool) and forge/tasks/openenv_sum.py. Acceptance 4 of issue 30: a tiny model trains against a server over WebSocket;
killing the server mid-run fails its episodes (counted), stops the run after reward.max_failing_steps steps with a
one-line error and keeps what was recorded; after a restart `--resume` continues exactly as an uninterrupted run.

The episode tests drive the episode loop with a scripted sampler (tests/env/test_episode.py's `scripted`): the tiny
random model rarely calls a tool, and these tests are about the server's side of a turn."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import forge
from forge.config import ConfigError, EnvConfig, RunConfig
from forge.env.chat import ChatFormat
from forge.env.config import OpenEnvConfig
from forge.env.episode import run_episodes
from forge.env.openenv import LocalServer, _free_port, connect, replica_sessions
from forge.env.rewards import env_reward
from forge.errors import UserError
from forge.listeners import foreign_listener
from forge.rollout.base import SamplingParams
from forge.tracking import read_metrics
from tests.env.test_episode import scripted

TEST_APP = "tests.env.openenv_server:app"
SUM_APP = "forge.tasks.openenv_sum:app"


def oe(**openenv) -> EnvConfig:
    """An env section whose environment is the OpenEnv server `openenv` (env.openenv's keys) names."""
    return EnvConfig(openenv=OpenEnvConfig(**openenv))


torch.set_num_threads(1)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def server():
    s = LocalServer.start(OpenEnvConfig(app=TEST_APP))
    yield s
    s.stop()


def play(tok, client, turns, rows=None, n=2, **limits):
    """params.n episodes per row (default: one row, answer 3) with the scripted turns, against `client`."""
    rows = rows or [{"prompt": "1+2=", "model_input": "1+2=", "answer": "3"}]
    cfg = EnvConfig(max_turns=limits.get("max_turns", 3), max_tokens=2000, tool_timeout_s=limits.get("timeout", 10.0))
    params = SamplingParams(max_new_tokens=64, n=n, seed=0)
    return run_episodes(scripted(tok, turns), tok, rows, params, cfg, ChatFormat(tok, use_template=False), client, [],
                        version=0)  # fmt: skip


def test_an_mcp_servers_tools_answer_the_calls_and_its_reward_and_done_end_the_episode(server, tok):
    client = connect(oe(url=server.url), episodes=4)
    assert client.mcp and client.max_sessions == 4 and [s["function"]["name"] for s in client.schemas] == ["check"]
    # turn 1 a wrong guess, turn 2 an argument the tool refuses (an MCP tool error), turn 3 the right guess: done
    ro = play(tok, client, [call("check", guess=2), call("check", guess="x"), call("check", guess=3), "3"],
              max_turns=4)  # fmt: skip
    assert ro.prompts[0].startswith("<tools>check(guess: integer)</tools>")
    assert ro.episodes.turns == [3, 3] and ro.episodes.tool_calls == [3, 3] and ro.episodes.tool_errors == [1, 1]
    answers = [t["content"] for t in ro.episodes.transcripts[0] if t["role"] == "tool"]
    assert answers[0] == "wrong" and answers[1].startswith("Error: tool 'check':") and answers[2] == "right"
    envs = ro.episodes.environments
    assert [e.reward for e in envs] == [1.0, 1.0] and envs[0].rewards == [0.0, 1.0] and all(e.done for e in envs)
    assert ro.finish_reasons == ["stop", "stop"] and ro.episodes.failures == ["", ""]
    assert env_reward(["q"] * 2, ro.texts, environments=envs) == [1.0, 1.0]
    assert all(e.session is None for e in envs)  # closed at the episode's end


def test_an_environment_with_its_own_action_gets_one_step_tool_with_the_action_schema(server, tok):
    client = connect(oe(url=server.url + "/guess"), episodes=2)
    assert not client.mcp
    (schema,) = client.schemas
    assert schema["function"]["name"] == "step" and list(schema["function"]["parameters"]["properties"]) == ["guess"]
    ro = play(tok, client, [call("step", guess=2), call("step", guess=3), "3"])
    assert [t["content"] for t in ro.episodes.transcripts[0] if t["role"] == "tool"] == ["wrong", "right"]
    assert [e.reward for e in ro.episodes.environments] == [1.0, 1.0] and ro.episodes.turns == [2, 2]


def test_the_servers_session_cap_is_found_at_start_and_kept(server, tok):
    client = connect(oe(url=server.url + "/capped"), episodes=8)
    assert client.max_sessions == 2  # the server refused the third session it was asked for
    rows = [{"prompt": f"{a}+0=", "model_input": f"{a}+0=", "answer": str(a)} for a in range(4)]
    ro = play(tok, client, [call("check", guess=9), "9"], rows=rows, n=2)
    # 8 episodes of two turns, each a session the server would refuse beyond 2 at once: none failed
    assert ro.episodes.failures == [""] * 8 and ro.episodes.turns == [2] * 8
    with pytest.raises(UserError, match="env.openenv.max_sessions=3, but .* accepts only 2 sessions") as err:
        connect(oe(url=server.url + "/capped", max_sessions=3), episodes=8)
    assert "\n" not in str(err.value)
    # Ray's rollout replicas share the cap evenly (the driver finds it once); more replicas than sessions: one line
    assert replica_sessions(oe(url=server.url + "/capped"), episodes=8, replicas=2) == 1
    with pytest.raises(UserError, match=r"holds 2 sessions at once, fewer than rollout.replicas=3 \(one each\)"):
        replica_sessions(oe(url=server.url + "/capped"), episodes=8, replicas=3)


def test_episodes_travel_to_another_process_without_their_session_or_server(tok):
    """Ray pickles the episodes' environments for the reward actor: what the server said goes, the socket and the
    server process stay; the server is still stopped by the process that started it."""
    client = connect(oe(app=SUM_APP), episodes=2)
    try:
        ro = play(tok, client, [call("check", guess=3), "3"])
        env = ro.episodes.environments[0]
        env.session = client.server  # even an episode caught mid-session travels without it
        copy = pickle.loads(pickle.dumps(ro.episodes.environments))
        assert [(e.reward, e.rewards, e.done, e.session) for e in copy] == [(1.0, [1.0], True, None)] * 2
        assert copy[0].client.server is None and copy[0].client.url == client.url
    finally:
        client.close()
    assert client.server.proc.poll() is not None


def test_a_tool_call_past_the_timeout_is_an_error_answer_and_the_session_goes_on(server, tok):
    client = connect(EnvConfig(openenv=OpenEnvConfig(url=server.url + "/slow"), tool_timeout_s=0.3), episodes=1)
    ro = play(tok, client, [call("wait", seconds=1.0), call("wait", seconds=0), "done"], n=1, timeout=0.3)
    answers = [t["content"] for t in ro.episodes.transcripts[0] if t["role"] == "tool"]
    # the late answer to the first call is read and dropped: the second call gets its own
    assert answers == ["Error: tool 'wait' timed out after 0.3 s", "slept 0"]
    assert ro.episodes.tool_errors == [1] and ro.episodes.failures == [""]


def test_a_server_dying_mid_episode_fails_the_episodes_in_flight(tok):
    own = LocalServer.start(OpenEnvConfig(app=SUM_APP))
    client = connect(oe(url=own.url), episodes=2)
    turns = scripted(tok, [call("check", guess=2), call("check", guess=3)])

    # the second turn: the server is killed before the policy's call reaches it
    def sample(contexts, params, seeds=None):
        if any(tok.eos_token_id in c for c in contexts):
            os.kill(own.pid, signal.SIGKILL)
            own.proc.wait()
        return turns(contexts, params)

    cfg = EnvConfig(max_turns=3, max_tokens=400)
    rows = [{"prompt": "1+2=", "model_input": "1+2=", "answer": "3"}]
    ro = run_episodes(sample, tok, rows, SamplingParams(max_new_tokens=64, n=2, seed=0), cfg, ChatFormat(tok, False),
                      client, [], version=0)  # fmt: skip
    own.stop()
    assert ro.finish_reasons == ["error", "error"] and ro.episodes.turns == [2, 2]
    assert all(f.startswith(f"OpenEnv server {own.url}: step: ") for f in ro.episodes.failures)
    assert ro.loss_mask.sum() == 0 and ro.episodes.masked == [True, True]  # not trained on


def _sets(url: str, steps: int) -> list[str]:
    return [f"steps={steps}", "threads=1", "tracking.mlflow=false", "env.environment_factory=",
            f"env.openenv.url={url}", "reward.verifiers=[env_reward,math_answer]", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "data.train_size=64", "eval.every=0", "eval.max_problems=4"]  # fmt: skip


def test_an_unreachable_server_a_command_that_dies_and_bad_keys_are_one_line_naming_them(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(UserError, match=f"env.openenv.url='{url}': no OpenEnv server answers {url}/health") as err:
        forge.train(preset="tiny-multiturn", overrides=_sets(url, 1), run_dir=tmp_path / "a", progress=False)
    assert "\n" not in str(err.value)
    command = f"{sys.executable} -c 'import sys; sys.exit(3)' {{port}}"
    with pytest.raises(UserError, match="env.openenv.command=.*exited with code 3") as err:
        connect(oe(command=command), episodes=1)
    assert "\n" not in str(err.value)
    for sets, key in [
        ({"openenv.url": url, "openenv.app": SUM_APP}, "env.openenv.app"),
        ({"openenv.command": "serve --port 8000"}, "env.openenv.command"),
        ({"openenv.url": "127.0.0.1:8000"}, "env.openenv.url"),
        ({"openenv.app": SUM_APP, "environment_factory": "forge.tasks.multiturn:SumEnv"}, "env.environment_factory"),
    ]:
        cfg = RunConfig()
        for k, v in sets.items():
            section, _, name = k.rpartition(".")
            setattr(getattr(cfg.env, section) if section else cfg.env, name, v)
        with pytest.raises(ConfigError, match=f"config key '{key}'"):
            cfg.validate()
    cfg = RunConfig()
    cfg.env.openenv.url, cfg.env.openenv.max_sessions, cfg.rollout.replicas = url, 1, 2  # replicas share its sessions
    with pytest.raises(ConfigError, match="config key 'env.openenv.max_sessions' is 1, fewer than rollout.replicas=2"):
        cfg.validate()
    cfg.rollout.backend, cfg.env.openenv.max_sessions = "vllm", 2  # any backend, in Ray's actors too
    cfg.validate()


def test_a_port_another_process_holds_is_never_taken_for_the_server_forgeweave_starts(tmp_path):
    """Issue 46: a local process that listens on the port first, and even answers /health, is not the server. An
    app's socket is bound by forgeweave before the server starts (a taken port is one line); a command that never
    binds its port while a squatter answers /health there is refused once /health answers (the listener is not in
    the started server's process group) and stopped."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "healthy"}')

        def log_message(self, *args):
            pass

    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    port = squatter.server_address[1]
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match=rf"^OpenEnv server: 127\.0\.0\.1:{port} is taken \(") as err:
            LocalServer.start(OpenEnvConfig(app=SUM_APP), port=port)
        assert "\n" not in str(err.value)
        command = f"{sys.executable} -c 'import time; time.sleep(60)' {{port}}"  # never binds {port}
        with pytest.raises(UserError, match=rf"is answered by another process \(pid {os.getpid()}\), not the server") as err:
            LocalServer.start(OpenEnvConfig(command=command), port=port)
        assert "\n" not in str(err.value) and not _children("time.sleep(60)")  # the started one was stopped
    finally:
        squatter.shutdown()
        squatter.server_close()
    own = LocalServer.start(OpenEnvConfig(app=SUM_APP))  # the usual way: a free port, served from forgeweave's socket
    try:
        assert foreign_listener(int(own.url.rsplit(":", 1)[1]), own.pid) == ""
    finally:
        own.stop()


def _children(marker: str) -> list[int]:
    """PIDs of this process's children whose command line holds `marker`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and marker in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_a_tiny_model_trains_against_a_server_forgeweave_starts_and_stops(tmp_path):
    sets = [s for s in _sets("", 3) if not s.startswith("env.openenv.url")] + [f"env.openenv.app={SUM_APP}"]
    forge.train(preset="tiny-multiturn", overrides=sets, run_dir=tmp_path / "run", progress=False)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 3 and all(r["env/turns"] >= 1 and r["env/failed"] == 0 for r in rows)
    assert all("reward/env_reward/mean" in r and "train/loss" in r for r in rows)
    assert not _children(SUM_APP)  # the server forgeweave started was stopped with the run


def test_the_cli_and_a_config_file_point_at_a_server(server, runs_dir):
    from flows.cli import main

    config = runs_dir.parent / "run.yaml"
    config.write_text("preset: tiny-multiturn\nenv:\n  environment_factory: ''\n  openenv:\n    max_sessions: 4\n")
    argv = ["run", "--config", str(config), "--name", "oe", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    sets = [s for s in _sets(server.url, 2) if s != "env.environment_factory="]  # env.openenv.url by --set
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    rows = [r for r in read_metrics(runs_dir / "oe" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["env/failed"] == 0 for r in rows)
    saved = yaml.safe_load((runs_dir / "oe" / "config.yaml").read_text())["env"]["openenv"]
    assert (saved["url"], saved["max_sessions"]) == (server.url, 4)


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "checkpoint/")) and k != "env/seconds"}


def _kill_after_checkpoint(run: Path, step: int, server: LocalServer, done: threading.Event) -> None:
    """Kill `server` (SIGKILL, by its PID) as soon as checkpoint `step` is recorded in run's metrics.jsonl."""
    while not done.is_set():
        rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        if any(r["step"] == step and "checkpoint/bytes" in r for r in rows):
            os.kill(server.pid, signal.SIGKILL)
            return
        time.sleep(0.005)


@pytest.mark.slow
def test_killing_the_server_mid_run_stops_it_after_the_failing_steps_and_resume_continues_exactly(tmp_path):
    port = _free_port()
    server = LocalServer.start(OpenEnvConfig(app=SUM_APP), port=port)
    # checkpoints every 4 steps, stop after 2 all-failed steps: the kill right after checkpoint 4 stops the run before
    # checkpoint 8, so the resume starts from 4 (no checkpoint holds an update made with failed episodes)
    sets = _sets(server.url, 10) + ["checkpoint.every=4", "checkpoint.async_save=false", "reward.max_failing_steps=2"]
    try:
        forge.train(preset="tiny-multiturn", overrides=sets, run_dir=tmp_path / "straight", progress=False)
        run, done = tmp_path / "killed", threading.Event()
        killer = threading.Thread(target=_kill_after_checkpoint, args=(run, 4, server, done), daemon=True)
        killer.start()
        with pytest.raises(UserError) as err:
            forge.train(preset="tiny-multiturn", overrides=sets, run_dir=run, progress=False)
        done.set()
        message = str(err.value)
        assert "the environment failed every episode for 2 steps in a row (reward.max_failing_steps=2)" in message
        assert f"OpenEnv server {server.url}" in message and "--resume" in message and "\n" not in message
        assert json.loads((run / "status.json").read_text())["state"] == "failed"
        kept = [r for r in read_metrics(run / "metrics.jsonl") if "reward/mean" in r]
        assert [r["step"] for r in kept[:4]] == [1, 2, 3, 4] and all(r["env/failed"] == 0 for r in kept[:4])
        failed = [r for r in kept if r["env/failed"] > 0]
        assert failed and failed[-1]["env/failed"] == 16 and failed[-1]["reward/mean"] == 0.0
        assert failed[-1]["reward/env_reward/failures"] == 16
        assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000004"]

        server.stop()
        server = LocalServer.start(OpenEnvConfig(app=SUM_APP), port=port)  # back at the same address
        forge.train(run_dir=run, resume=True, progress=False)
    finally:
        server.stop()
    straight = {r["step"]: _comparable(r) for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")}
    resumed = {r["step"]: _comparable(r) for r in read_metrics(run / "metrics.jsonl")}
    assert sorted(resumed) == list(range(11)) and all(resumed[s]["env/failed"] == 0 for s in range(1, 11))
    for step in range(5, 11):
        a, b = straight[step], resumed[step]
        assert a.keys() == b.keys(), step
        for k in a:  # None: a mean over nothing (env_reward scores None where the policy never called check)
            assert a[k] == b[k] if a[k] is None else a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (step, k)


def guesses(tok, turns: list[str], eos: bool = True):
    """A sampler that replies turns[k] (+ eos unless `eos` is False: cut by rollout.max_new_tokens), k = the
    server's "wrong" answers so far in the episode's context."""

    def sample(contexts, params, seeds=None):
        out = []
        for ctx in contexts:
            k = tok.decode(ctx).count("wrong")
            ids = tok(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * eos
            out.append((ids, [-0.5] * len(ids)))
        return out

    return sample


def play_text(tok, server, turns, eos=True, **env):
    cfg = EnvConfig(openenv=OpenEnvConfig(url=server.url + "/text", text_action="message"), max_turns=3,
                    max_tokens=2000, **env)  # fmt: skip
    client = connect(cfg, episodes=2)
    rows = [{"prompt": "1+2=", "model_input": "1+2=", "answer": "3"}]
    params = SamplingParams(max_new_tokens=64, n=2, seed=0)
    ro = run_episodes(guesses(tok, turns, eos), tok, rows, params, cfg, ChatFormat(tok, use_template=False), client,
                      [], version=0)  # fmt: skip
    return client, ro


def test_a_text_action_server_is_answered_with_plain_replies(server, tok):
    """Issue 44: env.openenv.text_action=message: no tool is offered (the prompt has no tools line), each plain reply
    is a step {"message": reply}, the observation's text comes back as a user turn until the server says done. The
    reset observation (the instruction) follows the prompt and is the transcript's first segment (role environment).
    A reply that looks like a tool call is still a message."""
    from tests.env.openenv_server import TEXT_INSTRUCTION

    client, ro = play_text(tok, server, ["2", '{"name": "check", "arguments": {}}', "3"])
    assert client.schemas == [] and ro.prompts[0] == "1+2=" + TEXT_INSTRUCTION
    e = ro.episodes
    assert e.turns == [3, 3] and e.tool_calls == [0, 0] and ro.finish_reasons == ["stop", "stop"]
    assert [(s["role"], s["content"]) for s in e.transcripts[0]] == [
        ("environment", TEXT_INSTRUCTION), ("assistant", "2"), ("user", "wrong, try again"),
        ("assistant", '{"name": "check", "arguments": {}}'), ("user", "wrong, try again"), ("assistant", "3"),
    ]  # fmt: skip
    assert [env.reward for env in e.environments] == [1.0, 1.0] and all(env.done for env in e.environments)
    assert env_reward(["q"] * 2, ro.texts, environments=e.environments) == [1.0, 1.0]


def test_a_cut_reply_goes_to_the_text_action_with_cut_reply_continue(server, tok):
    """Replies cut by rollout.max_new_tokens (no eos): by default the first ends the episode (the server never sees
    it); with env.cut_reply=continue each is sent as the message, and the third is right."""
    _, ro = play_text(tok, server, ["2", "1", "3"], eos=False)
    assert ro.episodes.turns == [1, 1] and ro.episodes.cut_turns == [1, 1]
    assert [env.reward for env in ro.episodes.environments] == [None, None]
    _, ro = play_text(tok, server, ["2", "1", "3"], eos=False, cut_reply="continue")
    assert ro.episodes.turns == [3, 3] and ro.episodes.cut_turns == [3, 3] and ro.finish_reasons == ["length"] * 2
    assert [env.reward for env in ro.episodes.environments] == [1.0, 1.0]


def test_text_action_keys_that_cannot_work_are_one_line(server):
    with pytest.raises(UserError, match="env.openenv.text_action='message': .* is an MCP environment"):
        connect(oe(url=server.url, text_action="message"), episodes=1)
    with pytest.raises(UserError, match=r"has no text field 'text'; its fields: \['message'\]"):
        connect(oe(url=server.url + "/text", text_action="text"), episodes=1)
    with pytest.raises(UserError, match=r"has no text field 'guess'"):  # an integer field
        connect(oe(url=server.url + "/guess", text_action="guess"), episodes=1)
    cfg = RunConfig()
    cfg.env.openenv.text_action = "message"
    with pytest.raises(ConfigError, match="config key 'env.openenv.text_action' applies to an OpenEnv server"):
        cfg.validate()


def test_a_model_that_never_calls_tools_trains_against_a_text_action_server(server, tmp_path):
    """Acceptance 2 of issue 44 on the tiny model: the text server (tests/env/openenv_server.py `/text`) plays
    every episode by its replies (cut ones too: env.cut_reply=continue, the random model rarely ends a turn in 3
    tokens); the server's reward (env_reward) is scored and the update runs."""
    sets = _sets(server.url + "/text", 2) + ["env.openenv.text_action=message", "rollout.max_new_tokens=3",
                                              "env.cut_reply=continue"]  # fmt: skip
    forge.train(preset="tiny-multiturn", overrides=sets, run_dir=tmp_path / "run", progress=False)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["env/turns"] >= 1 and r["env/failed"] == 0 for r in rows)
    assert all(r["env/tool_calls"] == 0 and "train/loss" in r and r["env/cut_frac"] > 0 for r in rows)
    assert all(r["env/turns"] > 1 and "reward/env_reward/mean" in r for r in rows)  # the server answered replies
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["transcript"][0]["role"] == "environment"


# (raw JSON a server sends as the reward, how the failure line shows it): tests/env/openenv_server.py's `/raw` splices
# it into its answer as it is; openenv-core's own classes could not send it (pydantic refuses or writes null)
BAD_REWARDS = [
    ("1e309", "the number inf"),  # beyond float: Python's json reads inf
    ("-Infinity", "the number -inf"),
    ("NaN", "the number nan"),
    ('"1.0"', 'the string "1.0"'),
    ("[1, 2]", "the array [1, 2]"),
    ('{"r": 1}', 'the object {"r": 1}'),
]


def test_a_reward_that_is_not_a_finite_number_fails_its_episode_in_one_line(server, tok):
    """Issue 46, acceptance 4: a reward that is not a finite number, in a step's answer or in reset's, fails that
    episode (finish reason "error", out of the loss, unscored: reward 0, no NaN reaches the advantages) with one line
    naming the request, the field and what came; the other episodes play on. A bool is a reward (openenv-core's
    `Observation.reward` is `bool | int | float | None`)."""
    from forge.rewards.config import RewardConfig
    from forge.workers import RewardWorker

    row = {"prompt": "1+2=", "model_input": "1+2=", "answer": "3", "reset_reward": "null", "step_reward": "null"}
    good = [("1", 1.0), ("true", 1.0), ("0.25", 0.25)]
    rows = [{**row, "step_reward": raw} for raw, _ in BAD_REWARDS + good]
    rows += [{**row, "reset_reward": "1e309"}, {**row, "reset_reward": '"high"'}]
    client = connect(oe(url=server.url + "/raw"), episodes=2 * len(rows))
    ro = play(tok, client, [call("check", guess=3), "3"], rows=rows, n=2)  # episodes 2i, 2i + 1: row i's
    e, bad = ro.episodes, 2 * len(BAD_REWARDS)
    where = f"OpenEnv server {server.url}/raw: "
    step_lines = [
        f"{where}step: the answer's reward is not a finite number (received {shown})" for _, shown in BAD_REWARDS
    ]
    reset_lines = [f"{where}reset: the answer's reward is not a finite number (received the number inf)",
                   f"{where}reset: the answer's reward is not a finite number (received the string \"high\")"]  # fmt: skip
    assert e.failures == twice(step_lines + [""] * 3 + reset_lines) and all("\n" not in f for f in e.failures)
    assert ro.finish_reasons == ["error"] * bad + ["stop"] * 6 + ["error"] * 4
    assert e.turns == [1] * (bad + 6) + [0] * 4 and e.tool_calls == e.turns
    assert [env.reward for env in e.environments] == [None] * bad + twice([r for _, r in good]) + [None] * 4
    assert all(env.rewards == [] for env in e.environments[:bad]) and all(env.session is None for env in e.environments)
    sampled = ro.loss_mask.sum(dim=1)  # [N]: tokens trained on
    assert sampled[:bad].eq(0).all() and sampled[bad : bad + 6].gt(0).all() and sampled[bad + 6 :].eq(0).all()
    worker = RewardWorker(RewardConfig(verifiers=["env_reward"]), advantage="zscore", seed=0, steps=1,
                          prompts_per_step=len(rows))  # fmt: skip
    scored = worker.score(rows, ro, 1)
    assert scored.rewards.tolist() == [0.0] * bad + twice([1.0, 1.0, 0.25]) + [0.0] * 4
    assert scored.verifier_failures == {"env_reward": bad + 4} and torch.isfinite(scored.advantages).all()


def test_answers_nested_too_deeply_or_with_data_that_is_no_object_fail_their_episode(server, tok):
    """A reset answer of 100,000 nested `[` (json's RecursionError) or whose data is a string fails its episode in one
    line instead of ending the run."""
    answers = ["[" * 100_000, '{"type": "observation", "data": "x"}']
    rows = [{"prompt": "1+2=", "model_input": "1+2=", "answer": "3", "reset_answer": a} for a in answers]
    ro = play(tok, connect(oe(url=server.url + "/raw"), episodes=2), ["3"], rows=rows, n=1)
    where = f"OpenEnv server {server.url}/raw: reset: "
    assert ro.episodes.failures == [
        f"{where}the server sent something that is not JSON: {'[' * 100!r}",
        f"{where}the server's answer has data that is not a JSON object: {answers[1]!r}",
    ]
    assert ro.finish_reasons == ["error", "error"] and ro.episodes.turns == [0, 0]


def twice(xs: list) -> list:
    return [x for x in xs for _ in range(2)]


def test_a_run_goes_on_when_the_server_sends_bad_rewards(server, tmp_path):
    """Issue 46, acceptance 4, in a run: `/raw` answers every second reset with a reward of 1e309 or "high"
    (RAW_RESET_REWARDS): those episodes are counted (env/failed) and unscored, the rest train, the run finishes."""
    forge.train(preset="tiny-multiturn", overrides=_sets(server.url + "/raw", 2), run_dir=tmp_path / "run",
                progress=False)  # fmt: skip
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["env/failed"] for r in rows] == [8.0, 8.0]  # 16 episodes a step, every second one refused
    assert all(r["reward/env_reward/failures"] >= 8 and "train/loss" in r for r in rows)
    assert all(isinstance(r[k], float) for r in rows for k in ("reward/mean", "train/loss"))
