"""Update throughput with 1 and N update processes, and the weight-publication time per step.

One synthetic scored batch (random prompts and completions of fixed length, random advantages) on a tiny random
Llama, `--steps` updates per setting after one warm-up update. 1 process: the in-process Trainer (the rollout
shares its module, nothing to publish). N processes: N update-rank actors on a private local Ray instance (one
torch.distributed group over gloo, as in Ray execution), timed from the driver (the batch into the object store,
the update on the ranks, then rank 0's full weights gathered and returned here as an object); the ranks' own update
time and that hand-over (rank 0's state dict -> object store -> the driver) are shown apart. Ray mode itself moves
weights through the weight group (`flows.ray_sync`; bench/weight_sync.py compares the two).
On a machine with 2 busy CPU cores no speed-up is to be expected: the ranks share the cores the single process had
(`--threads 1` gives every process one thread; sharing 2 threads on a loaded machine mostly measures OpenMP
oversubscription of the one-process run).
Usage: python bench/update_scaling.py [--processes 1,2] [--steps 5] [--hidden 256] [--layers 4] [--batch 64] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from forge.compose import trainer as Trainer
from forge.config import RunConfig
from forge.models import load_policy
from forge.recipes.grpo import update_micro_batch
from forge.records import Rollouts


def make_cfg(args) -> RunConfig:
    cfg = RunConfig(threads=0)
    cfg.model.tiny.hidden, cfg.model.tiny.layers = args.hidden, args.layers
    cfg.rollout.max_new_tokens = args.tokens
    cfg.update.micro_batch_size = args.micro_batch
    return cfg


def synthetic_batch(vocab: int, n: int, prompt_len: int, tokens: int, seed: int = 0) -> tuple[Rollouts, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    completions = torch.randint(3, vocab, (n, tokens), generator=g)  # [N, T]
    rollouts = Rollouts(
        prompt_ids=torch.randint(3, vocab, (n, prompt_len), generator=g),  # [N, P]
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.long),
        completion_ids=completions,
        completion_mask=torch.ones(n, tokens, dtype=torch.long),
        sampling_logprobs=torch.zeros(n, tokens),
        texts=[""] * n,
        finish_reasons=["length"] * n,
        group_size=8,
        policy_version=0,
    )
    advantages = torch.randn(n, generator=g)
    return rollouts, advantages  # what an update takes


def measure(
    cfg: RunConfig, processes: int, batch: tuple[Rollouts, torch.Tensor], steps: int, threads: int
) -> dict[str, float]:
    """`threads` CPU threads in all: the single process gets them all, each of N ranks threads // N."""
    cfg.threads = max(1, threads // processes)
    torch.set_num_threads(threads)
    if processes == 1:
        model, _ = load_policy(cfg.model, seed=0)
        trainer = Trainer(model, cfg, total_steps=steps + 1, micro_update=update_micro_batch)
        trainer.update(*batch)  # warm-up
        t0 = time.perf_counter()
        stats = [trainer.update(*batch) for _ in range(steps)]
        wall, handover = time.perf_counter() - t0, [0.0] * steps
    else:
        stats, wall, handover = _on_ray(cfg, processes, batch, steps)
    tokens = sum(s.tokens for s in stats)
    return {
        "tokens_per_s": tokens / wall,
        "step_s": wall / steps,
        "ranks_update_s": sum(s.seconds for s in stats) / steps,
        "publish_s": sum(handover) / steps,
    }


def _on_ray(cfg: RunConfig, processes: int, batch: tuple[Rollouts, torch.Tensor], steps: int):
    import ray

    from flows.ray_actor import StageActor

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a private instance: 127.0.0.1 only
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        env = {"OMP_NUM_THREADS": str(cfg.threads), "FORGEWEAVE_THREADS": str(cfg.threads),
               "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}  # fmt: skip
        ranks = [StageActor.options(runtime_env={"env_vars": env}).remote(env) for _ in range(processes)]
        addr, port = ray.get(ranks[0].rendezvous.remote())
        ray.get([a.start.remote("update", cfg, rank=r, world=processes, master_addr=addr, master_port=port,
                                micro_update=update_micro_batch) for r, a in enumerate(ranks)])  # fmt: skip

        def step():
            ro_ref, adv_ref = ray.put(batch[0]), ray.put(batch[1])
            stats = ray.get([a.call.remote("step", ro_ref, adv_ref) for a in ranks])[0]
            t0 = time.perf_counter()
            ray.get([a.call.remote("weights") for a in ranks])  # the full weights on rank 0, every rank gathering
            return stats, time.perf_counter() - t0

        step()  # warm-up
        t0 = time.perf_counter()
        results = [step() for _ in range(steps)]
        wall = time.perf_counter() - t0
        return [r[0] for r in results], wall, [r[1] for r in results]
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="completions per step (N)")
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens each (T)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the processes")
    args = ap.parse_args()
    cfg = make_cfg(args)
    model, tok = load_policy(cfg.model, seed=0)
    params = sum(p.numel() for p in model.parameters())
    batch = synthetic_batch(len(tok), args.batch, 8, args.tokens)
    counts = [int(x) for x in args.processes.split(",")]
    results = {n: measure(cfg, n, batch, args.steps, args.threads) for n in counts}
    base = results[counts[0]]["tokens_per_s"]
    print(
        f"tiny Llama {params / 1e6:.2f}M params, batch {args.batch} x {args.tokens} tokens, {args.steps} steps, {args.threads} threads in all"
    )
    header = (
        f"{'processes':<11}{'tokens/s':>10}{'vs first':>10}{'step s':>9}{'ranks update s':>16}{'weights out s':>16}"
    )
    print(header)
    for n, r in results.items():
        print(
            f"{n:<11}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base:>9.2f}x{r['step_s']:>9.3f}"
            f"{r['ranks_update_s']:>16.3f}{r['publish_s']:>16.4f}"
        )


if __name__ == "__main__":
    main()
