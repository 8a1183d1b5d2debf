"""Rollout with vLLM engines in their own processes (`rollout.backend: vllm`).

vLLM cannot share the main environment (its fastapi pin conflicts with Prefect's), so each engine is a separate
process run by the vLLM virtual environment's python (`make vllm-env` creates `.venv-vllm`) executing
`forge/rollout/vllm_worker.py`, reached over JSON/HTTP on 127.0.0.1. Either forge starts and owns the engines
(`rollout.replicas` of them; health-checked; stopped by process group at `close()`, on error, Ctrl-C and SIGTERM;
each also exits by itself when this process dies), or it connects to engines the user already runs
(`rollout.vllm_url`, one URL per replica).

Same inputs and the same record as the hf backend: prompts are tokenised here with the policy's tokenizer and
sent as token ids; the Rollouts record has left-padded prompts, right-padded completions with the eos kept, the
mask up to and including the first eos, texts decoded here, finish reasons "stop"/"length". Sampling log-probs
are the engine's `processed_logprobs` (after temperature and top-p: the distribution actually sampled from).
Each row is one request with its own seed, drawn from torch's RNG, so a seeded run is reproducible; the hf and
vllm backends use different random streams, so their sampled tokens differ while greedy tokens agree.

Weight sync (`sync_weights`): the trainer's weights are published with `forge.weights.publish_weights` (one
atomic safetensors file labelled with the policy version; /dev/shm for owned engines, the run directory for
external ones, which may live on another machine sharing it) and every engine loads that file before the next
rollout. Engines report the version they read from the file, every rollout reply carries it, and an engine
asked to sample for another version refuses: stale weights cannot go unnoticed.

With several replicas the prompts of a step are split (whole groups, so a prompt's G samples share one prefix
cache) by a balancer and sent concurrently: `EvenSplit` by default; the flows pass weaver's ThroughputBalancer,
which splits in proportion to each engine's measured tokens/s (forge itself does not import weaver).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from forge.config import RolloutConfig
from forge.errors import UserError
from forge.records import Rollouts
from forge.rollout.base import SamplingParams
from forge.weights import publication_dir, publish_weights

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO = Path(__file__).resolve().parents[2]
# head sizes vLLM 0.32's CPU attention kernel supports (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class Balancer(Protocol):
    """Splits a step's prompts across replicas (weaver.balance.ThroughputBalancer is one)."""

    def split(self, n: int) -> list[int]: ...

    def observe(self, replica: int, tokens: int, seconds: float) -> None: ...


class EvenSplit:
    """Equal shares, the first replicas taking the remainder; ignores measurements.

    >>> EvenSplit(3).split(7)
    [3, 2, 2]
    """

    def __init__(self, replicas: int):
        self.replicas = replicas

    def split(self, n: int) -> list[int]:
        q, r = divmod(n, self.replicas)
        return [q + (i < r) for i in range(self.replicas)]

    def observe(self, replica: int, tokens: int, seconds: float) -> None:
        pass


