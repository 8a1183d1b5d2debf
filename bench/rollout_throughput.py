"""Rollout tokens/s: forge's `hf` backend vs a plain `model.generate` call on the same model, prompts and settings.

Both are measured in this run, alternating, so machine noise hits both; the ratio is what to read.
Usage: python bench/rollout_throughput.py [--model smollm2-135m-instruct|tiny-random] [--prompts 32] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from forge.config import ModelConfig
from forge.models import default_device, format_prompt_fn, load_policy
from forge.rollout import HFBackend, SamplingParams


def plain_generate(model, tok, prompts, max_new_tokens, autocast) -> int:
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    ctx = torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad(), ctx:
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            pad_token_id=tok.pad_token_id,
        )
    return int(out[:, enc.input_ids.shape[1] :].ne(tok.pad_token_id).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig(path=args.model)
    model, tok = load_policy(cfg)
    model = model.to(default_device())
    fmt = format_prompt_fn(tok, cfg)
    prompts = [fmt(f"Compute {10 + i} + {47 + 2 * i}. Reply with only the final integer.") for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, n=1)
    variants = {
        "plain generate fp32": lambda: plain_generate(model, tok, prompts, args.tokens, False),
        "forge hf fp32": lambda: int(HFBackend(model, tok).generate(prompts, params).completion_mask.sum()),
        "plain generate bf16-autocast": lambda: plain_generate(model, tok, prompts, args.tokens, True),
        "forge hf bf16-autocast": lambda: int(
            HFBackend(model, tok, autocast_bf16=True).generate(prompts, params).completion_mask.sum()
        ),
    }
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - t))
    base = statistics.median(rates["plain generate fp32"])
    print(f"{args.model} on {model.device}: {args.prompts} prompts x {args.tokens} new tokens, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'variant':<32}{'tokens/s':>10}{'vs plain fp32':>16}")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:<32}{med:>10.1f}{med / base:>15.2f}x")


if __name__ == "__main__":
    main()
