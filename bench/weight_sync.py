"""Weight sync: Ray's object store (the path before issue 31) against the weight group (`forge.weight_group`).

Two Ray actors on a private local Ray instance (127.0.0.1), in the same run for both paths: a trainer holding the
policy in fp32 and a receiver holding an engine-like copy in bf16 (the publish dtype). Random models of a real
shape (SmolLM2-135M: Llama, tied embeddings; a 0.5B Qwen2: tied, vocabulary 151936), built from their configs.

- object store: the trainer copies its full state to host, casts it to bf16, returns it (Ray pickles it into the
  object store); the receiver gets it (unpickles its own copy) and loads it into its model (`load_state_dict`);
- group: the receiver submits `receive` first, the trainer `send`s: cast per tensor into 64 MB bf16 buckets,
  broadcast over gloo, the receiver copies each bucket's views into its parameters in place.

A sync's seconds are the driver's wall time from the first call to the loaded model (the whole publish -> loaded
path); bytes are what crosses between the processes (the object's size; the buckets' bytes); peak extra host memory
is the trainer process's peak RSS during the syncs minus its RSS before them (VmHWM reset through
/proc/self/clear_refs). One process per actor and path, so the two paths never share a peak.
Usage: python bench/weight_sync.py [--models smollm2-135m qwen2-0.5b] [--syncs 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
}  # fmt: skip


def build(shape: str, dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, kwargs = SHAPES[shape]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **kwargs), dtype=dtype).eval()


def rss() -> int:
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


class Trainer:
    def __init__(self, shape: str):
        import torch

        self.model = build(shape, torch.float32)

    def publish_object(self):
        """The old path: full state on host, cast to bf16 on the CPU (the return value goes to the object store)."""
        import torch

        return {k: v.detach().cpu().to(torch.bfloat16) for k, v in self.model.state_dict().items()}

    def host(self) -> tuple[object, int]:
        import torch

        from forge.distributed.state import unique_names
        from forge.weight_group import WeightGroup, plan_for

        unique = unique_names(self.model)
        self.tensors = lambda: ((k, v) for k, v in self.model.state_dict().items() if k in unique)
        self.plan, self.group = plan_for(self.tensors(), torch.bfloat16), WeightGroup(0, 2, "gloo")
        return self.plan, self.group.host("127.0.0.1")

    def connect(self, port: int) -> None:
        self.group.connect("127.0.0.1", port, local_address="127.0.0.1")

    def send(self) -> int:
        return self.group.send(self.plan, self.tensors())

    def start_peak(self) -> int:
        reset_peak()
        return rss()

    def peak(self) -> int:
        return _status("VmHWM")


class Receiver:
    def __init__(self, shape: str):
        import torch

        self.model = build(shape, torch.bfloat16)

    def load_object(self, state) -> None:
        self.model.load_state_dict(state)

    def join(self, port: int, plan) -> None:
        from forge.weight_group import WeightGroup, copy_into

        self.plan, self.group = plan, WeightGroup(1, 2, "gloo")
        self.group.connect("127.0.0.1", port, local_address="127.0.0.1")
        self.load = copy_into(self.model)

    def receive(self) -> int:
        return self.group.receive(self.plan, self.load)


def measure(path: str, shape: str, syncs: int) -> dict:
    """Seconds per sync (median), bytes per sync and the trainer's peak extra host memory for one path."""
    import ray

    trainer, receiver = ray.remote(Trainer).remote(shape), ray.remote(Receiver).remote(shape)
    if path == "group":
        plan, port = ray.get(trainer.host.remote())
        ray.get([receiver.join.remote(port, plan), trainer.connect.remote(port)])
    base = ray.get(trainer.start_peak.remote())
    seconds, nbytes = [], 0
    for _ in range(syncs):
        t0 = time.perf_counter()
        if path == "group":
            received = receiver.receive.remote()
            nbytes = ray.get(trainer.send.remote())
            ray.get(received)
        else:
            ref = trainer.publish_object.remote()
            ray.get(receiver.load_object.remote(ref))
            nbytes = _object_bytes(ref)
            del ref
        seconds.append(time.perf_counter() - t0)
    peak = ray.get(trainer.peak.remote()) - base
    for a in (trainer, receiver):
        ray.kill(a)
    return {"s": statistics.median(seconds), "bytes": nbytes, "peak": peak}


def _object_bytes(ref) -> int:
    from flows.ray_exec import object_sizes

    return object_sizes().get(ref.hex(), 0)


def cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--syncs", type=int, default=3)
    args = ap.parse_args()
    import ray
    import torch

    threads = max(1, min(2, os.cpu_count() or 1))
    ray.init(address="local", num_cpus=threads, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})  # fmt: skip
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); torch {torch.__version__}; ray {ray.__version__}")
    print(f"{'model':<14}{'path':<14}{'s/sync':>9}{'MB/sync':>10}{'peak extra MB':>15}{'bf16 model MB':>15}")
    for shape in args.models:
        with torch.device("meta"):  # the size only: no memory
            bf16 = sum(p.numel() for p in build(shape, torch.bfloat16).parameters()) * 2
        got = {path: measure(path, shape, args.syncs) for path in ("object store", "group")}
        for path, m in got.items():
            print(f"{shape:<14}{path:<14}{m['s']:>9.3f}{m['bytes'] / 1e6:>10.1f}{m['peak'] / 1e6:>15.1f}"
                  f"{bf16 / 1e6:>15.1f}")  # fmt: skip
        a, b = got["object store"], got["group"]
        print(f"{shape}: group / object store seconds {b['s'] / a['s']:.2f}x; group peak extra / bf16 model "
              f"{b['peak'] / bf16:.2f}x (object store: {a['peak'] / bf16:.2f}x)")  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
