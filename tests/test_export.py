"""`forgeweave export` and hub ids: a clean HF directory (LoRA merged) that AutoModelForCausalLM loads and that
computes what the checkpoint computes; `--step`, the older `CKPT --out DIR` form, atomicity, `--push-to-hub`
offline / unreachable, and a hub id for model.path that cannot be fetched. Nothing here reaches a network: the
"unreachable hub" is a closed port on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.cli import main
from forge.checkpoint import ADAPTER, is_adapter, merged_policy
from forge.config import load_yaml
from forge.data import read_split
from forge.evaluate import evaluate
from forge.models import load_policy
from forge.rollout import make_backend
from tests.servers import REPO

torch.set_num_threads(1)

SETTINGS = ["steps=3", "threads=1", "checkpoint.every=2", "checkpoint.keep_last=3", "eval.every=0", "eval.k=0",
            "eval.max_problems=16", "rollout.prompts_per_step=4", "model.tiny.hidden=32", "model.tiny.layers=1",
            "tracking.mlflow=false"]  # fmt: skip


def _run(runs: Path, name: str, *extra: str) -> Path:
    sets = [a for s in SETTINGS + list(extra) for a in ("--set", s)]
    assert main(["run", "--preset", "tiny", "--name", name, "--runs-dir", str(runs), "--quiet", "--no-prefect",
                 *sets]) == 0  # fmt: skip
    return runs / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    _run(root, "lora", "model.lora.rank=4", "update.lr=3e-2")
    _run(root, "full")
    return root


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("forgeweave: error: "), err
    return err[0]


def _greedy(model, tok, prompts: list[str]) -> list[list[int]]:
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.eval().generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[:, enc.input_ids.shape[1] :].tolist()


def _pass1(model, tok, run: Path) -> dict:
    cfg = load_yaml(run / "config.yaml")
    report = evaluate(make_backend("hf", model, tok, rollout=cfg.rollout), read_split(run, "eval"), cfg.eval,
                      cfg.rollout, seed=cfg.seed)  # fmt: skip
    return {k: report[k] for k in ("pass@1", "mean_completion_tokens")} | {
        "completions": [s["completion"] for s in report["samples"]]
    }


def test_lora_export_is_a_merged_hf_directory_that_scores_the_same(runs, tmp_path, capsys):
    run = runs / "lora"
    ckpt = run / "checkpoints" / "step-000003"
    assert is_adapter(ckpt)
    assert main(["export", "lora", str(tmp_path / "hf"), "--runs-dir", str(runs)]) == 0  # latest = step 3
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'hf'}"
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]  # fmt: skip
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", padding_side="left")
    assert not hasattr(exported, "peft_config") and "lora" not in " ".join(exported.state_dict())
    # the checkpoint as the run held it: base model + adapter through peft, not merged
    cfg = load_yaml(run / "config.yaml")
    from peft import PeftModel

    base, run_tok = load_policy(cfg.model, seed=cfg.seed)
    peft_model = PeftModel.from_pretrained(base, ckpt)
    prompts = [r["model_input"] for r in read_split(run, "eval")[:16]]
    assert _greedy(exported, tok, prompts) == _greedy(peft_model, run_tok, prompts)
    # the adapter moved: the export is not the base model
    plain, _ = load_policy(cfg.model, seed=cfg.seed)
    diff = max((exported.state_dict()[k] - v).abs().max() for k, v in plain.state_dict().items())
    assert diff > 1e-4
    # the same eval report as `forgeweave eval` of the checkpoint (merged in memory)
    merged, _ = merged_policy(ckpt, cfg.model, cfg.seed)
    assert _pass1(exported, tok, run) == _pass1(merged, run_tok, run)


def test_export_step_and_errors(runs, tmp_path, capsys):
    assert main(["export", str(runs / "lora"), str(tmp_path / "s2"), "--step", "2", "--runs-dir", str(runs)]) == 0
    capsys.readouterr()
    two = AutoModelForCausalLM.from_pretrained(tmp_path / "s2").state_dict()
    assert main(["export", "lora", str(tmp_path / "s3"), "--runs-dir", str(runs)]) == 0
    three = AutoModelForCausalLM.from_pretrained(tmp_path / "s3").state_dict()
    assert any(not torch.equal(two[k], three[k]) for k in two)
    capsys.readouterr()
    assert main(["export", "lora", str(tmp_path / "x"), "--step", "7", "--runs-dir", str(runs)]) == 2
    assert "no checkpoint at step 7 (it has: step-000002, step-000003)" in _error(capsys)
    assert main(["export", "lora", str(tmp_path / "s2"), "--runs-dir", str(runs)]) == 2  # OUT exists
    assert "exists and is not an empty directory" in _error(capsys)
    ckpt = runs / "lora" / "checkpoints" / "step-000003"
    assert main(["export", str(ckpt)]) == 2  # an adapter cannot be exported in place
    assert "give OUT" in _error(capsys)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary directory left behind


def test_full_finetune_export_by_run_and_by_checkpoint_dir(runs, tmp_path, capsys):
    run = runs / "full"
    ckpt = run / "checkpoints" / "step-000003"
    assert not is_adapter(ckpt)
    (ckpt / "chat_template.jinja").write_text("{{ messages }}")  # transformers 5 keeps a chat template beside the json
    assert main(["export", "full", str(tmp_path / "a"), "--runs-dir", str(runs)]) == 0
    assert main(["export", str(ckpt), "--out", str(tmp_path / "b")]) == 0  # the older usage
    for out in ("a", "b"):
        assert not list((tmp_path / out).glob("trainer_state*")) and not (tmp_path / out / "state").exists()
        assert (tmp_path / out / "chat_template.jinja").read_text() == "{{ messages }}"
        assert not (tmp_path / out / "checkpoint.json").exists()
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    model, tok = load_policy(load_yaml(run / "config.yaml").model.__class__(path=str(ckpt)))
    prompts = [r["model_input"] for r in read_split(run, "eval")[:8]]
    assert _greedy(a, tok, prompts) == _greedy(b, tok, prompts) == _greedy(model, tok, prompts)


def test_push_to_hub_offline_writes_nothing(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["export", "lora", str(tmp_path / "hf"), "--push-to-hub", "me/tiny", "--runs-dir", str(runs)])
    assert code == 2
    assert "HF_HUB_OFFLINE is set, so nothing was exported or pushed" in _error(capsys)
    assert not (tmp_path / "hf").exists()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def _offline_env(tmp_path: Path, **extra: str) -> dict:
    """A fresh HF cache and no HF_HUB_OFFLINE: what a user's shell has."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    return {**env, "PYTHONPATH": str(REPO), "HF_HOME": str(tmp_path / "hf-home"), **extra}


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip


