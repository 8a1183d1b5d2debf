"""Typed run configuration: `RunConfig` composes one keyword-only dataclass per component, each beside its code.

Sections beside their component: `model` (forge/model_config.py), `data` (forge/data/config.py), `rollout`
(forge/rollout/config.py), `reward` (forge/rewards/config.py), `distill` (forge/rewards/distill_config.py), `env` with
`env.openenv` and `env.agent` (forge/env/config.py), `update` and `algo` (forge/trainer_config.py), `update.adaptive`
(forge/lr.py), `collapse` (forge/guard.py); each in a module that imports no torch, so `forgeweave config` stays
cheap. The run-level sections (eval, checkpoint, orchestration, tracking) stay here. Components take their own
sections; only this composite, `forge.compose` and the API know `RunConfig` (tests/test_config_sections.py). Each
field's range rule sits on it (`ranged`), a section's cross-field rules in its
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
from forge.data.config import DataConfig
from forge.env.config import EnvConfig
from forge.guard import CollapseConfig
from forge.model_config import LoraConfig, ModelConfig, TinyConfig  # noqa: F401  (re-exported)
from forge.rewards.config import RewardConfig
from forge.rewards.distill_config import DistillConfig
from forge.rollout.config import RolloutConfig, VllmConfig  # noqa: F401  (re-exported)
from forge.trainer_config import AlgoConfig, UpdateConfig


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
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: the teacher, its weight and discount, its top-k divergence (off without a teacher)."""
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
        why = "needs at least one verifier (or distill.teacher set: pure distillation)"
        require(bool(self.reward.verifiers) or bool(self.distill.teacher), "reward.verifiers", why)
        completions = r.prompts_per_step * r.group_size
        why = f"is larger than the {completions} completions of a step: lower it"
        require(completions >= u.num_processes, "update.num_processes", why)
        restores = bool(self.collapse.probe_source) and self.collapse.action in ("stop", "rollback")
        why = f"is 0, but collapse.action={self.collapse.action} needs the best-probe checkpoint: set it >= 1"
        require(not restores or self.checkpoint.keep_best > 0, "checkpoint.keep_best", why)
        why = "> 0 cannot be combined with update.strategy=fsdp: use ddp (the adapter is small) or full fine-tuning"
        require(not (lora.rank and u.strategy == "fsdp" and u.num_processes > 1), "model.lora.rank", why)
        openenv = self.env.openenv
        why = f"is {openenv.max_sessions}, fewer than rollout.replicas={r.replicas}, which share the server at "
        why += "env.openenv.url: raise it"
        require(not (openenv.url and 0 < openenv.max_sessions < r.replicas), "env.openenv.max_sessions", why)
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
