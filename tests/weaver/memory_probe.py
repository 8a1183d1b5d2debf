"""Measure the peak host memory of forge's GRPO update (forward + backward + AdamW step, `forge.trainer.Trainer`)
for model/token shapes given as JSON on stdin; prints one JSON line per shape: {"peak_bytes": ...}.

Run in a fresh process by tests/weaver/test_memory_model.py, with glibc's mmap threshold fixed at 128 KiB
(`MALLOC_MMAP_THRESHOLD_`) so that every tensor larger than that is its own mapping, returned to the system when
freed: the resident set then follows the live tensors. Per shape: the peak resident set (Linux `VmHWM`, reset
through /proc/self/clear_refs before the shape) minus the resident set just before the model is built, i.e.
weights, gradients, AdamW moments, activations and every temporary of `steps` updates, plus whatever transformers
allocates beside them.
"""

from __future__ import annotations

import gc
import json
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(spec: dict) -> int:
    """Peak bytes above the resident set before the model existed, over `spec["steps"]` updates."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from forge.advantages import group_advantages
    from forge.config import RunConfig
    from forge.records import Rollouts
    from tests.grpo_parts import Trainer

    n, p, t, g = spec["rows"], spec["prompt"], spec["completion"], spec["group"]
    gen = torch.Generator().manual_seed(0)
    vocab = spec["model"]["vocab_size"]
    prompts = torch.randint(0, vocab, (n // g, p), generator=gen).repeat_interleave(g, 0)  # [N, P], G alike
    completion_mask = torch.ones(n, t, dtype=torch.long)  # [N, T]
    completion_mask[1::2, 3 * t // 4 :] = 0  # every other completion ends early: padded rows, as GRPO's are
    ro = Rollouts(
        prompt_ids=prompts, prompt_mask=torch.ones(n, p, dtype=torch.long),
        completion_ids=torch.randint(0, vocab, (n, t), generator=gen), completion_mask=completion_mask,
        sampling_logprobs=torch.zeros(n, t), texts=[""] * n, finish_reasons=["length"] * n, group_size=g,
        policy_version=0,
    )  # fmt: skip
    advantages = group_advantages(torch.randn(n, generator=gen), g, "zscore")
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = t
    cfg.update.micro_batch_size = spec["micro_batch"]
    cfg.update.shared_prefix = spec.get("shared_prefix", False)
    cfg.update.adaptive.enabled = False
    gc.collect()
    _reset_peak()
    before = _status_kib("VmRSS")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**spec["model"], attn_implementation="sdpa"))
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    trainer = Trainer(model, cfg, total_steps=spec["steps"])
    for _ in range(spec["steps"]):
        trainer.update(ro, advantages)
    peak = (_status_kib("VmHWM") - before) * 1024
    del trainer, model
    gc.collect()
    return peak


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set to the current one
        f.write("5")


def main() -> None:
    import torch

    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    specs = json.loads(sys.stdin.read())
    measure({**specs[0], "rows": 2, "micro_batch": 1, "prompt": 4, "completion": 4, "steps": 1})  # lazy inits
    for spec in specs:
        print(json.dumps({"peak_bytes": measure(spec)}), flush=True)


if __name__ == "__main__":
    main()