@pytest.mark.slow  # the hub client retries the refused connection with backoff (~30 s)
def test_push_to_hub_unreachable_is_one_line_and_writes_nothing(runs, tmp_path):
    env = _offline_env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_TOKEN="hf_not_a_real_token")
    out = tmp_path / "hf"
    res = _cli(env, "export", "lora", str(out), "--push-to-hub", "me/tiny", "--runs-dir", str(runs))
    assert res.returncode == 2, res.stderr
    err = [line for line in res.stderr.splitlines() if line.startswith("forgeweave: error")]
    assert (
        len(err) == 1
        and res.stderr.strip().endswith(err[0])
        and "--push-to-hub me/tiny: the hub cannot be used from here" in err[0]
    ), err
    assert "nothing was exported or pushed" in err[0] and not out.exists()


@pytest.mark.parametrize("how", ["offline", pytest.param("unreachable", marks=pytest.mark.slow)])
def test_a_hub_id_that_cannot_be_fetched_says_how_to_use_a_local_directory(tmp_path, how):
    extra = {"HF_HUB_OFFLINE": "1"} if how == "offline" else {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    env = _offline_env(tmp_path, **extra)
    res = _cli(env, "run", "--preset", "tiny", "--no-prefect", "--quiet", "--runs-dir", str(tmp_path / "runs"),
               "--set", "model.path=someorg/somemodel", "--set", "tracking.mlflow=false")  # fmt: skip
    assert res.returncode == 2, res.stderr
    # the hub client logs its retries (unreachable: 5, with backoff) before giving up; then one line of ours, last
    err = [line for line in res.stderr.strip().splitlines() if line.startswith("forgeweave: error")]
    assert len(err) == 1 and res.stderr.strip().endswith(err[0]), res.stderr[-2000:]
    assert "model.path 'someorg/somemodel' is a hub id that could not be fetched" in err[0]
    assert ("HF_HUB_OFFLINE is set" in err[0]) == (how == "offline")
    assert "--local-dir DIR`) and set model.path=DIR" in err[0]


GUARD = """
import socket, sys
attempts = []
def local(host):
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "") or str(host).startswith("/")
real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect
def getaddrinfo(host, *a, **k):
    if not local(host):
        attempts.append(("dns", host))
        raise OSError("network disabled by the test")
    return real_getaddrinfo(host, *a, **k)
def connect(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if not local(host):
        attempts.append(("connect", host))
        raise OSError("network disabled by the test")
    return real_connect(self, address)
socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect
from flows.cli import main
code = main(sys.argv[1:])
print("NETWORK_ATTEMPTS", attempts)
sys.exit(code)
"""


@pytest.mark.slow
def test_run_and_export_try_no_network_now_that_offline_mode_is_not_forced(tmp_path):
    """Built-in models and local paths never reach the hub, and no telemetry is sent: every DNS lookup and
    connection to a host other than this one is recorded (and refused)."""
    env = _offline_env(tmp_path, TRANSFORMERS_OFFLINE="")
    env.pop("HF_HUB_DISABLE_TELEMETRY", None)
    runs = tmp_path / "runs"
    sets = [a for s in [*SETTINGS, "steps=2", "model.lora.rank=4"] for a in ("--set", s)]
    for args in (["run", "--preset", "tiny", "--name", "r", "--runs-dir", str(runs), "--quiet", "--no-prefect", *sets],
                 ["export", "r", str(tmp_path / "hf"), "--runs-dir", str(runs)]):  # fmt: skip
        res = subprocess.run([sys.executable, "-c", GUARD, *args], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=240)  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        assert "NETWORK_ATTEMPTS []" in res.stdout, res.stdout[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / ADAPTER).exists()
