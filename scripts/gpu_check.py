"""The device check's measurements (run by scripts/gpu_check.sh): the one-GPU rung, on the lent machine as it is.

Runs with that machine's own python3 and torch (no Ray, vLLM, Prefect, MLflow, datasets there) plus forge and the
small wheels that travel in .gpu-wheels/ (scripts/gpu_wheels.txt). Everything is a randomly initialised model of
Qwen2.5-0.5B's shape (`qwen_config`, built in code; no download), bf16 compute; `--dry-run` runs the same sections
on the CPU at a tiny shape (numbers mean nothing there: it checks that every section runs and reports).

Sections, each with a time budget (seconds, `BUDGETS`; a section past it is stopped and reported as such):
  env      device, versions, bf16 matmul TFLOP/s measured, the wheel bundle, what of Ray/vLLM/... is importable;
           every module of forge and weaver imported (fails on one that needs what is not there)
  update   the GRPO update (forge.trainer.Trainer + the recipe's micro-batch math) on G=8 groups sharing their
           prompt: micro-batch sizes x shared-prefix packing on/off x gradient checkpointing on/off; per variant
           batch tokens/s, completion tokens/s, MFU, peak memory against the planner's update prediction
  rollout  hf rollout (forge.rollout.HFBackend.generate) tokens/s: fp32 weights under bf16 autocast (what forge's
           hf copy holds) and bf16 weights; peak memory against the planner's rollout prediction
  publish  the weight publish over CUDA IPC between two processes (forge.weight_group, transport ipc; shared memory
           on the CPU): the trainer's fp32 weights cast to bf16 in 64 MB buckets, a receiver process copying them
           into its bf16 model, bit-exact; seconds per sync (median of 3), each side's peak extra memory against the
           one bucket the design allows; the same pair over gloo with device buckets (the broadcast path's code,
           since NCCL refuses two ranks on one GPU); and a single-rank NCCL send (gloo on the CPU) for the cast +
           pack cost
  fsdp     FSDP2 (fully_shard) on one rank: steps/s, tokens/s, MFU and peak memory against the planner's
           prediction at the same shape; the full-state round trip
  ckpt     a checkpoint saved and restored by a fresh TrainerWorker (tiny preset): where the AdamW state lands
  ray      the Ray/vLLM path (a 3-step Ray-mode run of the tiny preset), only where ray is importable; else skipped

Peak memory: torch's CUDA allocator (`max_memory_allocated`; the CUDA context and NCCL's buffers not counted) on the
GPU; on the CPU the process's peak RSS (VmHWM, reset per measurement), which includes the interpreter. The planner's
prediction is `weaver.memory` (what `forgeweave plan` prints) for the same model shape and token shape: update
memory from tokens (weights, gradients, AdamW, logits and their gradient, activations with or without gradient
checkpointing; padded rows, so packing does not change it), rollout memory from the KV cache per token; `planned_gib`
beside it is the old per-parameter estimate (`weaver.plan.stage_needs`), kept to compare.
MFU = model FLOPs / seconds / the device's dense bf16 peak (H100/H200: 989 TFLOP/s; elsewhere the matmul rate
measured in `env`), model FLOPs = 6 x (non-embedding parameters x batch tokens + LM head x completion tokens):
attention scores and gradient checkpointing's recompute are not counted; packing does not change them (a packed
row computes each group's prompt once, so it can beat the unpacked variant's MFU by doing less work).

Writes gpu_check.json and gpu_check.md (the table) under --out ($OUT, else a new temp dir), and prints both.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
MIB = 2**20
BUNDLE_LIMIT = 60 * MIB
WHEELS = REPO / ".gpu-wheels"
# what the lent machine lacks: the bare run must need none of them (the `ray` section uses them where present)
ABSENT = ("ray", "vllm", "prefect", "mlflow", "datasets", "streamlit")  # math_verify: carried (scripts/gpu_wheels.txt)
BUDGETS = {"env": 30, "update": 120, "rollout": 60, "publish": 75, "fsdp": 45, "ckpt": 30, "ray": 90}
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # SXM, dense (NVIDIA's data sheets)
BUCKET_BYTES = 64 << 20
# modules that need an optional extra (pyproject's optional-dependencies), not on the device's path
OPTIONAL = {"forge.tasks.openenv_sum": "the openenv extra (fastmcp)"}
SYNCS = 3


class OverBudget(Exception):
    """A section ran past its time budget."""


@dataclass
class Check:
    """What every section gets: the device, whether this is a dry run (tiny shape), the bf16 peak (set by env)."""

    device: torch.device
    dry: bool
    peak_tflops: float = 0.0


# ---------------------------------------------------------------- the model, memory, timing


def qwen_config(dry: bool):
    """Qwen2.5-0.5B's architecture (its config.json's figures; 494,032,768 parameters, tied embeddings); a dry run
    keeps the architecture at 2 narrow layers and a 512-token vocabulary."""
    from transformers import Qwen2Config

    if dry:
        dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=512)  # fmt: skip
    else:
        dims = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936)  # fmt: skip
    return Qwen2Config(**dims, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip


def random_model(check: Check, dtype: torch.dtype = torch.float32):
    """A seeded random model of `qwen_config`'s shape on the device (fp32 masters by default) and a char tokenizer
    (its ids are a subset of the model's vocabulary); eos off, so sampling runs the full length."""
    from transformers import AutoModelForCausalLM

    from forge.models import build_char_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen_config(check.dry), dtype=dtype).to(check.device)
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = None
    return model, tok


