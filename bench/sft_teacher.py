"""A stronger teacher for bench/distill.py: the student fine-tuned on the task's labelled train answers (SFT).

`make demo`'s GRPO checkpoints make weak teachers for issue 32's comparison: GRPO trained them, so GRPO reaches
their level as fast as anything. A teacher that knows more than the reward can teach quickly is what distillation is
for, and the cheapest one on this machine is supervised: the preset's own train split (forge's data prep, the same
chat-formatted prompts the rollouts see; never the held-out eval rows), each prompt followed by its labelled answer
and the end-of-turn token, loss on the answer tokens only. `transformers.Trainer` runs it (one epoch by default, bf16
autocast where the CPU has bf16 units); the result is a model directory `distill.teacher` takes, and its greedy
held-out pass@1 is printed (flows.evaluation, the eval `forgeweave eval` runs).

Usage: python bench/sft_teacher.py [--preset smollm2-arith] [--out /tmp/sft-teacher] [--epochs 1] [--lr 5e-5]
       [--batch 16] [--seed 0] [--set key=value ...]
       then: python bench/distill.py --teacher /tmp/sft-teacher
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's forge, not an installed one
sys.path.insert(0, str(ROOT / "bench"))
from multiturn import cpu_name, peak_rss_mb  # noqa: E402  (bench/ is not a package)

PROBLEM = re.compile(r"-?\d+\s*[-+*]\s*-?\d+")  # "58 + 78" in the arithmetic prompts


def reply(row: dict, template: str) -> str:
    """The teacher's reply to a row: `template` with {answer} and {expr} (the prompt's "a op b").

    >>> reply({"prompt": "Compute 58 + 78. Reply with only the final integer.", "answer": "136"}, "{expr} = {answer}")
    '58 + 78 = 136'
    """
    expr = PROBLEM.search(row["prompt"])
    if "{expr}" in template and expr is None:
        raise SystemExit(f"sft_teacher: row {row.get('id')!r} has no 'a op b' in its prompt for --reply's {{expr}}")
    return template.format(answer=row["answer"], expr=expr.group(0) if expr else "")


def sft_examples(rows: list[dict], tok, template: str = "{answer}") -> list[dict]:
    """One example per train row: the formatted prompt's tokens, then the reply's and eos; labels -100 on the prompt.

    >>> from forge.models import build_char_tokenizer
    >>> ex = sft_examples([{"prompt": "1+1", "model_input": "1+1=", "answer": "2"}], build_char_tokenizer())[0]
    >>> len(ex["input_ids"]) == len(ex["labels"]), ex["labels"].count(-100)
    (True, 4)
    """
    out = []
    for r in rows:
        prompt = tok(r["model_input"], add_special_tokens=False).input_ids
        answer = tok(reply(r, template), add_special_tokens=False).input_ids + [tok.eos_token_id]
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def bf16_units() -> bool:
    """Whether this CPU has bf16 matrix units (AMX or avx512_bf16): bf16 autocast pays only there."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "amx_bf16" in flags or "avx512_bf16" in flags


def train(cfg, args, out: Path) -> dict:
    """SFT the preset's model on its train split; saves model and tokenizer to `out` (atomically: temp dir, rename)."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from forge.compose import data_sources
    from forge.data import build
    from forge.models import format_prompt_fn, load_policy

    model, tok = load_policy(cfg.model, seed=cfg.seed)
    fmt = format_prompt_fn(tok, cfg.model)
    data = build(data_sources(cfg), fmt, lambda text: len(tok(text, add_special_tokens=False).input_ids))
    examples = sft_examples(data.train, tok, args.reply)
    tok.padding_side = "right"  # training: positions start at 0 on every row
    with tempfile.TemporaryDirectory(prefix="sft-teacher-") as scratch:
        targs = TrainingArguments(
            output_dir=scratch, per_device_train_batch_size=args.batch, num_train_epochs=args.epochs,
            learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.0, seed=cfg.seed,
            bf16=bf16_units(), use_cpu=not torch.cuda.is_available(), logging_steps=10, save_strategy="no",
            report_to=[], disable_tqdm=args.quiet, dataloader_num_workers=0,
        )  # fmt: skip
        t0 = time.perf_counter()
        result = Trainer(model=model, args=targs, train_dataset=examples,
                         data_collator=DataCollatorForSeq2Seq(tok, padding=True)).train()  # fmt: skip
        seconds = time.perf_counter() - t0
    tok.padding_side = "left"  # as forge loads it for rollouts
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return {"examples": len(examples), "train_loss": result.training_loss, "seconds": round(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2-arith")
    ap.add_argument("--out", default="/tmp/sft-teacher")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--reply",
        default="{answer}",
        help="the reply it learns: {answer} and {expr} (the prompt's 'a op b'), e.g. '{expr} = {answer}'",
    )
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="an override key=value (repeatable)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flows.evaluation import evaluate_checkpoint_dir
    from forge.config import apply_overrides
    from forge.presets import get_preset

    cfg = apply_overrides(get_preset(args.preset), args.sets).validate()
    torch.manual_seed(cfg.seed)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, bf16 units: {bf16_units()}; preset {args.preset}, "
          f"{args.epochs} epoch(s), lr {args.lr}, batch {args.batch}, overrides {args.sets}", flush=True)  # fmt: skip
    out = Path(args.out)
    if out.exists() and not (out / "config.json").is_file():  # it is replaced whole at the end: never a user's folder
        sys.exit(f"sft_teacher: --out '{out}' exists and is not a model directory: pick a new path")
    info = train(cfg, args, out)
    evals = [f"eval.max_problems={args.eval_rows}", "eval.k=0", *args.sets]
    report = evaluate_checkpoint_dir(out, args.preset, evals, out=out / "eval.json")
    print(
        f"teacher: {out}  {info['examples']} examples, train loss {info['train_loss']:.4f}, {info['seconds']} s; "
        f"held-out greedy pass@1 {report['pass@1']:.3f} on {args.eval_rows} rows; peak RSS {peak_rss_mb():.0f} MB"
    )


if __name__ == "__main__":
    main()