def vllm_python(configured: str = "") -> Path:
    """The vLLM venv's python: rollout.vllm_python, else $FORGEWEAVE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    path = Path(configured or os.environ.get("FORGEWEAVE_VLLM_PYTHON", "") or REPO / ".venv-vllm" / "bin" / "python")
    if not path.is_file():
        raise UserError(
            f"rollout.backend=vllm needs the vLLM environment, but '{path}' does not exist: run `make vllm-env` "
            "(or set rollout.vllm_python / $FORGEWEAVE_VLLM_PYTHON to a python that has vllm)"
        )
    return path


class EngineClient:
    """JSON over HTTP to one worker (see vllm_worker.py for the endpoints)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def health(self, timeout_s: float = 10.0) -> dict:
        with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as r:
            return json.loads(r.read())

    def post(self, route: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"{self.url}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise RuntimeError(f"vLLM engine {self.url}{route} answered {e.code}: {detail}") from None


class EngineProcess:
    """One engine this process owns: started in its own process group, stopped by that group's id."""

    def __init__(self, python: Path, args: list[str], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self.ready_file = log_path.with_suffix(".ready.json")
        self.ready_file.unlink(missing_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(python), str(WORKER), *args, "--ready-file", str(self.ready_file), "--watch-parent"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log_path.parent
            )

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the engine serves (its ready file appears); returns its URL. Raises with the log's tail."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.is_file():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM engine exited with code {self.proc.returncode} while starting:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM engine not ready after {timeout_s:.0f} s (log {self.log_path}):\n{self.tail()}"
                )
            time.sleep(0.2)
        port = json.loads(self.ready_file.read_text())["port"]
        return f"http://127.0.0.1:{port}"

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the engine's process group, SIGKILL what is left after `grace_s`; idempotent."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace_s)
        self.ready_file.unlink(missing_ok=True)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the worker leads its own group (start_new_session): this reaches its children too
    except ProcessLookupError:
        pass


class VLLMBackend:
    """RolloutBackend over one or more vLLM engines. Call `close()` when done (it stops the engines it started)."""

    def __init__(
        self,
        model,
        tokenizer,
        cfg: RolloutConfig,
        work_dir: Path | None = None,
        policy_version: int = 0,
        balancer: Callable[[int], Balancer] | None = None,
    ):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.policy_version = policy_version
        self._tmp = None if work_dir else Path(tempfile.mkdtemp(prefix="forgeweave-vllm-"))
        self.work_dir = Path(work_dir or self._tmp)
        self.processes: list[EngineProcess] = []
        self.last_sync_s = 0.0
        urls = [u.strip() for u in cfg.vllm_url.split(",") if u.strip()]
        self.pub_dir = self.work_dir / "weights" if urls else publication_dir(self.work_dir)
        try:
            self.clients = self._connect(urls, model) if urls else self._start(model)
        except BaseException:
            self.close()
            raise
        self.balancer = (balancer or EvenSplit)(len(self.clients))

    # ------------------------------------------------------------ engines

    def _start(self, model) -> list[EngineClient]:
        _check_head_size(model)
        python = vllm_python(self.cfg.vllm_python)
        model_dir = self.work_dir / "vllm-model"
        model.save_pretrained(model_dir)
        self.tokenizer.save_pretrained(model_dir)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        for i in range(self.cfg.replicas):
            args = ["--model", str(model_dir), "--dtype", dtype, "--policy-version", str(self.policy_version)]
            args += ["--kv-cache-gib", str(self.cfg.vllm_kv_cache_gib), "--seed", str(i)]
            args += ["--tensor-parallel-size", str(self.cfg.tensor_parallel_size)]
            log = self.work_dir / "logs" / f"vllm-engine-{i}.log"
            self.processes.append(EngineProcess(python, args, _engine_env(i, self.cfg), log))
        urls = [p.wait_ready(self.cfg.vllm_start_timeout_s) for p in self.processes]
        clients = [EngineClient(u) for u in urls]
        for c in clients:
            c.health()
        return clients

    def _connect(self, urls: list[str], model) -> list[EngineClient]:
        clients = [EngineClient(u) for u in urls]
        for c in clients:
            try:
                c.health()
            except OSError as e:
                raise UserError(f"rollout.vllm_url: no forgeweave vLLM worker answers at {c.url} ({e})") from None
        self.clients = clients
        self.sync_weights(model, self.policy_version)  # an external engine holds its own weights until told
        return clients

    def close(self) -> None:
        """Stop the engines this backend started and remove its published weights; safe to call twice."""
        for p in self.processes:
            p.stop()
        self.processes = []
        if self.pub_dir.is_dir() and str(self.pub_dir).startswith("/dev/shm/"):
            shutil.rmtree(self.pub_dir, ignore_errors=True)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # ------------------------------------------------------------ RolloutBackend

    def sync_weights(self, model, version: int) -> float:
        """Publish `model`'s weights as `version` and load them into every engine; returns the seconds it took."""
        start = time.perf_counter()
        path = publish_weights(model, self.pub_dir, version)
        with ThreadPoolExecutor(len(self.clients)) as pool:
            replies = list(pool.map(lambda c: c.post("/load_weights", {"path": str(path)}), self.clients))
        for c, r in zip(self.clients, replies, strict=True):
            if r["policy_version"] != version:
                raise RuntimeError(
                    f"vLLM engine {c.url} loaded policy version {r['policy_version']}, expected {version}"
                )
        self.policy_version = version
        self.last_sync_s = time.perf_counter() - start
        return self.last_sync_s

    def generate(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        tok = self.tokenizer
        prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]  # [B] lists
        # greedy draws nothing from torch's RNG (as hf's generate): a greedy eval must not shift the training stream
        greedy = params.temperature == 0
        base_seed = 0 if greedy else int(torch.randint(0, 2**31 - 1 - len(prompts) * params.n, ()))
        bounds = _bounds(self.balancer.split(len(prompts)))  # whole prompt groups per replica
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [
                pool.submit(self._request, i, lo, hi, prompt_ids, params, base_seed)
                for i, (lo, hi) in enumerate(bounds)
            ]
            completions = [c for f in futures for c in f.result()]
        expanded_ids = [ids for ids in prompt_ids for _ in range(params.n)]
        expanded = [p for p in prompts for _ in range(params.n)]
        return assemble(tok, expanded, expanded_ids, completions, params.n, self.policy_version)

    def _request(self, replica: int, lo: int, hi: int, prompt_ids, params: SamplingParams, base_seed: int) -> list:
        if hi == lo:
            return []
        n = params.n
        body = {
            "prompt_token_ids": [ids for ids in prompt_ids[lo:hi] for _ in range(n)],
            "seeds": list(range(base_seed + lo * n, base_seed + hi * n)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "stop_token_ids": [self.tokenizer.eos_token_id],
            "policy_version": self.policy_version,
        }
        start = time.perf_counter()
        reply = self.clients[replica].post("/generate", body)
        tokens = sum(len(c["token_ids"]) for c in reply["completions"])
        self.balancer.observe(replica, tokens, max(time.perf_counter() - start, 1e-6))
        if reply["policy_version"] != self.policy_version:
            raise RuntimeError(
                f"vLLM engine sampled with policy version {reply['policy_version']}, not {self.policy_version}"
            )
        return reply["completions"]


def assemble(
    tok, prompts: list[str], prompt_ids: list[list[int]], completions: list[dict], group_size: int, version: int
) -> Rollouts:
    """The Rollouts record from per-row token lists (same layout as the hf backend's)."""
    pad, eos = tok.pad_token_id, tok.eos_token_id
    n, width = len(completions), max(1, max(len(c["token_ids"]) for c in completions))
    plen = max(len(ids) for ids in prompt_ids)
    prompt = torch.full((n, plen), pad, dtype=torch.long)  # [N, P] left-padded
    prompt_mask = torch.zeros((n, plen), dtype=torch.long)
    ids = torch.full((n, width), pad, dtype=torch.long)  # [N, T] right-padded
    mask = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completions, strict=True)):
        k = len(c["token_ids"])
        prompt[i, plen - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, plen - len(p) :] = 1
        ids[i, :k] = torch.tensor(c["token_ids"], dtype=torch.long)
        mask[i, :k] = 1
        logprobs[i, :k] = torch.tensor(c["logprobs"], dtype=torch.float32)
    lengths = mask.sum(1).tolist()
    return Rollouts(
        prompt_ids=prompt,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        sampling_logprobs=logprobs,
        texts=[tok.decode(row[:k], skip_special_tokens=True) for row, k in zip(ids, lengths, strict=True)],
        finish_reasons=[
            "stop" if k and int(row[k - 1]) == eos else "length" for row, k in zip(ids, lengths, strict=True)
        ],
        group_size=group_size,
        policy_version=version,
        prompts=prompts,
    )


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of the given sizes.

    >>> _bounds([2, 0, 3])
    [(0, 2), (2, 2), (2, 5)]
    """
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def _engine_env(replica: int, cfg: RolloutConfig) -> dict[str, str]:
    """Environment of engine `replica`: its own CPU cores (CPU build) or GPUs (CUDA build) when there are several."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_cache_gib)}
    env.pop("PYTHONPATH", None)  # the worker must not pick up the main venv's packages
    if cfg.replicas > 1:
        tp = cfg.tensor_parallel_size
        if torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
            devices = visible.split(",")[replica * tp : (replica + 1) * tp]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        else:
            cores = sorted(os.sched_getaffinity(0))
            share = max(1, len(cores) // cfg.replicas)
            mine = cores[(replica * share) % len(cores) :][:share]
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def _check_head_size(model) -> None:
    if torch.cuda.is_available():
        return
    c = model.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head not in CPU_HEAD_SIZES:
        raise UserError(
            f"rollout.backend=vllm: vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; "
            f"this model has {head} (for tiny-random set model.tiny_head_dim=32)"
        )