def param_counts(model) -> tuple[int, int]:
    """(all parameters, the input embedding's), each tensor counted once (tied heads)."""
    total = sum(p.numel() for p in model.parameters())
    return total, model.get_input_embeddings().weight.numel()


def planned(params: int, **kwargs) -> dict[str, float]:
    """The planner's GiB per stage for a one-GPU run of `params` parameters (weaver.plan.stage_needs with
    flows.planning's bytes per parameter for the default config: fp32 policy, hf rollout, no reference)."""
    from flows.planning import reference_bytes, rollout_bytes
    from forge.config import RunConfig
    from weaver.plan import stage_needs

    cfg = RunConfig()
    needs = stage_needs(params, gpu=True, reference_bytes_per_param=reference_bytes(cfg),
                        rollout_bytes_per_param=rollout_bytes(cfg, True), **kwargs)  # fmt: skip
    return {n.name: n.memory_gib for n in needs}


def predicted(model, micro: int, prompt: int, completion: int, ckpt: bool = False) -> float:
    """GiB the memory model (`weaver.memory.update_memory`, the planner's) predicts for one update process of
    `model`'s shape: micro-batches of `micro` rows of `prompt` + `completion` tokens, fp32 masters, bf16 autocast."""
    from weaver.memory import ModelShape, TokenShape, UpdateSetup, update_memory

    setup = UpdateSetup(master_bytes=4, autocast_bf16=True, gradient_checkpointing=ckpt)
    shape = ModelShape.from_config(model.config.to_dict())
    return round(update_memory(shape, TokenShape(micro, prompt, completion), setup).total_gib, 3)


def predicted_rollout(model, sequences: int, tokens: int, weight_bytes: int) -> float:
    """GiB the memory model (`weaver.memory.rollout_memory`) predicts for an hf copy sampling `sequences` at once of
    `tokens` tokens (prompt + completion), its KV cache in bf16."""
    from weaver.memory import ModelShape, rollout_memory

    shape = ModelShape.from_config(model.config.to_dict())
    return round(rollout_memory(shape, sequences=sequences, tokens_per_sequence=tokens, weight_bytes=weight_bytes,
                                kv_bytes=2).total_gib, 3)  # fmt: skip


