"""Typed run configuration: one dataclass per component, named presets, YAML files, dotted overrides.

A run is described by a `RunConfig`. Presets are plain functions returning one (see `forge.presets`);
the only overlay is `--set section.field=value`, checked against the dataclasses: an unknown key or a value
of the wrong type is a `ConfigError` whose one-line message names the key and the nearest valid ones.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from forge.errors import UserError


class ConfigError(UserError):
    """A config key, value or file a person got wrong."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank r of the adapter (peft); 0 = off: the whole model is trained."""
    alpha: float = 0.0
    """LoRA scale numerator: the update is (alpha / rank) * B @ A; 0 = 2 * rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input during the update."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get an adapter; ["all-linear"] = every linear layer of attention and MLP (not lm_head)."""


@dataclass
class ModelConfig:
    path: str = "tiny-random"
    """Policy: a local HF model directory, a hub id (online only), or a built-in: tiny-random, smollm2-135m-instruct."""
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None = when the tokenizer has one."""
    system_prompt: str = ""
    """System message placed before each prompt when the chat template is used (empty = none)."""
    tiny_hidden: int = 64
    """tiny-random only: hidden size."""
    tiny_layers: int = 2
    """tiny-random only: transformer layers."""
    tiny_head_dim: int = 16
    """tiny-random only: attention head size (vLLM's CPU attention needs 32 or more)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weights dtype (the optimizer updates these)."""
    attn_implementation: str = ""
    """Attention kernel passed to from_pretrained (e.g. sdpa, eager); empty = transformers' default."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more update time)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter (model.lora.rank > 0): only the adapter is trained and checkpointed."""


@dataclass
class DataConfig:
    source: str = "arithmetic"
    """'arithmetic' (built-in generator), a .jsonl/.json/.csv/.parquet file, a `datasets` save_to_disk directory,
    or a directory / glob of data files read with `datasets.load_dataset` (docs/data.md)."""
    eval_source: str = ""
    """Optional separate eval file; empty = split eval_size rows off the training source."""
    train_size: int = 2000
    """Arithmetic: problems to generate for training."""
    eval_size: int = 200
    """Rows held out for evaluation (disjoint from training)."""
    digits: int = 2
    """Arithmetic: digits per operand."""
    operations: list[str] = field(default_factory=lambda: ["+"])
    """Arithmetic: operators to draw from (+, -, *)."""
    min_operand: int = -1
    """Arithmetic: smallest operand; -1 = the smallest number with `digits` digits (0 for one digit)."""
    max_result: int = -1
    """Arithmetic: keep only problems whose answer is <= this (-1 = no limit)."""
    eval_overlap: bool = False
    """Arithmetic: eval is a sample of the whole problem space, which may overlap train (for tiny spaces where
    the point is mastering the task, not generalising); the manifest counts the overlap."""
    allow_negative: bool = False
    """Arithmetic: allow negative answers (subtraction)."""
    prompt_template: str = "Compute {a} {op} {b}. Reply with only the final integer."
    """Arithmetic: prompt text; fields {a} {op} {b}."""
    prompt_column: str = "prompt"
    """File source: column holding the prompt."""
    answer_column: str = "answer"
    """File source: column holding the reference answer."""
    on_bad_rows: Literal["error", "skip"] = "error"
    """Invalid rows stop prep ('error') or are skipped and counted in the manifest ('skip')."""
    max_prompt_tokens: int = 256
    """Prompts longer than this (after the chat template) are invalid rows."""
    split: str = "train"
    """`datasets` DatasetDict source: the split to train on."""
    eval_split: str = ""
    """`datasets` DatasetDict source: the split to evaluate on (empty = hold out eval_size training rows)."""


@dataclass
class RolloutConfig:
    backend: Literal["hf", "vllm"] = "hf"
    """Rollout backend ('hf': HF generate; 'vllm': vLLM engines, each a Ray actor run by .venv-vllm's python)."""
    prompts_per_step: int = 8
    """B: prompts sampled per step."""
    group_size: int = 8
    """G: completions per prompt."""
    max_new_tokens: int = 16
    """Completion length cap (tokens)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    batch_size: int = 64
    """Sequences per generate() call."""
    shared_prefill: bool = True
    """hf: prefill each prompt once per group and share its KV cache (same tokens; less prefill compute)."""
    compact_every: int = 4
    """hf: every this many new tokens, sequences that have ended leave the batch, so decoding no longer computes
    them (0 = never; greedy tokens are the same either way)."""
    autocast_bf16: bool = False
    """Sample under bf16 autocast (faster on CPUs with bf16 units and on GPUs)."""
    vllm_python: str = ""
    """vllm: python of the vLLM venv; empty = $FORGEWEAVE_VLLM_PYTHON, else the repo's .venv-vllm/bin/python."""
    vllm_kv_cache_gib: int = 1
    """vllm on CPU: KV-cache GiB per engine (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_start_timeout_s: float = 600.0
    """Seconds to wait for a rollout actor (a vLLM engine loading its model) to start."""
    replicas: int = 1
    """Rollout actors (vLLM engines or hf copies, Ray mode); each step's prompts are split by measured tokens/s."""
    tensor_parallel_size: int = 1
    """vllm on GPUs: devices per engine (replica i takes the i-th block of visible devices)."""
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vllm: engine weight dtype, also the dtype of published weights; auto = bfloat16 on CUDA, else model.dtype."""
    vllm_gpu_memory_utilization: float = 0.5
    """vllm on CUDA: fraction of each GPU's memory the engine takes (weights + KV cache); the planner counts it."""
    vllm_enforce_eager: bool = False
    """vllm on CUDA: no CUDA graphs (less memory and start-up time, slower decoding)."""
    vllm_max_model_len: int = 0
    """vllm: context length the engine reserves KV cache for; 0 = the model's own maximum."""
    vllm_sleep: Literal["auto", "on", "off"] = "auto"
    """vllm on CUDA: sleep mode (level 1) between a generate and the next weight load, freeing the GPU for the
    update; auto = on when on-policy and the plan colocates rollout with update on a GPU."""


@dataclass
class RewardConfig:
    verifiers: list[str] = field(default_factory=lambda: ["math_answer"])
    """Verifier names (built-ins: math_answer, format_integer, format_tags, code_exec) or import paths 'pkg.mod:fn'."""
    weights: list[float] = field(default_factory=list)
    """One weight per verifier; empty = all 1.0. Reward = sum(w_v * score_v), missing scores count as 0."""
    aggregate: Literal["weighted", "ensemble", "majority", "mean"] = "weighted"
    """weighted: the sum above; ensemble: P(correct | scores) from the label-free weak-verifier ensemble; majority:
    1 for the group's most common final answer, else 0 (TTRL); mean: the scores' average, NaN ignored."""
    window_steps: int = 8
    """ensemble: steps of recent scored rollouts the ensemble is fit on."""
    refit_every: int = 1
    """ensemble: refit every this many steps."""
    ensemble_model: Literal["gaussian", "latent_class"] = "gaussian"
    """ensemble: gaussian (any scores) or latent_class (discrete checks; forge/rewards/latent_class.py)."""
    ensemble_classes: int = 3
    """ensemble: latent classes, correct plus kinds of wrong."""
    necessary_checks: list[str] = field(default_factory=list)
    """ensemble: verifiers every correct answer passes (rule checks); failing one means wrong (latent_class: pins
    the correct class; gaussian: P(correct) = 0 for a completion that failed one)."""
    label_free: bool = False
    """Do not pass the reference answer column to verifiers (evaluation still scores against it)."""
    max_failing_steps: int = 3
    """Stop the run when a verifier raises on every item for this many steps in a row (0 = never stop)."""
    callables: list[str] = field(default_factory=list)
    """Entries of `verifiers` that were Python callables given to forge.train (module:qualname), not config names."""
    score_timeout_s: float = 60.0
    """Seconds one verifier may take on one step's batch; past it the run stops with an error naming the verifier
    (a hung verifier cannot be cut off safely in-process). 0 = no limit."""
    collapse_action: Literal["off", "warn", "stop", "rollback"] = "warn"
    """With a probe set (eval.probe_source): what the collapse guard does when probe pass@1 falls more than
    collapse_drop below its best while reward/mean rose (rule: forge/guard.py): warn (one stderr line), rollback
    (restore the best-probe checkpoint's weights, optimizer and reward state, go on with new prompts), stop (end with
    the best-probe weights), off. stop and rollback also checkpoint at step 0 and at every probe step."""
    collapse_drop: float = 0.05
    """Collapse guard: how far (absolute) probe pass@1 may fall below its best before it counts as a collapse."""
    max_rollbacks: int = 2
    """Collapse guard, rollback: rollbacks per run; the next firing stops the run (as collapse_action=stop)."""
    code_timeout_s: float = 5.0
    """code_exec: wall-clock seconds per completion (program + all its tests); then its processes are killed."""
    code_test_timeout_s: float = 2.0
    """code_exec: wall-clock seconds for loading the program and for each test."""
    code_memory_mb: int = 256
    """code_exec: address-space limit of each sandboxed process (RLIMIT_AS); a run holds at most code_max_procs."""
    code_max_procs: int = 8
    """code_exec: processes and threads the sandboxed code may have at once (RLIMIT_NPROC of its own uid)."""
    code_workers: int = 2
    """code_exec: completions run at once (one process each)."""
    allow_network_code: bool = False
    """code_exec: where no network namespace can be made, run code anyway (it could reach the network)."""


@dataclass
class AlgoConfig:
    advantage: Literal["zscore", "mean", "loo"] = "zscore"
    """Advantage estimator: group z-score (GRPO), mean-only (Dr. GRPO), leave-one-out (RLOO)."""
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    """Policy loss (see shared/reference/grpo.md)."""
    eps_low: float = 0.2
    """Lower clip range of the importance ratio."""
    eps_high: float = 0.2
    """Upper clip range of the importance ratio (DAPO uses 0.28)."""
    dual_clip: float = 3.0
    """DAPO dual-clip constant c for negative advantages."""
    cispo_eps_max: float = 4.0
    """CISPO: upper cap of the (stop-gradient) importance weight."""
    beta: float = 0.0
    """k3 KL penalty to the reference policy; 0 = no reference model is loaded."""
    max_staleness: int = 0
    """Asynchronous GRPO: the rollout of step t+k may run during the update of step t, from weights at most k
    versions older than the trainer's (0 = on-policy: rollout and update take turns). k >= 1 runs on Ray actors."""
    is_correction: Literal["auto", "none", "tis"] = "auto"
    """Off-policy correction with the sampler's log-probs: tis = truncated token-level importance weights
    min(pi_old/pi_sampler, is_cap) on the policy loss; auto = tis when max_staleness > 0, else none."""
    is_cap: float = 2.0
    """tis: upper bound of the importance weight."""

    @property
    def tis(self) -> bool:
        """Whether the truncated importance-sampling correction is on (resolves is_correction=auto)."""
        return self.is_correction == "tis" or (self.is_correction == "auto" and self.max_staleness > 0)


@dataclass
class UpdateConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; the step's gradient is accumulated over micro-batches."""
    num_iterations: int = 1
    """PPO passes over each batch (the ratio is exactly 1 on the first)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """linear/cosine: final LR as a fraction of the peak."""
    adaptive: bool = True
    """Adaptive LR controller: shrink the LR when the training signal spikes past its target, recover slowly."""
    adaptive_signal: Literal["kl", "grad_norm"] = "grad_norm"
    """Signal the controller watches: KL of the step (see forge/lr.py), or the pre-clip grad norm."""
    adaptive_target: float = 2.0
    """kl: absolute KL target; grad_norm: spike ratio over the norm's moving average. Above it the LR is cut."""
    adaptive_cut: float = 0.5
    """Multiply the LR scale by this when the signal exceeds target."""
    adaptive_recover: float = 1.1
    """Multiply the LR scale by this (up to 1.0) on each step the signal is below target/2."""
    autocast_bf16: bool = False
    """Run forward/backward under bf16 autocast (fp32 master weights and fp32 log-softmax kept)."""
    logits_completion_only: bool = True
    """Apply the LM head only to completion positions (the loss never reads prompt logits)."""
    shared_prefix: bool = True
    """Pack each micro-batch into one padding-free row in which each group's prompt is computed once (a block
    mask keeps every completion to its own context; forge/shared_prefix.py) where that costs fewer FLOPs; same
    log-probs up to float rounding."""
    num_processes: int = 0
    """Update processes: 0 = what Weaver's plan gives the update pool (1 on a CPU machine); >1 = that many rank
    actors on Ray forming one torch.distributed group (gloo on CPU, NCCL on GPUs); rank 0 hands the new weights
    to the rollout actors through Ray's object store."""
    max_skipped_steps: int = 3
    """A step whose loss or gradient norm is not finite is skipped (no optimizer step, `train/skipped_steps`);
    this many in a row stop the run."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """With several update processes: DDP (replicated weights) or FSDP full shard (for models that do not fit one
    device; torch FSDP2, on CPU too). No effect with one process."""


@dataclass
class EvalConfig:
    every: int = 10
    """Evaluate every this many steps (and at step 0 and the last step); 0 = only at start and end."""
    max_problems: int = 200
    """Eval problems used (from the eval split)."""
    k: int = 4
    """pass@k: samples per problem (0 = skip pass@k)."""
    temperature: float = 1.0
    """Sampling temperature for pass@k."""
    max_new_tokens: int = 0
    """Completion length cap during evaluation (0 = rollout.max_new_tokens)."""
    batch_size: int = 64
    """Sequences per generate() call during evaluation (hf backend; vLLM batches by itself)."""
    num_samples_saved: int = 20
    """Samples stored in each eval report."""
    verifiers: list[str] = field(default_factory=list)
    """Verifiers deciding pass@1/pass@k (a completion is correct when each scores >= 1.0); names or import paths as
    in reward.verifiers; empty = the run's correctness verifiers, else math_answer (rule: forge/evaluate.py)."""
    check: str = ""
    """Deprecated: one verifier name, the same as eval.verifiers=[NAME] (configs from before eval.verifiers)."""
    probe_source: str = ""
    """Labelled probe file (formats and prompt/answer columns as data.eval_source), prepared into data/probe.parquet:
    greedy pass@1 on it (`probe/pass@1`) feeds only the collapse guard (reward.collapse_action), never the reward;
    empty = no probe."""
    probe_every: int = 0
    """Probe every this many steps (and at step 0 and the last step); 0 = eval.every."""
    probe_max_problems: int = 200
    """Probe rows used (the first ones of data/probe.parquet)."""


@dataclass
class CheckpointConfig:
    every: int = 10
    """Checkpoint every this many steps (the last step always); 0 = only at the end."""
    keep_last: int = 2
    """Keep this many most recent checkpoints."""
    keep_best: int = 1
    """Also keep this many best checkpoints: by probe pass@1 with a probe set (eval.probe_source), else by eval
    pass@1."""
    async_save: bool = True
    """Copy the state to host memory, let training continue and write it in a background thread (at most one save
    in flight; the run waits for it before it ends); false = training waits until the checkpoint is written."""
    hf_model: bool = True
    """With one update process, write the HF weights (model.safetensors) into every checkpoint (they are in that
    process already). With several ranks checkpoints are sharded and the run exports its last one at the end."""


@dataclass
class OrchestrationConfig:
    retries: int = 1
    """Prefect path: times a failed stage task is retried (only stages safe to repeat: rollout, reward, evaluate,
    checkpoint; an update is never retried) before the flow run fails with its error."""
    retry_delay_s: float = 1.0
    """Seconds between stage retries."""
    execution: Literal["auto", "embedded", "ray"] = "auto"
    """embedded: every stage in this process (one update process, hf rollout); ray: every stage in a long-lived
    Ray actor on the pool Weaver plans for it; auto: ray when the run needs other processes (rollout.backend=vllm,
    update.num_processes > 1, algo.max_staleness > 0 or orchestration.ray_address set), else embedded."""
    ray_address: str = ""
    """ray: the cluster to join (`auto` = the one this machine belongs to, or host:port); empty = start a private
    Ray instance on 127.0.0.1 for this run and stop it at the end."""
    max_restarts: int = 2
    """Times the workers are rebuilt after one dies (the run continues from its last checkpoint); then it fails."""


@dataclass
class TrackingConfig:
    mlflow: bool = True
    """Track `forgeweave run` in MLflow too (metrics.jsonl is always written); MLflow failures never stop training."""
    uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite:///<runs-dir>/mlflow.db (embedded)."""
    experiment: str = "forgeweave"
    """MLflow experiment holding the runs."""
    registered_model: str = ""
    """Registry name for checkpoints; empty = forgeweave-<preset> (forgeweave-custom for a config without preset)."""
    log_checkpoints: bool = True
    """Log checkpoint directories (HF files, not the optimizer state) as artifacts and register them."""
    timeout_s: int = 10
    """Seconds per HTTP request to a tracking server (sets MLFLOW_HTTP_REQUEST_TIMEOUT unless already set)."""
    finish_timeout_s: float = 120.0
    """At the end of a run, wait this long for unsent records; the rest stays in the outbox for `forgeweave sync`."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <run_dir>/tensorboard/ (needs the tensorboard package; works offline)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package); files under <run_dir>/wandb/, offline by default."""
    wandb_project: str = "forgeweave"
    """W&B project the run is logged to."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode: offline (files only; upload later with `wandb sync`) or online (needs `wandb login`)."""


@dataclass
class RunConfig:
    preset: str = ""
    """Preset this config was built from (informational)."""
    seed: int = 0
    """Seed for data, sampling and initialisation."""
    steps: int = 30
    """Training steps (one rollout + update each)."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    pools: list[dict] = field(default_factory=list)
    """Resource pools for Weaver (name, kind cpu/gpu, devices, host, work_pool); empty = autodetect this machine."""

    def validate(self) -> RunConfig:
        """Check every number (finite, in range: `RANGES`) and the cross-field constraints; raises ConfigError
        naming the dotted key, the value and what to do."""
        _check_finite(self, "")
        for key, (ok, why) in RANGES.items():
            value = _get(self, key)
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                name = f"{key}[{i}]" if isinstance(value, list) else key
                _require(ok(v), name, f"{why}, got {v!r}")
        r, u = self.rollout, self.update
        _require(
            r.prompts_per_step * r.group_size >= u.num_processes,
            "update.num_processes",
            f"is larger than the {r.prompts_per_step * r.group_size} completions of a step: lower it",
        )
        _require(len(u.adam_betas) == 2, "update.adam_betas", "needs two values, e.g. [0.9, 0.99]")
        w = self.reward.weights
        _require(
            not w or len(w) == len(self.reward.verifiers),
            "reward.weights",
            f"has {len(w)} values for {len(self.reward.verifiers)} verifiers: give one per verifier (or none)",
        )
        _require(bool(self.reward.verifiers), "reward.verifiers", "needs at least one verifier")
        ev = self.eval
        _require(not (ev.check and ev.verifiers), "eval.check", "is the old form of eval.verifiers: set only one")
        _require(len(set(ev.verifiers)) == len(ev.verifiers), "eval.verifiers", "lists a verifier twice: list it once")
        restores = bool(ev.probe_source) and self.reward.collapse_action in ("stop", "rollback")
        _require(
            not restores or self.checkpoint.keep_best > 0,
            "checkpoint.keep_best",
            f"is 0, but reward.collapse_action={self.reward.collapse_action} needs the best-probe checkpoint: set it >= 1",
        )
        lora = self.model.lora
        _require(bool(lora.target_modules) or not lora.rank, "model.lora.target_modules", "needs at least one name")
        _require(
            not (lora.rank and u.strategy == "fsdp" and u.num_processes > 1),
            "model.lora.rank",
            "> 0 cannot be combined with update.strategy=fsdp: use ddp (the adapter is small) or full fine-tuning",
        )
        return self


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


# dotted key -> (check, why it failed); a list field is checked item by item. Floats are checked finite first.
RANGES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "seed": (_non_negative, "must be >= 0"),
    "steps": (lambda v: v >= 1, "must be >= 1"),
    "threads": (_non_negative, "must be >= 0 (0 = torch's default)"),
    "model.tiny_hidden": (_positive, "must be >= 1"),
    "model.tiny_layers": (_positive, "must be >= 1"),
    "model.tiny_head_dim": (_positive, "must be >= 1"),
    "model.lora.rank": (_non_negative, "must be >= 0 (0 = no LoRA, full fine-tuning)"),
    "model.lora.alpha": (_non_negative, "must be >= 0 (0 = 2 * rank)"),
    "model.lora.dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "data.train_size": (_positive, "must be >= 1"),
    "data.eval_size": (_positive, "must be >= 1 (an empty eval split cannot be evaluated)"),
    "data.digits": (lambda v: 1 <= v <= 18, "must be in [1, 18]"),
    "data.min_operand": (lambda v: v >= -1, "must be >= -1 (-1 = the smallest number with `digits` digits)"),
    "data.max_result": (lambda v: v >= -1, "must be >= -1 (-1 = no limit)"),
    "data.max_prompt_tokens": (_positive, "must be >= 1"),
    "rollout.prompts_per_step": (_positive, "must be >= 1"),
    "rollout.group_size": (lambda v: v >= 2, "must be >= 2 (advantages compare samples of a prompt)"),
    "rollout.max_new_tokens": (_positive, "must be >= 1"),
    "rollout.temperature": (_positive, "must be > 0 (use eval for greedy)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "rollout.batch_size": (_positive, "must be >= 1"),
    "rollout.compact_every": (_non_negative, "must be >= 0 (0 = never)"),
    "rollout.vllm_kv_cache_gib": (_positive, "must be >= 1"),
    "rollout.vllm_start_timeout_s": (_positive, "must be > 0 seconds"),
    "rollout.replicas": (_positive, "must be >= 1"),
    "rollout.tensor_parallel_size": (_positive, "must be >= 1"),
    "reward.window_steps": (_positive, "must be >= 1"),
    "reward.refit_every": (_positive, "must be >= 1"),
    "reward.ensemble_classes": (lambda v: v >= 2, "must be >= 2 (correct and wrong)"),
    "reward.max_failing_steps": (_non_negative, "must be >= 0 (0 = never stop)"),
    "reward.score_timeout_s": (_non_negative, "must be >= 0 seconds (0 = no limit)"),
    "reward.collapse_drop": (lambda v: 0 <= v < 1, "must be in [0, 1) (a fall of probe pass@1, absolute)"),
    "reward.max_rollbacks": (_non_negative, "must be >= 0"),
    "algo.eps_low": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "algo.eps_high": (_non_negative, "must be >= 0"),
    "algo.dual_clip": (lambda v: v > 1, "must be > 1 (the DAPO dual-clip constant)"),
    "algo.cispo_eps_max": (_positive, "must be > 0"),
    "algo.beta": (_non_negative, "must be >= 0 (0 = no KL term)"),
    "algo.max_staleness": (_non_negative, "must be >= 0 (0 = on-policy)"),
    "algo.is_cap": (lambda v: v >= 1, "must be >= 1 (a weight cap below 1 shrinks on-policy tokens)"),
    "update.lr": (_positive, "must be > 0"),
    "update.weight_decay": (_non_negative, "must be >= 0"),
    "update.adam_betas": (lambda v: 0 <= v < 1, "must be in [0, 1), e.g. [0.9, 0.99]"),
    "update.max_grad_norm": (_non_negative, "must be >= 0 (0 = no clipping)"),
    "update.micro_batch_size": (_positive, "must be >= 1"),
    "update.num_iterations": (_positive, "must be >= 1"),
    "update.warmup_steps": (_non_negative, "must be >= 0"),
    "update.min_lr_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "update.adaptive_target": (_positive, "must be > 0"),
    "update.adaptive_cut": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "update.adaptive_recover": (lambda v: v >= 1, "must be >= 1"),
    "update.num_processes": (_non_negative, "must be >= 0 (0 = from the Weaver plan)"),
    "update.max_skipped_steps": (_positive, "must be >= 1"),
    "eval.every": (_non_negative, "must be >= 0 (0 = only at start and end)"),
    "eval.max_problems": (_positive, "must be >= 1 (an empty eval split cannot be evaluated)"),
    "eval.k": (_non_negative, "must be >= 0 (0 = skip pass@k)"),
    "eval.temperature": (_positive, "must be > 0"),
    "eval.max_new_tokens": (_non_negative, "must be >= 0 (0 = rollout.max_new_tokens)"),
    "eval.batch_size": (_positive, "must be >= 1"),
    "eval.num_samples_saved": (_non_negative, "must be >= 0"),
    "eval.probe_every": (_non_negative, "must be >= 0 (0 = eval.every)"),
    "eval.probe_max_problems": (_positive, "must be >= 1"),
    "checkpoint.every": (_non_negative, "must be >= 0 (0 = only at the end)"),
    "checkpoint.keep_last": (_positive, "must be >= 1 (the newest checkpoint is what --resume continues from)"),
    "checkpoint.keep_best": (_non_negative, "must be >= 0"),
    "orchestration.retries": (_non_negative, "must be >= 0"),
    "orchestration.retry_delay_s": (_non_negative, "must be >= 0 seconds"),
    "orchestration.max_restarts": (_non_negative, "must be >= 0"),
    "tracking.timeout_s": (_positive, "must be >= 1 second"),
    "tracking.finish_timeout_s": (_non_negative, "must be >= 0 seconds"),
}


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_finite(obj: Any, prefix: str) -> None:
    """Every float field (and float list item) of the config tree is finite: NaN or inf would reach the weights."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{key}.")
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                name = key if i is None else f"{key}[{i}]"
                raise ConfigError(f"config key '{name}' must be a finite number, got {v!r}: set a real value")


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {why}")


