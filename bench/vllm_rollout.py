"""Rollout tokens/s of the `vllm` backend against the `hf` backend on the same model, prompts and sampling settings.

Both are measured in this run, alternating, so machine noise hits both; the ratio is what to read. Also printed:
the engine's start-up time and the weight-sync seconds (the trainer's weights through Ray's object store, loaded
into the engine). The engine is a rollout actor run by .venv-vllm's python on a private local Ray instance, as in
a run; the hf backends sample in this process. Needs the vLLM environment (`make vllm-env`).
Usage: python bench/vllm_rollout.py [--model smollm2-135m-instruct] [--prompts 32] [--group 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from forge.config import ModelConfig
from forge.models import default_device, format_prompt_fn, load_policy
from forge.rollout import HFBackend, SamplingParams


class EngineActor:
    """A vLLM rollout actor (forge.workers.RolloutWorker in .venv-vllm) behind the backend's generate/sync calls."""

    def __init__(self, model_path: str):
        import ray

        from flows.ray_actor import StageActor
        from forge.config import RunConfig
        from forge.rollout.vllm import REPO, engine_env, vllm_python

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a private instance: 127.0.0.1 only
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)  # fmt: skip
        cfg = RunConfig()
        cfg.model.path, cfg.rollout.backend = model_path, "vllm"
        env = {**engine_env(cfg.rollout, 0), "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
        self.ray, self.version = ray, 0
        self.actor = StageActor.options(runtime_env={"py_executable": str(vllm_python()), "env_vars": env}).remote(env)
        ray.get(self.actor.start.remote("rollout", cfg))

    def generate(self, prompts, params):
        return self.ray.get(self.actor.call.remote("generate", prompts, params, self.version))

    def sync_weights(self, model, version: int) -> float:
        start = time.perf_counter()
        ref = self.ray.put({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
        self.ray.get(self.actor.call.remote("load_weights", ref, version))
        self.version = version
        return time.perf_counter() - start

    def close(self) -> None:
        self.ray.shutdown()


def timed_tokens(backend, prompts, params) -> float:
    start = time.perf_counter()
    tokens = int(backend.generate(prompts, params).completion_mask.sum())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=2, help="samples per prompt (G)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig(path=args.model)
    model, tok = load_policy(cfg)
    model = model.to(default_device()).eval()
    fmt = format_prompt_fn(tok, cfg)
    prompts = [fmt(f"Compute {10 + i} + {47 + 2 * i}. Reply with only the final integer.") for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=args.temperature, n=args.group)
    start = time.perf_counter()
    vllm = EngineActor(args.model)
    vllm.sync_weights(model, 0)  # the engine starts from dummy weights: version 0 first
    startup = time.perf_counter() - start
    print(f"  engine serving after {startup:.1f} s", file=sys.stderr, flush=True)
    try:
        variants = {
            "hf fp32": HFBackend(model, tok),
            "hf bf16-autocast": HFBackend(model, tok, autocast_bf16=True),
            "vllm fp32": vllm,
        }
        for backend in variants.values():  # warm-up
            backend.generate(prompts[:4], params)
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, backend in variants.items():
                rates[name].append(timed_tokens(backend, prompts, params))
                print(f"  {name}: {rates[name][-1]:.1f} tokens/s", file=sys.stderr, flush=True)
        syncs = [vllm.sync_weights(model, version) for version in range(1, 4)]
    finally:
        vllm.close()
    base = statistics.median(rates["hf fp32"])
    print(
        f"{args.model}: {args.prompts} prompts x {args.group} samples x <= {args.tokens} new tokens, T={args.temperature}"
    )
    print(f"{'backend':<20}{'tokens/s':>10}{'vs hf fp32':>14}")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:<20}{med:>10.1f}{med / base:>13.2f}x")
    print(
        f"vllm engine start-up: {startup:.1f} s; weight sync (object store + load): median {statistics.median(syncs):.2f} s"
    )
    print(f"torch threads here: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