def _host_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def peak_memory(device: torch.device):
    """Yields a dict that holds, on exit, `peak_gib` (absolute) and `extra_mib` (above the start): torch's CUDA
    allocator on a GPU, the process's RSS (VmHWM, reset on entry) on the CPU."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
        start = _host_kib("VmRSS") * 1024
    try:
        yield out
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = _host_kib("VmHWM") * 1024
        out.update(peak_gib=round(peak / GIB, 3), extra_mib=round((peak - start) / MIB, 1),
                   memory="cuda allocator" if device.type == "cuda" else "host RSS")  # fmt: skip


def timed(device: torch.device, fn, *args, **kwargs):
    """(seconds, fn's result), the device synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mfu(check: Check, model_flops: float, seconds: float) -> float | None:
    return round(model_flops / seconds / (check.peak_tflops * 1e12), 4) if check.peak_tflops else None


def model_flops(counts: tuple[int, int], hidden: int, vocab: int, tokens: int, completion_tokens: int) -> float:
    """6 x (non-embedding parameters x tokens + the LM head x completion tokens): forward + backward."""
    total, embedding = counts
    return 6.0 * ((total - embedding) * tokens + hidden * vocab * completion_tokens)


# ---------------------------------------------------------------- env


def env(check: Check) -> dict:
    import accelerate
    import transformers

    device = check.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    n = 1024 if check.dry else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b  # warm-up
    reps = 3 if check.dry else 10
    seconds, _ = timed(device, lambda: [a @ b for _ in range(reps)])
    measured = 2 * n**3 * reps / seconds / 1e12
    spec = next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), 0.0)
    check.peak_tflops = spec or measured
    bundle = wheel_bundle()
    present = [m for m in ABSENT if importlib.util.find_spec(m) is not None]
    unimportable = import_all(("forge", "weaver"))
    assert not unimportable, f"modules that do not import here: {unimportable}"
    return {"device": name, "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "matmul_bf16_tflops": round(measured, 2), "peak_bf16_tflops": round(check.peak_tflops, 2),
            "peak_from": "data sheet" if spec else "measured matmul", "bundle": bundle,
            "importable_of_absent": present, "modules_imported": len(sys.modules)}  # fmt: skip


def import_all(packages: tuple[str, ...]) -> dict[str, str]:
    """Import every module of `packages`; module -> the error of those that fail, but for `OPTIONAL` ones."""
    import importlib
    import pkgutil

    failed = {}
    for package in packages:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except Exception as e:
                if info.name not in OPTIONAL:
                    failed[info.name] = f"{type(e).__name__}: {e}"
    return failed