# ---------------------------------------------------------------- (de)serialisation


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any], cls: type = RunConfig, prefix: str = "", source: str = "", base: Any = None) -> Any:
    """Build a dataclass from a (possibly partial) nested dict, checking every key and type; the keys `data` sets
    replace those of `base` (updated in place; default: a fresh `cls()`), section by section."""
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"{source}config section '{section}' must be a mapping, got {type(data).__name__}")
    obj = cls() if base is None else base
    for key, value in data.items():
        _set_field(obj, key, value, prefix, source)
    return obj


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _set_field(obj: Any, key: str, value: Any, prefix: str, source: str) -> None:
    types_ = _field_types(type(obj))
    full = f"{prefix}{key}"
    if key not in types_:
        raise ConfigError(f"{source}unknown config key '{full}'{_suggest(key, types_, prefix)}")
    hint = types_[key]
    if dataclasses.is_dataclass(hint):
        setattr(obj, key, from_dict(value, hint, f"{full}.", source, base=getattr(obj, key)))
    else:
        setattr(obj, key, _coerce(value, hint, full, source))


def _suggest(key: str, names: typing.Iterable[str], prefix: str) -> str:
    names = list(names)
    if not names:
        return ""
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    if not close:
        close = sorted(names)[:8]
        return f"; valid keys here: {', '.join(prefix + c for c in close)}"
    return f"; did you mean {' or '.join(repr(prefix + c) for c in close)}?"


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    """Return value converted to the annotated type, or raise ConfigError naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    bad = ConfigError(f"{source}config key '{key}' expects {_type_name(hint)}, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:  # YAML 1.1 reads off/on as booleans
            value = "on" if value else "off"
        if value not in args:
            raise ConfigError(f"{source}config key '{key}' must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, source)
            except ConfigError:
                pass
        raise bad
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if hint is dict:
        if not isinstance(value, dict):
            raise bad
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if hint is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if hint is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if hint is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise bad
        return value
    return value


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.field=value` strings; values are parsed as YAML scalars/lists then type-checked."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. update.lr=1e-5)")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        obj, prefix = cfg, ""
        for p in parts[:-1]:
            hints = _field_types(type(obj))
            if p not in hints or not dataclasses.is_dataclass(hints[p]):
                raise ConfigError(f"unknown config section '{prefix}{p}'{_suggest(p, _sections(obj), prefix)}")
            obj, prefix = getattr(obj, p), f"{prefix}{p}."
        _set_field(obj, parts[-1], _parse_value(raw, _field_types(type(obj)).get(parts[-1])), prefix, "")
    return cfg


def _parse_value(raw: str, hint: Any) -> Any:
    """YAML-parse an override value; a str field keeps the text as typed (YAML reads 0123 as 83, 1.10 as 1.1)."""
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw
    if (hint is str or raw.strip() in typing.get_args(hint)) and not isinstance(value, str):
        return raw.strip()  # also `off` for a Literal naming it, which YAML reads as False
    return value


def _sections(obj: Any) -> list[str]:
    return [k for k, t in _field_types(type(obj)).items() if dataclasses.is_dataclass(t)]


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """A YAML file's content; a missing, non-UTF-8 or malformed file is a one-line ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} '{p}' does not exist")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} '{p}' is not UTF-8 text (bad byte at offset {e.start}): re-save it as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"{what} '{p}' is not valid YAML{where}: fix the syntax") from None


