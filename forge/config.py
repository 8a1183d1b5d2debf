"""Typed run configuration: `RunConfig` nests one keyword-only dataclass per component, most beside their code.

Sections beside their component: `rollout.vllm` (forge/rollout/config.py), `reward.code_exec`
(forge/rewards/code_exec.py), `reward.ensemble` (forge/rewards/ensemble.py), `update.adaptive` (forge/lr.py),
`collapse` (forge/guard.py); the model's sections stay here because forge/models.py imports torch at import and
`forgeweave config` must not. Each field's range rule sits on it (`ranged`), a section's cross-field rules in its
`check`; `RunConfig.validate` runs them all and keeps the rules that span sections. Presets are plain functions
returning a RunConfig (`forge.presets`); the only overlay is `--set section.field=value`, checked against the
dataclasses: an unknown key or a value of the wrong type is a one-line `ConfigError` naming the key and the nearest
valid ones. Keys of earlier releases still load (`forge.config_compat`). The machinery is in `forge.config_base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from forge import config_base, config_compat
from forge.config_base import (  # noqa: F401  (re-exported: the config API importers use)
    ConfigError,
    KeyDoc,
    config_diff,
    dump_yaml,
    field_docs,
    format_keys,
    ranged,
    read_yaml_file,
    require,
    to_dict,
    type_text,
)
from forge.env.config import EnvConfig
from forge.guard import CollapseConfig
from forge.lr import AdaptiveConfig
from forge.rewards.code_exec import CodeExecConfig
from forge.rewards.ensemble import RewardEnsembleConfig
from forge.rollout.config import VllmConfig


@dataclass(kw_only=True)
class TinyConfig:
    """`model.tiny`: the shape of the built-in tiny-random model (forge.models.build_tiny_model)."""

    hidden: int = ranged(64, ">= 1")
    """Hidden size."""
    layers: int = ranged(2, ">= 1")
    """Transformer layers."""
    head_dim: int = ranged(16, ">= 1")
    """Attention head size (vLLM's CPU attention needs 32 or more)."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = ranged(0, ">= 0", "(0 = no LoRA, full fine-tuning)")
    """LoRA rank r of the adapter (peft); 0 = off: the whole model is trained."""
    alpha: float = ranged(0.0, ">= 0", "(0 = 2 * rank)")
    """LoRA scale numerator: the update is (alpha / rank) * B @ A; 0 = 2 * rank."""
    dropout: float = ranged(0.0, "in [0, 1)")
    """Dropout on the adapter's input during the update."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get an adapter; ["all-linear"] = every linear layer of attention and MLP (not lm_head)."""

    def check(self, prefix: str) -> None:
        require(bool(self.target_modules) or not self.rank, f"{prefix}target_modules", "needs at least one name")


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "tiny-random"
    """Policy: a local HF model directory, a hub id (online only), or a built-in: tiny-random, smollm2-135m-instruct."""
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None = when the tokenizer has one."""
    system_prompt: str = ""
    """System message placed before each prompt when the chat template is used (empty = none)."""
    tiny: TinyConfig = field(default_factory=TinyConfig)
    """tiny-random only: the model's shape."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weights dtype (the optimizer updates these)."""
    attn_implementation: str = ""
    """Attention kernel passed to from_pretrained (e.g. sdpa, eager); empty = transformers' default."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more update time)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter (model.lora.rank > 0): only the adapter is trained and checkpointed."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "arithmetic"
    """'arithmetic' (built-in generator), a .jsonl/.json/.csv/.parquet file, a `datasets` save_to_disk directory,
    or a directory / glob of data files read with `datasets.load_dataset` (docs/data.md)."""
    eval_source: str = ""
    """Optional separate eval file; empty = split eval_size rows off the training source."""
    train_size: int = ranged(2000, ">= 1")
    """Arithmetic: problems to generate for training."""
    eval_size: int = ranged(200, ">= 1", "(an empty eval split cannot be evaluated)")
    """Rows held out for evaluation (disjoint from training)."""
    digits: int = ranged(2, "in [1, 18]")
    """Arithmetic: digits per operand."""
    operations: list[str] = field(default_factory=lambda: ["+"])
    """Arithmetic: operators to draw from (+, -, *)."""
    min_operand: int = ranged(-1, ">= -1", "(-1 = the smallest number with `digits` digits)")
    """Arithmetic: smallest operand; -1 = the smallest number with `digits` digits (0 for one digit)."""
    max_result: int = ranged(-1, ">= -1", "(-1 = no limit)")
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
    max_prompt_tokens: int = ranged(256, ">= 1")
    """Prompts longer than this (after the chat template) are invalid rows."""
    split: str = "train"
    """`datasets` DatasetDict source: the split to train on."""
    eval_split: str = ""
    """`datasets` DatasetDict source: the split to evaluate on (empty = hold out eval_size training rows)."""


@dataclass(kw_only=True)
class RolloutConfig:
    backend: Literal["hf", "vllm"] = "hf"
    """Rollout backend ('hf': HF generate; 'vllm': vLLM engines, each a Ray actor run by .venv-vllm's python)."""
    prompts_per_step: int = ranged(8, ">= 1")
    """B: prompts sampled per step."""
    group_size: int = ranged(8, ">= 2", "(advantages compare samples of a prompt)")
    """G: completions per prompt."""
    max_new_tokens: int = ranged(16, ">= 1")
    """Completion length cap (tokens)."""
    temperature: float = ranged(1.0, "> 0", "(use eval for greedy)")
    """Sampling temperature."""
    top_p: float = ranged(1.0, "in (0, 1]")
    """Nucleus sampling mass."""
    batch_size: int = ranged(64, ">= 1")
    """Sequences per generate() call."""
    shared_prefill: bool = True
    """hf: prefill each prompt once per group and share its KV cache (same tokens; less prefill compute)."""
    compact_every: int = ranged(4, ">= 0", "(0 = never)")
    """hf: every this many new tokens, sequences that have ended leave the batch, so decoding no longer computes
    them (0 = never; greedy tokens are the same either way)."""
    autocast_bf16: bool = False
    """Sample under bf16 autocast (faster on CPUs with bf16 units and on GPUs)."""
    replicas: int = ranged(1, ">= 1")
    """Rollout actors (vLLM engines or hf copies, Ray mode); each step's prompts are split by measured tokens/s."""
    tensor_parallel_size: int = ranged(1, ">= 1")
    """vllm on GPUs: devices per engine (replica i takes the i-th block of visible devices)."""
    weight_transport: Literal["auto", "group", "ipc"] = "auto"
    """Ray mode, trainer -> engines: group (broadcast: gloo/NCCL), ipc (handles to rank 0's memory: same host and
    device), auto (ipc when every engine shares update rank 0's GPU, else group)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """vllm: the engines' settings."""


@dataclass(kw_only=True)
class RewardConfig:
    verifiers: list[str] = field(default_factory=lambda: ["math_answer"])
    """Verifier names (built-ins: math_answer, format_integer, format_tags, code_exec) or import paths 'pkg.mod:fn'."""
    weights: list[float] = field(default_factory=list)
    """One weight per verifier; empty = all 1.0. Reward = sum(w_v * score_v), missing scores count as 0."""
    aggregate: Literal["weighted", "ensemble", "majority", "mean"] = "weighted"
    """weighted: the sum above; ensemble: P(correct | scores) from the label-free weak-verifier ensemble; majority:
    1 for the group's most common final answer, else 0 (TTRL); mean: the scores' average, NaN ignored."""
    ensemble: RewardEnsembleConfig = field(default_factory=RewardEnsembleConfig)
    """ensemble: the window, refits and model of the ensemble reward."""
    label_free: bool = False
    """Do not pass the reference answer column to verifiers (evaluation still scores against it)."""
    max_failing_steps: int = ranged(3, ">= 0", "(0 = never stop)")
    """Stop the run when a verifier raises on every item for this many steps in a row (0 = never stop)."""
    callables: list[str] = field(default_factory=list)
    """Entries of `verifiers` that were Python callables given to forge.train (module:qualname), not config names."""
    score_timeout_s: float = ranged(60.0, ">= 0", "seconds (0 = no limit)")
    """Seconds one verifier may take on one step's batch; past it the run stops with an error naming the verifier
    (a hung verifier cannot be cut off safely in-process). 0 = no limit."""
    code_exec: CodeExecConfig = field(default_factory=CodeExecConfig)
    """code_exec: the sandbox limits."""
    teacher: str = ""
    """On-policy distillation: a local HF causal LM directory with the policy's tokenizer; its log-probs of the
    sampled tokens give each one the reward log p_teacher - log p_student (docs/distillation.md); '' = off. Run it
    with update.adaptive.enabled=false: as the reverse KL falls, the grad norm per unit of it spikes and the
    controller cuts the LR (docs/distillation.md)."""
    teacher_weight: float = ranged(1.0, ">= 0")
    """teacher: advantage = verifier advantage + teacher_weight * per-token distillation advantage (with
    reward.verifiers empty: pure distillation)."""
    teacher_discount: float = ranged(0.0, "in [0, 1]", "(0 = token-local)")
    """teacher: 0 = each token's own reward (token-local); gamma in (0, 1] = the discounted return over the
    completion's later sampled tokens."""
    teacher_topk: int = ranged(0, ">= 0", "(0 = off)")
    """teacher: k > 0 = instead of rewarding the sampled token only, the update minimises the reverse KL between the
    student's and the teacher's next-token distributions at every sampled position, over the teacher's k most likely
    tokens and one bucket for the rest (GKD-style; weight reward.teacher_weight). It names the digit the student
    should have sampled, where the sampled-token reward only says its own was unlikely. Token-local: needs
    reward.teacher_discount=0."""
    teacher_divergence: Literal["reverse", "forward"] = "reverse"
    """teacher_topk: which KL over the k + 1 buckets. reverse = KL(student || teacher), mode-seeking, as the sampled-token
    reward; forward = KL(teacher || student), the teacher's cross-entropy on the student's own samples (GKD's
    "supervised KD" on-policy): its gradient stays strong where the student is confidently wrong, where the reverse
    KL's fades with the student's probability of the teacher's token."""

    def check(self, prefix: str) -> None:
        w, n = self.weights, len(self.verifiers)
        why = f"has {len(w)} values for {n} verifiers: give one per verifier (or none)"
        require(not w or len(w) == n, f"{prefix}weights", why)
        why = "needs at least one verifier (or reward.teacher set: pure distillation)"
        require(bool(self.verifiers) or bool(self.teacher), f"{prefix}verifiers", why)
        why = "is empty, but reward.aggregate=ensemble combines verifiers: name them (or use aggregate=weighted)"
        require(bool(self.verifiers) or self.aggregate != "ensemble", f"{prefix}verifiers", why)
        why = "is set, but the top-k divergence is token-local: set reward.teacher_discount=0 (or teacher_topk=0)"
        require(not self.teacher_topk or self.teacher_discount == 0, f"{prefix}teacher_topk", why)


@dataclass(kw_only=True)
class AlgoConfig:
    advantage: Literal["zscore", "mean", "loo"] = "zscore"
    """Advantage estimator: group z-score (GRPO), mean-only (Dr. GRPO), leave-one-out (RLOO)."""
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    """Policy loss (see shared/reference/grpo.md)."""
    eps_low: float = ranged(0.2, "in [0, 1)")
    """Lower clip range of the importance ratio."""
    eps_high: float = ranged(0.2, ">= 0")
    """Upper clip range of the importance ratio (DAPO uses 0.28)."""
    dual_clip: float = ranged(3.0, "> 1", "(the DAPO dual-clip constant)")
    """DAPO dual-clip constant c for negative advantages."""
    cispo_eps_max: float = ranged(4.0, "> 0")
    """CISPO: upper cap of the (stop-gradient) importance weight."""
    beta: float = ranged(0.0, ">= 0", "(0 = no KL term)")
    """k3 KL penalty to the reference policy; 0 = no reference model is loaded."""
    max_staleness: int = ranged(0, ">= 0", "(0 = on-policy)")
    """Asynchronous GRPO: the rollout of step t+k may run during the update of step t, from weights at most k
    versions older than the trainer's (0 = on-policy: rollout and update take turns). k >= 1 runs on Ray actors."""
    is_correction: Literal["auto", "none", "tis"] = "auto"
    """Off-policy correction with the sampler's log-probs: tis = truncated token-level importance weights
    min(pi_old/pi_sampler, is_cap) on the policy loss; auto = tis when max_staleness > 0, else none."""
    is_cap: float = ranged(2.0, ">= 1", "(a weight cap below 1 shrinks on-policy tokens)")
    """tis: upper bound of the importance weight."""

    @property
    def tis(self) -> bool:
        """Whether the truncated importance-sampling correction is on (resolves is_correction=auto)."""
        return self.is_correction == "tis" or (self.is_correction == "auto" and self.max_staleness > 0)


@dataclass(kw_only=True)
class UpdateConfig:
    lr: float = ranged(1e-3, "> 0")
    """Peak learning rate (AdamW)."""
    weight_decay: float = ranged(0.0, ">= 0")
    """AdamW weight decay."""
    adam_betas: list[float] = ranged([0.9, 0.99], "in [0, 1)", ", e.g. [0.9, 0.99]")
    """AdamW betas."""
    max_grad_norm: float = ranged(1.0, ">= 0", "(0 = no clipping)")
    """Clip the global gradient norm to this (0 = no clipping)."""
    micro_batch_size: int = ranged(16, ">= 1")
    """Sequences per forward/backward; the step's gradient is accumulated over micro-batches."""
    num_iterations: int = ranged(1, ">= 1")
    """PPO passes over each batch (the ratio is exactly 1 on the first)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup."""
    warmup_steps: int = ranged(0, ">= 0")
    """Linear warmup steps."""
    min_lr_ratio: float = ranged(0.1, "in [0, 1]")
    """linear/cosine: final LR as a fraction of the peak."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """Adaptive LR controller (forge/lr.py)."""
    autocast_bf16: bool = False
    """Run forward/backward under bf16 autocast (fp32 master weights and fp32 log-softmax kept)."""
    logits_completion_only: bool = True
    """Apply the LM head only to completion positions (the loss never reads prompt logits)."""
    shared_prefix: bool = True
    """Pack each micro-batch into one padding-free row in which each group's prompt is computed once (a block
    mask keeps every completion to its own context; forge/shared_prefix.py) where that costs fewer FLOPs; same
    log-probs up to float rounding."""
    num_processes: int = ranged(0, ">= 0", "(0 = from the Weaver plan)")
    """Update processes: 0 = what Weaver's plan gives the update pool (1 on a CPU machine); >1 = that many rank
    actors on Ray forming one torch.distributed group (gloo on CPU, NCCL on GPUs); rank 0 hands the new weights
    to the rollout actors through Ray's object store."""
    max_skipped_steps: int = ranged(3, ">= 1")
    """A step whose loss or gradient norm is not finite is skipped (no optimizer step, `train/skipped_steps`);
    this many in a row stop the run."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """With several update processes: DDP (replicated weights) or FSDP full shard (for models that do not fit one
    device; torch FSDP2, on CPU too). No effect with one process."""

    def check(self, prefix: str) -> None:
        require(len(self.adam_betas) == 2, f"{prefix}adam_betas", "needs two values, e.g. [0.9, 0.99]")


@dataclass(kw_only=True)
class EvalConfig:
    every: int = ranged(10, ">= 0", "(0 = only at start and end)")
    """Evaluate every this many steps (and at step 0 and the last step); 0 = only at start and end."""
    max_problems: int = ranged(200, ">= 1", "(an empty eval split cannot be evaluated)")
    """Eval problems used (from the eval split)."""
    k: int = ranged(4, ">= 0", "(0 = skip pass@k)")
    """pass@k: samples per problem (0 = skip pass@k)."""
    temperature: float = ranged(1.0, "> 0")
    """Sampling temperature for pass@k."""
    max_new_tokens: int = ranged(0, ">= 0", "(0 = rollout.max_new_tokens)")
    """Completion length cap during evaluation (0 = rollout.max_new_tokens)."""
    batch_size: int = ranged(64, ">= 1")
    """Sequences per generate() call during evaluation (hf backend; vLLM batches by itself)."""
    num_samples_saved: int = ranged(20, ">= 0")
    """Samples stored in each eval report."""
    verifiers: list[str] = field(default_factory=list)
    """Verifiers deciding pass@1/pass@k (a completion is correct when each scores >= 1.0); names or import paths as
    in reward.verifiers; empty = the run's correctness verifiers, else math_answer (rule: forge/evaluate.py)."""

    def check(self, prefix: str) -> None:
        twice = len(set(self.verifiers)) != len(self.verifiers)
        require(not twice, f"{prefix}verifiers", "lists a verifier twice: list it once")


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = ranged(10, ">= 0", "(0 = only at the end)")
    """Checkpoint every this many steps (the last step always); 0 = only at the end."""
    keep_last: int = ranged(2, ">= 1", "(the newest checkpoint is what --resume continues from)")
    """Keep this many most recent checkpoints."""
    keep_best: int = ranged(1, ">= 0")
    """Also keep this many best checkpoints: by probe pass@1 with a probe set (collapse.probe_source), else by eval
    pass@1."""
    async_save: bool = True
    """Copy the state to host memory, let training continue and write it in a background thread (at most one save
    in flight; the run waits for it before it ends); false = training waits until the checkpoint is written."""
    hf_model: bool = True
    """With one update process, write the HF weights (model.safetensors) into every checkpoint (they are in that
    process already). With several ranks checkpoints are sharded and the run exports its last one at the end."""


@dataclass(kw_only=True)
class OrchestrationConfig:
    retries: int = ranged(1, ">= 0")
    """Prefect path: times a failed stage task is retried (only stages safe to repeat: rollout, reward, evaluate,
    checkpoint; an update is never retried) before the flow run fails with its error."""
    retry_delay_s: float = ranged(1.0, ">= 0", "seconds")
    """Seconds between stage retries."""
    execution: Literal["auto", "embedded", "ray"] = "auto"
    """embedded: every stage in this process (one update process, hf rollout); ray: every stage in a long-lived
    Ray actor on the pool Weaver plans for it; auto: ray when the run needs other processes (rollout.backend=vllm,
    update.num_processes > 1, algo.max_staleness > 0 or orchestration.ray_address set), else embedded."""
    ray_address: str = ""
    """ray: the cluster to join (`auto` = the one this machine belongs to, or host:port); empty = start a private
    Ray instance on 127.0.0.1 for this run and stop it at the end."""
    max_restarts: int = ranged(2, ">= 0")
    """Times the workers are rebuilt after one dies (the run continues from its last checkpoint); then it fails."""
    reserve_timeout_s: float = ranged(300.0, ">= 0", "seconds")
    """ray: how long a run waits for the GPUs and CPUs its plan needs while another run holds them; then it stops
    with one line naming them (never shares a GPU)."""


@dataclass(kw_only=True)
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
    timeout_s: int = ranged(10, ">= 1", "second")
    """Seconds per HTTP request to a tracking server (sets MLFLOW_HTTP_REQUEST_TIMEOUT unless already set)."""
    finish_timeout_s: float = ranged(120.0, ">= 0", "seconds")
    """At the end of a run, wait this long for unsent records; the rest stays in the outbox for `forgeweave sync`."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <run_dir>/tensorboard/ (needs the tensorboard package; works offline)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package); files under <run_dir>/wandb/, offline by default."""
    wandb_project: str = "forgeweave"
    """W&B project the run is logged to."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode: offline (files only; upload later with `wandb sync`) or online (needs `wandb login`)."""


@dataclass(kw_only=True)
class RunConfig:
    preset: str = ""
    """Preset this config was built from (informational)."""
    seed: int = ranged(0, ">= 0")
    """Seed for data, sampling and initialisation."""
    steps: int = ranged(30, ">= 1")
    """Training steps (one rollout + update each)."""
    threads: int = ranged(0, ">= 0", "(0 = torch's default)")
    """torch CPU threads (0 = leave torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the environment class, tools and limits (forge/env; empty = single-turn)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    pools: list[dict] = field(default_factory=list)
    """Resource pools for Weaver (name, kind cpu/gpu, devices, host, work_pool); empty = autodetect this machine."""

    def validate(self) -> RunConfig:
        """Check every number (finite, in its field's range), each section's own rules, then the rules spanning
        sections; raises ConfigError naming the dotted key, the value and what to do."""
        config_base.check_tree(self)
        r, u, lora = self.rollout, self.update, self.model.lora
        completions = r.prompts_per_step * r.group_size
        why = f"is larger than the {completions} completions of a step: lower it"
        require(completions >= u.num_processes, "update.num_processes", why)
        restores = bool(self.collapse.probe_source) and self.collapse.action in ("stop", "rollback")
        why = f"is 0, but collapse.action={self.collapse.action} needs the best-probe checkpoint: set it >= 1"
        require(not restores or self.checkpoint.keep_best > 0, "checkpoint.keep_best", why)
        why = "> 0 cannot be combined with update.strategy=fsdp: use ddp (the adapter is small) or full fine-tuning"
        require(not (lora.rank and u.strategy == "fsdp" and u.num_processes > 1), "model.lora.rank", why)
        sessions = self.env.openenv_max_sessions
        why = f"is {sessions}, fewer than rollout.replicas={r.replicas}, which share the server at env.openenv_url: "
        why += "raise it"
        require(not (self.env.openenv_url and 0 < sessions < r.replicas), "env.openenv_max_sessions", why)
        return self


# ---------------------------------------------------------------- RunConfig in and out (old keys upgraded)


def from_dict(data: dict[str, Any], cls: type = RunConfig, prefix: str = "", source: str = "", base: Any = None) -> Any:
    """Build a dataclass from a (possibly partial) nested dict, checking every key and type; the keys `data` sets
    replace those of `base` (updated in place; default: a fresh `cls()`). A RunConfig's old keys are upgraded."""
    if cls is RunConfig and not prefix:
        data = config_compat.upgrade(data, source)
    return config_base.from_dict(data, cls, prefix, source, base)


def load_yaml(path: str | Path) -> RunConfig:
    p = Path(path)
    return from_dict(read_yaml_file(p) or {}, RunConfig, "", f"{p}: ")


def overlay(cfg: RunConfig, data: Any, source: str = "") -> RunConfig:
    """A copy of `cfg` with the keys a (partial) YAML mapping sets replaced, section by section; the rest stays."""
    import copy

    return from_dict(data if data is not None else {}, RunConfig, "", source, base=copy.deepcopy(cfg))


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.field=value` strings; values are parsed as YAML scalars/lists then type-checked."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. update.lr=1e-5)")
        dotted, raw = item.split("=", 1)
        if upgraded := config_compat.upgrade_override(cfg, dotted.strip(), raw):
            config_base.set_dotted(cfg, *upgraded)
    return cfg


def describe_keys(section: str = "", root: type = RunConfig) -> list[KeyDoc]:
    """Every leaf key of `root` in declaration order, with type, default and one-line doc (`config keys`)."""
    return config_base.describe_keys(section, root)