def wheel_bundle() -> dict:
    """The carried wheels (.gpu-wheels): names, total bytes, and whether each is what python imports."""
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    size = sum(w.stat().st_size for w in wheels)
    return {"dir": str(WHEELS), "wheels": [w.name for w in wheels], "bytes": size, "mib": round(size / MIB, 2),
            "limit_mib": BUNDLE_LIMIT // MIB, "under_limit": size < BUNDLE_LIMIT}  # fmt: skip


# ---------------------------------------------------------------- update


def grpo_batch(vocab: int, groups: int, g: int, prompt_len: int, max_tokens: int):
    """A scored batch of random tokens: `groups` prompts, each shared by its G rows (what GRPO samples, and what
    shared-prefix packing exploits), completions of random lengths in [max_tokens/4, max_tokens], seeded."""
    from forge.records import Rollouts

    gen = torch.Generator().manual_seed(0)
    n = groups * g
    prompts = torch.randint(3, vocab, (groups, prompt_len), generator=gen).repeat_interleave(g, 0)  # [B*G, P]
    lengths = torch.randint(max(1, max_tokens // 4), max_tokens + 1, (n,), generator=gen)
    mask = (torch.arange(max_tokens)[None] < lengths[:, None]).long()  # [B*G, T]
    ro = Rollouts(
        prompt_ids=prompts, prompt_mask=torch.ones_like(prompts),
        completion_ids=torch.randint(3, vocab, (n, max_tokens), generator=gen) * mask, completion_mask=mask,
        sampling_logprobs=torch.full((n, max_tokens), -5.0) * mask, texts=[""] * n, finish_reasons=["length"] * n,
        group_size=g, policy_version=0, prompts=[""] * n,
    )  # fmt: skip
    rewards = torch.randn(n, generator=gen)
    return ro, rewards - rewards.mean()  # [B*G] advantages


def checkpointing(model, on: bool) -> None:
    """Gradient (activation) checkpointing on or off, non-reentrant as forge.models sets it; transformers 5.2x
    renamed the methods (the machine's 5.17 may have only the old names)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if on and new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable() if new else model.gradient_checkpointing_disable()


def update_variant(check: Check, model, batch, micro: int, packing: bool) -> dict:
    """One trainer (a fresh AdamW) at this micro-batch size and packing: a warm-up step, then the median of two."""
    from forge.compose import trainer as make_trainer
    from forge.config import RunConfig
    from forge.recipes.grpo import update_micro_batch

    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.update.micro_batch_size = batch[0].completion_ids.shape[1], micro
    cfg.update.shared_prefix, cfg.update.autocast_bf16 = packing, True
    trainer = make_trainer(model, cfg, total_steps=8, micro_update=update_micro_batch)
    try:
        trainer.update(*batch)  # warm-up: the optimizer's state is allocated
        with peak_memory(check.device) as mem:
            seconds = statistics.median(timed(check.device, trainer.update, *batch)[0] for _ in range(2))
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        del trainer
    return {"seconds_per_step": round(seconds, 4), **mem}


def update(check: Check) -> dict:
    groups, g, prompt_len, tokens = (2, 4, 16, 16) if check.dry else (16, 8, 256, 512)
    micro_sizes = (4, 8) if check.dry else (8, 32)  # 64 rows without checkpointing: ~70 GB of activations
    model, _ = random_model(check)
    counts, c = param_counts(model), model.config
    batch = grpo_batch(c.vocab_size, groups, g, prompt_len, tokens)
    completion = int(batch[0].completion_mask.sum())
    all_tokens = completion + batch[0].prompt_mask.numel()
    flops = model_flops(counts, c.hidden_size, c.vocab_size, all_tokens, completion)
    plan = planned(counts[0])["update"]
    rows = []
    for micro in micro_sizes:
        for packing in (True, False):
            for ckpt in (False, True):
                row = {"micro_batch": micro, "packing": packing, "grad_ckpt": ckpt, "planned_gib": plan,
                       "predicted_gib": predicted(model, micro, prompt_len, tokens, ckpt)}  # fmt: skip
                checkpointing(model, ckpt)
                try:
                    row |= update_variant(check, model, batch, micro, packing)
                except torch.OutOfMemoryError as e:  # a measurement too: the planner said it fits
                    row |= {"oom": str(e).splitlines()[0][:200]}
                if "seconds_per_step" in row:
                    seconds = row["seconds_per_step"]
                    row |= {"tokens_per_s": round(all_tokens / seconds, 1), "mfu": mfu(check, flops, seconds),
                            "completion_tokens_per_s": round(completion / seconds, 1),
                            "peak_over_planned": round(row["peak_gib"] / plan, 3),
                            "peak_over_predicted": round(row["peak_gib"] / row["predicted_gib"], 3)}  # fmt: skip
                rows.append(row)
                free(check.device)
    return {"params": counts[0], "rows_per_step": groups * g, "prompt_tokens": prompt_len,
            "max_completion_tokens": tokens, "batch_tokens": all_tokens, "completion_tokens": completion,
            "variants": rows}  # fmt: skip


# ---------------------------------------------------------------- rollout


def rollout(check: Check) -> dict:
    from forge.rollout import HFBackend, SamplingParams

    n, tokens = (4, 8) if check.dry else (64, 256)
    prompts = [f"{i} + {2 * i} = " * 4 for i in range(n)]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=1, seed=0)
    rows = []
    for label, dtype, autocast in (("fp32 weights, bf16 autocast", torch.float32, True),
                                   ("bf16 weights", torch.bfloat16, False)):  # fmt: skip
        model, tok = random_model(check, dtype)
        plan = planned(param_counts(model)[0])["rollout"]
        backend = HFBackend(model, tok, autocast_bf16=autocast, batch_size=n)
        backend.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, n=1, seed=0))  # warm-up
        with peak_memory(check.device) as mem:
            seconds, out = timed(check.device, backend.generate, prompts, params)
        sampled = int(out.completion_mask.sum())
        pred = predicted_rollout(model, n, out.prompt_ids.shape[1] + tokens, 4 if dtype == torch.float32 else 2)
        rows.append({"variant": label, "prompts": n, "tokens": sampled, "seconds": round(seconds, 3),
                     "tokens_per_s": round(sampled / seconds, 1), **mem, "planned_gib": plan,
                     "peak_over_planned": round(mem["peak_gib"] / plan, 3), "predicted_gib": pred,
                     "peak_over_predicted": round(mem["peak_gib"] / pred, 3)})  # fmt: skip
        del backend, model
        free(check.device)
    return {"variants": rows}


# ---------------------------------------------------------------- publish (CUDA IPC)


def bit_sums(tensors) -> dict[str, int]:
    """name -> an exact integer checksum of each tensor's bit pattern (position-weighted, so a swap shows too)."""
    sums = {}
    for name, t in tensors:
        bits = t.detach().contiguous().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
        weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
        sums[name] = int((bits.to(torch.int64) * weights).sum())
    return sums


def receiver(backend: str, port: int, plan, device_name: str, dry: bool, out) -> None:
    """The receiving process (rank 1 of 2): a zeroed bf16 model on the same device; puts each sync's index once
    loaded, then its peak extra memory over the syncs and its tensors' checksums."""
    from forge.weight_group import WeightGroup, copy_into

    check = Check(torch.device(device_name), dry)
    model = random_model(check, torch.bfloat16)[0]
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    group = WeightGroup(1, 2, backend, device=check.device)
    group.connect("127.0.0.1", port, local_address="127.0.0.1")
    load, names = copy_into(model), {s.name for s in plan.tensors}
    with peak_memory(check.device) as mem:
        for i in range(SYNCS):
            group.receive(plan, load)
            out.put(i)
    out.put(mem["extra_mib"])
    out.put(bit_sums((n, t) for n, t in model.state_dict().items() if n in names))
    group.close()


def next_from(out, child, timeout: float = 120):
    """The receiver's next message; fails at once if the receiver process has died."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the receiver process died (exit code {child.exitcode})") from None
    raise TimeoutError(f"no word from the receiver in {timeout:.0f} s")


def median_sync(device: torch.device, sync) -> tuple[float, float]:
    """(median seconds of SYNCS calls of `sync`, the sender's peak extra MiB over them)."""
    with peak_memory(device) as mem:
        seconds = statistics.median(timed(device, sync)[0] for _ in range(SYNCS))
    return seconds, mem["extra_mib"]


def publish(check: Check) -> dict:
    from forge.distributed.state import unique_names
    from forge.weight_group import plan_for

    model, _ = random_model(check)  # the trainer's fp32 weights on its device
    names = unique_names(model)
    state = lambda: ((k, v) for k, v in model.state_dict().items() if k in names)  # noqa: E731
    plan = plan_for(state(), torch.bfloat16, BUCKET_BYTES)
    bucket_mib = max(n * 2 for _, n in plan.buckets) / MIB
    want = bit_sums((k, v.to(torch.bfloat16)) for k, v in state())
    seconds, sender_extra, receiver_extra = pair(check, "ipc", plan, state, want)
    gloo_s, gloo_extra, _ = pair(check, "gloo", plan, state, want)
    solo_s, solo_extra = single_rank_send(check, plan, state)
    return {"tensors": len(plan.tensors), "bf16_mib": round(plan.nbytes / MIB, 1), "buckets": len(plan.buckets),
            "ipc_seconds_per_sync": round(seconds, 4), "ipc_gib_per_s": round(plan.nbytes / GIB / seconds, 2),
            "bit_exact": True, "sender_extra_mib": sender_extra, "receiver_extra_mib": receiver_extra,
            "planned_extra_mib": round(bucket_mib, 1), "gloo_pair_seconds_per_sync": round(gloo_s, 4),
            "gloo_pair_sender_extra_mib": gloo_extra, "single_rank_backend": "nccl" if check.device.type == "cuda"
            else "gloo", "single_rank_seconds_per_sync": round(solo_s, 4),
            "single_rank_sender_extra_mib": solo_extra}  # fmt: skip


def pair(check: Check, backend: str, plan, state, want: dict[str, int]) -> tuple[float, float, float]:
    """A sender (this process) and a receiver process on the same device over `backend` (ipc; or gloo with device
    buckets, the broadcast path's code where NCCL refuses two ranks on one GPU): SYNCS syncs, the receiver's tensors
    asserted bit-exact. Returns (median seconds per sync to the receiver's load, sender's and receiver's extra MiB)."""
    import multiprocessing as mp

    from forge.weight_group import WeightGroup

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    group = WeightGroup(0, 2, backend, device=check.device)
    port = group.host("127.0.0.1")
    args = (backend, port, plan, str(check.device), check.dry, out)
    child = ctx.Process(target=receiver, args=args, daemon=True)
    child.start()
    try:
        group.connect("127.0.0.1", port, local_address="127.0.0.1")
        loaded: list[int] = []
        seconds, sender_extra = median_sync(check.device, lambda: (group.send(plan, state()),
                                                                   loaded.append(next_from(out, child))))  # fmt: skip
        receiver_extra, got = next_from(out, child), next_from(out, child)
    finally:
        group.close()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    bad = [k for k in want if got.get(k) != want[k]]
    assert loaded == list(range(SYNCS)) and not bad, f"{backend}: the receiver's tensors differ: {bad[:5]}"
    return seconds, sender_extra, receiver_extra


def single_rank_send(check: Check, plan, state) -> tuple[float, float]:
    """A single-rank group (NCCL on the GPU; WeightGroup refuses a world of 1, which a run never has): the sender's
    cast + pack + broadcast launch, a lower bound of a broadcast sync."""
    from forge.weight_group import WeightGroup

    backend = "nccl" if check.device.type == "cuda" else "gloo"
    group = WeightGroup(0, 2, backend, device=check.device)
    group.world = 1
    group.connect("127.0.0.1", group.host("127.0.0.1"), local_address="127.0.0.1")
    try:
        return median_sync(check.device, lambda: group.send(plan, state()))
    finally:
        group.close()


# ---------------------------------------------------------------- fsdp


def _single_rank_group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def fsdp(check: Check) -> dict:
    from forge.distributed import fsdp as fsdp_mod

    _single_rank_group(check.device)
    rows, seq = (4, 32) if check.dry else (8, 1024)
    model, _ = random_model(check)
    counts, c = param_counts(model), model.config
    model = fsdp_mod.shard(model, bf16=check.device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, c.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0)).to(check.device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: AdamW's state
    with peak_memory(check.device) as mem:
        seconds = statistics.median(timed(check.device, step)[0] for _ in range(2))
    plan = planned(counts[0], update_sharded=True, update_processes=1)["update"]
    pred = predicted(model, rows, 0, seq)  # HF's own loss: logits over every position, as the completion's are
    full = fsdp_mod.full_model_state(model)
    fsdp_mod.load_full_model_state(model, {k: v.clone() for k, v in full.items()})  # it may convert what it gets
    back = fsdp_mod.full_model_state(model)
    same = all(torch.equal(full[k], back[k]) for k in full)
    assert same, "FSDP's full state differs after a load and a gather"
    tokens = rows * seq
    return {"params": counts[0], "parameter_type": type(next(model.parameters())).__name__, "tokens_per_step": tokens,
            "seconds_per_step": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
            "mfu": mfu(check, model_flops(counts, c.hidden_size, c.vocab_size, tokens, tokens), seconds), **mem,
            "planned_gib": plan, "peak_over_planned": round(mem["peak_gib"] / plan, 3), "predicted_gib": pred,
            "peak_over_predicted": round(mem["peak_gib"] / pred, 3), "full_state_round_trip_equal": same}  # fmt: skip


# ---------------------------------------------------------------- ckpt


def ckpt(check: Check) -> dict:
    from forge.compose import trainer_worker as TrainerWorker
    from forge.presets import tiny
    from forge.recipes.grpo import update_micro_batch

    cfg = tiny()
    cfg.checkpoint.async_save = False
    cfg.rollout.max_new_tokens = 8
    worker = TrainerWorker(cfg, micro_update=update_micro_batch)
    worker.step(*grpo_batch(len(worker.tokenizer), 2, 4, 8, 8))
    with tempfile.TemporaryDirectory() as root:
        seconds, _ = timed(check.device, lambda: (worker.save(root, 1, {"note": "gpu check"}, None),
                                                  worker.wait_saved()))  # fmt: skip
        fresh = TrainerWorker(cfg, micro_update=update_micro_batch)
        fresh.restore(str(Path(root) / "step-000001"))
    opt = getattr(fresh.trainer.optimizer, "optimizer", fresh.trainer.optimizer)
    places = sorted({str(v.device) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()})
    params = sorted({str(p.device) for p in fresh.trainer.unwrapped.parameters()})
    assert places == params, f"optimizer state on {places}, parameters on {params}"
    return {"save_seconds": round(seconds, 3), "parameters_on": params, "adamw_state_on": places}


# ---------------------------------------------------------------- ray (where importable)


def ray(check: Check) -> dict:
    """A 3-step Ray-mode run of the tiny preset through the project's own code (flows.planning, a private Ray on
    127.0.0.1, RayStages); vLLM when its venv exists, else hf; colocated on the GPU, so weights by CUDA IPC."""
    if importlib.util.find_spec("ray") is None:
        return {"skipped": "ray is not importable here (the lent machine has no Ray, nor vLLM)"}
    from flows.planning import plan_run
    from flows.ray_exec import RayStages, ray_session
    from forge.errors import UserError
    from forge.presets import tiny
    from forge.recipes.grpo import run as grpo_run
    from forge.rollout.vllm import vllm_python
    from forge.tracking import read_metrics

    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.checkpoint.every, cfg.eval.max_problems, cfg.eval.k = 3, 100, 100, 8, 0
    cfg.orchestration.execution, cfg.tracking.mlflow = "ray", False
    try:
        vllm_python(os.environ.get("VLLM_PYTHON", ""))
        cfg.rollout.backend, cfg.model.tiny.head_dim = "vllm", 32  # vLLM's CPU attention: head size >= 32
    except UserError:
        cfg.rollout.backend = "hf"
    if check.device.type == "cuda":
        gib = torch.cuda.get_device_properties(0).total_memory / GIB
        cfg.pools = [{"name": "gpu", "kind": "gpu", "devices": [0], "memory_gib": int(gib), "cpu_cores": 4},
                     {"name": "cpu", "kind": "cpu", "cpu_cores": 2}]  # fmt: skip
    else:
        cfg.rollout.weight_transport = "ipc"
    plan_obj, plan = plan_run(cfg)
    with tempfile.TemporaryDirectory() as root:
        run_dir = Path(root) / "ray-check"
        with ray_session(cfg, plan, run_dir.name):
            seconds, summary = timed(check.device, grpo_run, cfg, run_dir, progress=False, plan=plan,
                                     stages=RayStages, execution="ray")  # fmt: skip
        syncs = [r["perf/weight_sync_s"] for r in read_metrics(run_dir / "metrics.jsonl") if "perf/weight_sync_s" in r]
        workers = json.loads((run_dir / "workers.json").read_text())
    transport = workers["update"][0]["weight_group"]["backend"] or "group"
    assert summary["steps"] == 3 and len(syncs) == 3 and transport == "ipc", (summary, syncs, transport)
    return {"backend": cfg.rollout.backend, "steps": 3, "seconds": round(seconds, 2), "weight_transport": transport,
            "weight_sync_s": [round(s, 4) for s in syncs]}  # fmt: skip


# ---------------------------------------------------------------- driver

SECTIONS = {"env": env, "update": update, "rollout": rollout, "publish": publish, "fsdp": fsdp, "ckpt": ckpt,
            "ray": ray}  # fmt: skip


def run_section(check: Check, key: str) -> dict:
    """One section under its time budget: {status: ok | failed | over budget, seconds, result | error}."""

    def stop(*_):
        raise OverBudget(f"{key}: past its budget of {BUDGETS[key]} s")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(BUDGETS[key])
    t0 = time.perf_counter()
    try:
        entry = {"status": "ok", "result": SECTIONS[key](check)}
        if "skipped" in entry["result"]:
            entry["status"] = "skipped"
    except OverBudget as e:
        entry = {"status": "over budget", "error": str(e)}
    except Exception as e:  # a device check reports every section, then fails as a whole
        entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        print(traceback.format_exc(), file=sys.stderr)
    finally:
        signal.alarm(0)
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    entry["budget_s"] = BUDGETS[key]
    free(check.device)
    return entry


def table(report: dict) -> str:
    """The markdown table: one row per measurement."""
    lines = ["| section | variant | tokens/s | s/step or s/sync | MFU | peak GiB (publish: extra MiB) | predicted | ratio |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    s = report["sections"]

    def row(section, variant, r, rate="tokens_per_s", secs="seconds_per_step", peak="peak_gib", plan="predicted_gib"):
        ratio = f"{r[peak] / r[plan]:.2f}" if r.get(plan) and r.get(peak) is not None else ""
        lines.append(f"| {section} | {variant} | {r.get(rate, '')} | {r.get(secs, '')} | {r.get('mfu', '')} | "
                     f"{r.get(peak, '')} | {r.get(plan, '')} | {ratio} |")  # fmt: skip

    for r in s["update"].get("result", {}).get("variants", []):
        variant = f"micro {r['micro_batch']}, packing {'on' if r['packing'] else 'off'}, " \
                  f"grad ckpt {'on' if r['grad_ckpt'] else 'off'}"  # fmt: skip
        row("update", variant + (" (out of memory)" if "oom" in r else ""), r)
    for r in s["rollout"].get("result", {}).get("variants", []):
        row("rollout (hf)", r["variant"], r, secs="seconds")
    p = s["publish"].get("result")
    if p:
        row("publish", f"CUDA IPC, 2 processes, {p['bf16_mib']} MiB bf16: GiB/s; sender's extra MiB", p,
            rate="ipc_gib_per_s", secs="ipc_seconds_per_sync", peak="sender_extra_mib", plan="planned_extra_mib")  # fmt: skip
        row("publish", "the receiver's extra MiB", p, rate="", secs="", peak="receiver_extra_mib",
            plan="planned_extra_mib")  # fmt: skip
        row("publish", "gloo pair, device buckets: sender's extra MiB", p, rate="",
            secs="gloo_pair_seconds_per_sync", peak="gloo_pair_sender_extra_mib", plan="planned_extra_mib")  # fmt: skip
        row("publish", f"single-rank {p['single_rank_backend']} send: extra MiB", p, rate="",
            secs="single_rank_seconds_per_sync", peak="single_rank_sender_extra_mib", plan="planned_extra_mib")  # fmt: skip
    if s["fsdp"].get("result"):
        row("fsdp (1 rank)", f"{s['fsdp']['result']['tokens_per_step']} tokens/step", s["fsdp"]["result"])
    lines.append("")
    lines += [f"- {k}: {v['status']} in {v['seconds']} s (budget {v['budget_s']} s)"
              + (f": {v.get('error') or v['result'].get('skipped', '')}" if v["status"] != "ok" else "")
              for k, v in s.items()]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU at a tiny shape; numbers mean nothing")
    ap.add_argument("--bare", action="store_true", help="fail if any of Ray/vLLM/Prefect/... is importable")
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run these sections only (env always runs)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_check.json/.md ($OUT)")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (--dry-run runs on the CPU)", file=sys.stderr)
        return 2
    check = Check(torch.device("cuda" if not args.dry_run else "cpu"), args.dry_run)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    keys = ["env", *[k for k in args.only or SECTIONS if k != "env"]]
    report = {"dry_run": args.dry_run, "bare": args.bare, "sections": {}}
    for key in keys:
        report["sections"][key] = entry = run_section(check, key)
        print(f"[{key}: {entry['status']} in {entry['seconds']} s] " + json.dumps(entry.get("result", entry)),
              flush=True)  # fmt: skip
    failed = [k for k, v in report["sections"].items() if v["status"] not in ("ok", "skipped")]
    env_result = report["sections"]["env"].get("result", {})
    if args.bare and env_result.get("importable_of_absent"):
        failed.append("env (bare: " + ", ".join(env_result["importable_of_absent"]) + " importable)")
    if env_result and not env_result["bundle"]["under_limit"]:
        failed.append(f"env (the wheel bundle is {env_result['bundle']['mib']} MiB, over {BUNDLE_LIMIT // MIB})")
    report["failed"] = failed
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_check.md").write_text(table(report) + "\n")
    print(table(report))
    print(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    print("gpu_check: " + ("all sections passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