def load_yaml(path: str | Path) -> RunConfig:
    p = Path(path)
    return from_dict(read_yaml_file(p) or {}, RunConfig, "", f"{p}: ")


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def overlay(cfg: RunConfig, data: Any, source: str = "") -> RunConfig:
    """A copy of `cfg` with the keys a (partial) YAML mapping sets replaced, section by section; the rest stays."""
    return from_dict(data if data is not None else {}, RunConfig, "", source, base=copy.deepcopy(cfg))


# ---------------------------------------------------------------- key docs (`forgeweave config keys`)


@dataclass(frozen=True)
class KeyDoc:
    """One config key as `forgeweave config keys` lists it."""

    key: str
    """Dotted key, as `--set` and YAML files name it (e.g. `update.lr`)."""
    type: str
    """Its type, e.g. `float`, `list[str]`, `bool | None`, `'hf' | 'vllm'`."""
    default: Any
    """The dataclass default (a preset may set another value)."""
    doc: str
    """The field's docstring in forge/config.py, on one line."""


def describe_keys(section: str = "", root: type = RunConfig) -> list[KeyDoc]:
    """Every leaf key of `root` (nested sections flattened: `model.lora.rank`) in declaration order, with type,
    default and one-line doc; `section` keeps a section (`update`, `model.lora`) or a single key."""
    docs = list(_describe(root, root(), ""))
    if not section:
        return docs
    picked = [d for d in docs if d.key == section or d.key.startswith(section + ".")]
    if not picked:
        sections = sorted({d.key.split(".")[0] for d in docs if "." in d.key})
        close = difflib.get_close_matches(section, sections + [d.key for d in docs], n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"sections: {', '.join(sections)}"
        raise ConfigError(f"no config section or key '{section}'; {hint}")
    return picked


def _describe(cls: type, default: Any, prefix: str) -> typing.Iterator[KeyDoc]:
    hints, docs = _field_types(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        value, hint = getattr(default, f.name), hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _describe(hint, value, f"{prefix}{f.name}.")
        else:
            yield KeyDoc(f"{prefix}{f.name}", type_text(hint), copy.deepcopy(value), docs.get(f.name, ""))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written right under the field in the class body (PEP 257's attribute
    docstring), read from the source with `ast` and joined onto one line; fields without one are absent."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    out = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            out[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return out


def type_text(hint: Any) -> str:
    """A type annotation as people read it.

    >>> type_text(bool | None), type_text(list[str]), type_text(Literal["hf", "vllm"])
    ('bool | None', 'list[str]', "'hf' | 'vllm'")
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_text(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(map(type_text, args))}]"
    return getattr(hint, "__name__", str(hint))


def format_keys(docs: list[KeyDoc], fmt: Literal["text", "json", "markdown"] = "text") -> str:
    """`forgeweave config keys` output: aligned text lines (`key  type = default  doc`), JSON, or a markdown table."""
    import json

    if fmt == "json":
        return json.dumps([dataclasses.asdict(d) for d in docs], indent=2)
    if fmt == "markdown":
        cell = lambda s: s.replace("|", "\\|")  # noqa: E731
        rows = [f"| `{d.key}` | `{cell(d.type)}` | `{cell(json.dumps(d.default))}` | {cell(d.doc)} |" for d in docs]
        return "\n".join(["| key | type | default | description |", "|---|---|---|---|", *rows])
    width = max((len(d.key) for d in docs), default=0)
    return "\n".join(f"{d.key:<{width}}  {d.type} = {json.dumps(d.default)}  {d.doc}" for d in docs)


# ---------------------------------------------------------------- resume with overrides


# keys a resume may not change: the checkpoint's state means something only under them (key or section prefix
# ending in '.' -> why); every other key (steps, update.lr, eval.*, checkpoint.*, tracking.*, ...) may change
RESUME_FIXED: dict[str, str] = {
    "seed": "it seeded the data split, the prompt order and the initial weights of the saved run",
    "model.": "the checkpoint holds this model's weights, and data/ holds prompts formatted for it",
    "data.": "data/*.parquet were prepared from these settings (and the checkpoint checks their hash)",
    "reward.verifiers": "the saved reward state and the run's reward metrics are per verifier",
    "reward.aggregate": "the saved reward state (the ensemble's window and fit) and the run's rewards belong to "
    "this aggregation",
    "reward.ensemble_model": "the saved ensemble fit is of this model",
    "reward.ensemble_classes": "the saved ensemble fit has this many classes",
    "reward.necessary_checks": "the saved ensemble fit was made with these checks",
    "reward.label_free": "the saved ensemble window holds scores made with (or without) the answers",
    "eval.probe_source": "data/probe.parquet was prepared from it (and the checkpoint checks its hash)",
}
# model keys that change how the update computes, not what the weights are
RESUME_FREE = {"model.gradient_checkpointing", "model.attn_implementation"}


def config_diff(old: RunConfig, new: RunConfig) -> dict[str, list]:
    """Dotted key -> [old, new] for every leaf whose value differs (in declaration order)."""
    before, after = _leaves(old), _leaves(new)
    return {k: [before[k], v] for k, v in after.items() if before[k] != v}


def _leaves(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out.update(_leaves(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {f"{prefix}{f.name}": v})
    return out


def check_resume_changes(changes: dict[str, list], step: int, steps: int) -> None:
    """Refuse (one-line ConfigError naming the key) a change a resume from checkpoint `step` cannot honour."""
    for key in changes:
        fixed = next((p for p in RESUME_FIXED if key == p or (p.endswith(".") and key.startswith(p))), None)
        if fixed is not None and key not in RESUME_FREE:
            old, new = changes[key]
            raise ConfigError(
                f"config key '{key}' cannot change on --resume ({old!r} -> {new!r}): {RESUME_FIXED[fixed]}; "
                "start a new run with --config runs/NAME/config.yaml --set ... instead"
            )
    _require(steps >= step, "steps", f"is {steps}, below the checkpoint's step {step}: set steps >= {step}")
