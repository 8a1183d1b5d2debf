"""TRL's `GRPOTrainer` on the task of `arith_task.py`: the other half of `vs_trl.py`, run by the bench's TRL venv.

Not meant to be run by hand: `vs_trl.py` writes the prompts (already formatted with the model's chat template, as
forgeweave feeds them) and passes the hyperparameters. The reward is forgeweave's `math_answer` (it has TRL's
reward-function signature), imported from this checkout through PYTHONPATH. fp32 on the CPU; TRL's defaults
otherwise, except where the task fixes a value (listed in `grpo_args`). Prints one JSON line with the seconds of
each optimizer step and saves the trained model for the shared evaluation.
"""

from __future__ import annotations

import argparse
import json
import time

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from forge.rewards.verifiers import math_answer


class StepTimer(TrainerCallback):
    """Wall seconds of every optimizer step (generation, reward and update together, as TRL runs them)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.rewards: list[float] = []  # the batch's mean reward at each step, as TRL logs it
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(float(logs["reward"]))


def grpo_args(a: argparse.Namespace) -> GRPOConfig:
    # 4 prompts x 8 samples per optimizer step, in micro-batches of 16 completions (forgeweave's micro_batch_size)
    return GRPOConfig(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=a.prompts * a.group // 16,
        num_generations=a.group,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        learning_rate=a.lr,
        lr_scheduler_type="linear",
        warmup_steps=a.warmup_steps,
        adam_beta2=0.99,  # forgeweave's default betas are (0.9, 0.99)
        loss_type="dapo",
        beta=0.0,
        bf16=False,
        use_cpu=True,
        seed=a.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="JSONL of {prompt, answer}; prompts already chat-formatted")
    ap.add_argument("--out", required=True)
    for name, kind, default in (
        ("steps", int, 32), ("prompts", int, 4), ("group", int, 8), ("max-new-tokens", int, 32),
        ("temperature", float, 0.7), ("lr", float, 1e-5), ("warmup-steps", int, 2), ("seed", int, 0),
    ):  # fmt: skip
        ap.add_argument(f"--{name}", type=kind, default=default)
    a = ap.parse_args()
    with open(a.data) as f:
        rows = [json.loads(line) for line in f]
    data = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[math_answer], args=grpo_args(a), train_dataset=data, processing_class=tok
    )
    trainer.add_callback(timer)
    trainer.train()
    trainer.save_model(f"{a.out}/model")
    tok.save_pretrained(f"{a.out}/model")
    print("TRL-RESULT " + json.dumps({"step_s": timer.seconds, "rewards": timer.rewards}), flush=True)


if __name__ == "__main__":
    main()
