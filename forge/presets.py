"""Named presets: plain functions returning a RunConfig. A YAML file overlays a preset, `--set key=value` the result.

`compose(preset, config_path)` is the starting config of a run: the preset is the base, the YAML file replaces only
the keys it sets (then `--set` overrides apply on top: preset < YAML < --set). A YAML file may name its own base
with `preset: NAME`; a full config (a run's config.yaml) sets every key, so its base does not matter.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

from forge.config import ConfigError, RunConfig, overlay, read_yaml_file


def tiny() -> RunConfig:
    """Tiny random Llama + char tokenizer learning single-digit sums from scratch (<2 min on 2 CPU cores)."""
    cfg = RunConfig(preset="tiny", seed=0, steps=200, threads=0)
    cfg.model.path = "tiny-random"
    cfg.model.chat_template = False
    d = cfg.data
    d.digits, d.operations, d.max_result = 1, ["+"], 9
    d.prompt_template = "{a}{op}{b}="
    d.train_size, d.eval_size, d.eval_overlap = 1000, 55, True  # all 55 sums <= 9, so eval covers the task
    r = cfg.rollout
    r.prompts_per_step, r.group_size, r.max_new_tokens, r.temperature = 16, 16, 3, 1.0
    cfg.reward.verifiers = ["math_answer"]
    cfg.model.tiny.hidden = 128
    cfg.update.lr = 1e-3
    cfg.update.micro_batch_size = 64
    cfg.eval.every, cfg.eval.k, cfg.eval.max_problems = 50, 4, 200
    cfg.checkpoint.every = 50
    return cfg


def tiny_unlabeled() -> RunConfig:
    """The tiny task without reference answers: the reward is P(correct) from a label-free ensemble of rule checks.

    Verifiers never see the answer column (`reward.label_free`); each checks one necessary condition of the true
    result computed from the prompt (parity, residue mod 3, residue mod 5, digit count; forge/tasks/arith.py), which
    a wrong answer passes by chance. A latent class model (forge/rewards/latent_class.py) refit every step on the last
    8 steps learns without labels how the checks behave on right, wrong and malformed answers; declared necessary
    (`reward.ensemble.necessary_checks`), a failed check cannot pass for noise on a right answer, so answers that pass them
    all get ~1 and the rest ~0. Advantages are mean-centred, not divided by the group's std (Dr. GRPO): in a group
    with no right answer the rewards differ by a few thousandths, and dividing by their std turns that noise into
    full-size advantages. Measured (docs/verifier-ensemble.md, bench/seed_spread.py): greedy pass@1 0.00 -> 0.16-0.71 at
    200 steps over seeds 0-15 (mean 0.30; 0.16-0.36 on seeds 0-3 since the adaptive LR's two-in-a-row rule);
    `tiny` with the true answers 0.38-0.82 over seeds 0-7 (mean 0.63).
    """
    cfg = tiny()
    cfg.preset = "tiny-unlabeled"
    r = cfg.reward
    r.verifiers = ["parity_check", "residue3_check", "residue5_check", "magnitude_check"]
    r.label_free, r.aggregate, r.ensemble.model, r.ensemble.classes = True, "ensemble", "latent_class", 4
    r.ensemble.necessary_checks = list(r.verifiers)  # each tests a necessary condition of the true result
    cfg.algo.advantage = "mean"
    return cfg


def tiny_code() -> RunConfig:
    """The tiny random model learning which Python operator a description asks for, scored by running hidden tests.

    Prompts like `n times 7: def f(n): return n`; the one-character completion sits between the prompt's code and
    the constant (answer column: prefix, suffix and 5 hidden asserts; forge/tasks/code.py, 108 train / 27
    held-out problems) and the program runs in the `code_exec` sandbox. Reward = share of asserts passed.
    """
    from forge.tasks.code import OP_EVAL_FILE, OP_TRAIN_FILE

    cfg = tiny()
    cfg.preset, cfg.steps = "tiny-code", 150
    cfg.data.source, cfg.data.eval_source = str(OP_TRAIN_FILE), str(OP_EVAL_FILE)
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 8, 32, 1
    cfg.reward.verifiers = ["code_exec"]
    cfg.reward.code_exec.timeout_s, cfg.reward.code_exec.test_timeout_s = 2.0, 1.0
    cfg.eval.verifiers, cfg.eval.k, cfg.eval.every = ["code_exec"], 0, 50
    return cfg


def tiny_multiturn() -> RunConfig:
    """The tiny task as multi-turn episodes with a TRL-style environment (forge/tasks/multiturn.py: `SumEnv`, its
    `check` tool, the `sum_reward` reward function reading `environments=`), for tests of the episode path: prompts
    carry the tools' schemas, an episode ends when the policy answers without a call or after env.max_turns."""
    cfg = tiny()
    cfg.preset, cfg.steps = "tiny-multiturn", 60
    cfg.env.environment_factory = "forge.tasks.multiturn:SumEnv"
    cfg.env.max_turns, cfg.env.max_tokens = 2, 24
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 8, 8, 8
    cfg.reward.verifiers = ["forge.tasks.multiturn:sum_reward"]
    cfg.eval.every, cfg.eval.k, cfg.eval.max_problems = 0, 0, 20
    cfg.eval.verifiers = ["math_answer"]  # eval episodes are correct when their final number is the answer
    return cfg


def smollm2_arith() -> RunConfig:
    """SmolLM2-135M-Instruct on 2-digit addition (the `make demo` job): bf16 autocast, short completions."""
    cfg = RunConfig(preset="smollm2-arith", seed=0, steps=20, threads=0)
    cfg.model.path = "smollm2-135m-instruct"
    d = cfg.data
    d.digits, d.operations = 2, ["+"]
    d.prompt_template = "Compute {a} {op} {b}. Reply with only the final integer."
    d.train_size, d.eval_size = 2000, 200
    r = cfg.rollout
    # T=0.7: at T=1 this model's samples are mostly off-task (3% correct vs 16% greedy)
    r.prompts_per_step, r.group_size, r.max_new_tokens, r.temperature = 8, 8, 12, 0.7
    r.autocast_bf16 = True
    cfg.reward.verifiers = ["math_answer"]
    u = cfg.update
    u.lr, u.micro_batch_size, u.autocast_bf16, u.warmup_steps = 1e-5, 16, True, 2
    # eval allows 32 new tokens (as the reference baseline did), so a verbose but correct answer still counts
    cfg.eval.every, cfg.eval.k, cfg.eval.max_problems, cfg.eval.max_new_tokens = 10, 0, 200, 32
    cfg.checkpoint.every, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best = 10, 1, 1
    return cfg


def smollm2_arith_lora() -> RunConfig:
    """The `smollm2-arith` task and budget with a rank-16 LoRA adapter (alpha 32) instead of full fine-tuning.

    Only the adapter (4.9M parameters, 3.5% of the model) is trained and checkpointed; the learning rate is 20x the
    full fine-tuning one, as LoRA's low-rank update needs (B starts at 0)."""
    cfg = smollm2_arith()
    cfg.preset = "smollm2-arith-lora"
    cfg.model.lora.rank, cfg.model.lora.alpha = 16, 32.0
    cfg.update.lr = 2e-4
    return cfg


def smollm2_arith_unlabeled() -> RunConfig:
    """`smollm2-arith` from a file without answers: the reward is the label-free ensemble of six weak verifiers.

    Train prompts: forge/tasks/arith_unlabeled_train.jsonl (no answer column); eval (200) and the probe (50) are
    held-out labelled files used only to measure (forge/tasks/arith.py). The probe feeds the collapse guard, which
    rolls back to the best-probe checkpoint when probe pass@1 falls while the reward rises. Verifiers, none of which
    reads an answer: self-consistency (`group_agreement`), a length prior (`concise`), format (`format_integer`),
    two partial rule checks that a wrong sum often passes (`parity_check`, `magnitude_check`; declared necessary:
    a completion failing one gets reward 0) and an LLM judge, the policy's own frozen initial weights asked "is the
    proposed answer correct?". At step 0 the judge is worse than chance (it prefers wrong answers); the Gaussian
    ensemble learns that without labels and gives it a negative weight. bench/label_free_rl.py compares this with the
    labelled reward, majority vote and the plain mean (docs/verifier-ensemble.md).
    """
    from forge.tasks.arith import EVAL_FILE, PROBE_FILE, TRAIN_FILE

    cfg = smollm2_arith()
    cfg.preset = "smollm2-arith-unlabeled"
    cfg.data.source, cfg.data.eval_source = str(TRAIN_FILE), str(EVAL_FILE)
    r = cfg.reward
    r.verifiers = ["group_agreement", "concise", "format_integer", "parity_check", "magnitude_check",
                   "llm_judge=smollm2-135m-instruct"]  # fmt: skip
    r.label_free, r.aggregate, r.ensemble.model = True, "ensemble", "gaussian"
    # true of every right sum: failing one means wrong
    r.ensemble.necessary_checks = ["parity_check", "magnitude_check"]
    r.score_timeout_s = 300.0  # the judge reads 64 questions a step: ~15 s on 2 cores in fp32, more when busy
    cfg.collapse.action = "rollback"  # probe pass@1 down while the reward rose: back to the best-probe checkpoint
    cfg.eval.verifiers, cfg.collapse.probe_source = ["math_answer"], str(PROBE_FILE)
    return cfg


def smollm2_code() -> RunConfig:
    """SmolLM2-135M-Instruct completing one-line Python functions, rewarded by running hidden tests (code_exec).

    Prompts are the start of a function with a docstring, ending at `return` (forge/tasks/code.py: 500 train,
    100 held-out problems of 12 kinds); the completion continues the code and runs against 5 hidden asserts in
    the sandbox. Reward = share passed; eval pass@1 = all 5 pass. No chat template: the model continues code.
    """
    from forge.tasks.code import EVAL_FILE, TRAIN_FILE

    cfg = smollm2_arith()
    cfg.preset = "smollm2-code"
    cfg.model.chat_template = False
    cfg.data.source, cfg.data.eval_source = str(TRAIN_FILE), str(EVAL_FILE)
    cfg.rollout.max_new_tokens = 12
    cfg.reward.verifiers = ["code_exec"]
    cfg.reward.code_exec.timeout_s, cfg.reward.code_exec.test_timeout_s = 3.0, 1.0
    cfg.eval.verifiers, cfg.eval.max_problems, cfg.eval.max_new_tokens = ["code_exec"], 100, 12
    return cfg


def smollm2_multiturn() -> RunConfig:
    """SmolLM2-135M-Instruct on 2-digit addition over up to 3 turns: a wrong reply gets a hint that leaves one easy
    step, a second wrong one the answer (forge/tasks/retry_arith.py: `RetryArithEnv`'s `on_reply` feedback; the model
    calls no tools; `HintOnlyEnv` gives the hint only).

    Reward: `env_reward`, 1 once a reply is right (final-turn success). Eval (greedy, 40 held-out sums) reports
    `eval/first_turn@1` and `eval/final_turn@1`. Measured (bench/multiturn.py, 32 held-out sums, seeds 0 and 1):
    final turn 0.41 / 0.25 -> 1.00 / 1.00 in 20 steps, the first turn after them 0.22 / 0.31 (docs/environments.md).
    """
    cfg = smollm2_arith()
    cfg.preset = "smollm2-multiturn"
    cfg.env.environment_factory = "forge.tasks.retry_arith:RetryArithEnv"
    cfg.env.max_turns, cfg.env.max_tokens = 3, 160  # 3 replies of <= 16 tokens, 2 feedback turns of ~35
    # 24 episodes a step, 16 tokens a turn ("27 + 82 = 109" is 11; a longer reply is cut and ends the episode)
    r = cfg.rollout
    r.prompts_per_step, r.group_size, r.max_new_tokens = 4, 6, 16
    cfg.update.lr = 2e-5
    cfg.reward.verifiers = ["env_reward"]
    cfg.eval.verifiers, cfg.eval.max_problems, cfg.eval.max_new_tokens = ["math_answer"], 40, 16
    return cfg


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "tiny-unlabeled": tiny_unlabeled,
    "tiny-code": tiny_code,
    "tiny-multiturn": tiny_multiturn,
    "smollm2-arith": smollm2_arith,
    "smollm2-arith-lora": smollm2_arith_lora,
    "smollm2-arith-unlabeled": smollm2_arith_unlabeled,
    "smollm2-code": smollm2_code,
    "smollm2-multiturn": smollm2_multiturn,
}


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown preset '{name}'{hint} (available: {', '.join(PRESETS)})")
    return PRESETS[name]()


def compose(preset: str | None, config_path: str | Path | None) -> RunConfig:
    """The preset (`preset`, else the file's `preset:` key, else tiny when there is no file, else the dataclass
    defaults) overlaid by the keys the YAML file sets; `preset` records that base. A file naming another preset
    than `preset` is a ConfigError: it is unclear which one is meant."""
    data = read_yaml_file(config_path) if config_path else None
    named = data.get("preset") if isinstance(data, dict) else None
    named = named if isinstance(named, str) and named else None
    if preset and named and named != preset:
        raise ConfigError(
            f"{config_path}: the file is based on preset '{named}' (its `preset:` key) but --preset {preset} was "
            "given: drop one of them"
        )
    base = preset or named or ("" if config_path else "tiny")
    if named and named not in PRESETS:
        raise ConfigError(
            f"{config_path}: `preset: {named}` is not a preset (available: {', '.join(PRESETS)}): fix it, or "
            "delete the key to start from the defaults"
        )
    cfg = overlay(get_preset(base) if base else RunConfig(), data, f"{config_path}: ")
    cfg.preset = base
    return cfg
