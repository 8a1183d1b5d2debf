"""Config keys of earlier releases: one table (`RENAMED`, old dotted key -> new), applied to YAML mappings
(`upgrade`: config files, a run's config.yaml on --resume) and to `--set` overrides (`upgrade_override`).

Each old key used prints one line to stderr naming its new key (once per key per process); the value moves
unchanged, except three keys whose form changed: `update.adaptive: true/false` (a bool before the section existed)
becomes `update.adaptive.enabled`, `env.agent: pkg.mod:fn` (a string before the section existed) becomes
`env.agent.fn`, and `eval.check: NAME` (one verifier) becomes `eval.verifiers: [NAME]` (an empty one is dropped). A
mapping that sets both an old key and its new one is a ConfigError: which one to keep is a person's choice.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from forge.config_base import ConfigError

# old dotted key -> new dotted key; `update.adaptive` comes before `update.adaptive_*` (and `env.agent` before
# `env.agent_*`): the scalar makes the section
RENAMED: dict[str, str] = {
    "model.tiny_hidden": "model.tiny.hidden",
    "model.tiny_layers": "model.tiny.layers",
    "model.tiny_head_dim": "model.tiny.head_dim",
    "rollout.vllm_python": "rollout.vllm.python",
    "rollout.vllm_kv_cache_gib": "rollout.vllm.kv_cache_gib",
    "rollout.vllm_start_timeout_s": "rollout.vllm.start_timeout_s",
    "rollout.vllm_dtype": "rollout.vllm.dtype",
    "rollout.vllm_gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm_enforce_eager": "rollout.vllm.enforce_eager",
    "rollout.vllm_max_model_len": "rollout.vllm.max_model_len",
    "rollout.vllm_sleep": "rollout.vllm.sleep",
    "reward.window_steps": "reward.ensemble.window_steps",
    "reward.refit_every": "reward.ensemble.refit_every",
    "reward.ensemble_model": "reward.ensemble.model",
    "reward.ensemble_classes": "reward.ensemble.classes",
    "reward.necessary_checks": "reward.ensemble.necessary_checks",
    "reward.collapse_action": "collapse.action",
    "reward.collapse_drop": "collapse.drop",
    "reward.max_rollbacks": "collapse.max_rollbacks",
    "reward.code_timeout_s": "reward.code_exec.timeout_s",
    "reward.code_test_timeout_s": "reward.code_exec.test_timeout_s",
    "reward.code_memory_mb": "reward.code_exec.memory_mb",
    "reward.code_max_procs": "reward.code_exec.max_procs",
    "reward.code_workers": "reward.code_exec.workers",
    "reward.allow_network_code": "reward.code_exec.allow_network",
    "update.adaptive": "update.adaptive.enabled",
    "update.adaptive_signal": "update.adaptive.signal",
    "update.adaptive_target": "update.adaptive.target",
    "update.adaptive_cut": "update.adaptive.cut",
    "update.adaptive_recover": "update.adaptive.recover",
    "eval.check": "eval.verifiers",
    "eval.probe_source": "collapse.probe_source",
    "eval.probe_every": "collapse.probe_every",
    "eval.probe_max_problems": "collapse.probe_max_problems",
    "env.openenv_url": "env.openenv.url",
    "env.openenv_app": "env.openenv.app",
    "env.openenv_command": "env.openenv.command",
    "env.openenv_text_action": "env.openenv.text_action",
    "env.openenv_max_sessions": "env.openenv.max_sessions",
    "env.openenv_timeout_s": "env.openenv.timeout_s",
    "env.openenv_start_timeout_s": "env.openenv.start_timeout_s",
    "env.agent": "env.agent.fn",
    "env.agent_timeout_s": "env.agent.timeout_s",
    "env.agent_max_concurrent": "env.agent.max_concurrent",
    "env.agent_batch_wait_ms": "env.agent.batch_wait_ms",
    "env.agent_request_sampling": "env.agent.request_sampling",
    "reward.teacher": "distill.teacher",
    "reward.teacher_weight": "distill.weight",
    "reward.teacher_discount": "distill.discount",
    "reward.teacher_topk": "distill.topk",
    "reward.teacher_divergence": "distill.divergence",
}
_noted: set[str] = set()


def note(old: str) -> None:
    """The one stderr line for an old key (once per key per process)."""
    if old not in _noted:
        _noted.add(old)
        print(f"forgeweave: config key '{old}' is now '{RENAMED[old]}'", file=sys.stderr)


def upgrade(data: Any, source: str = "") -> Any:
    """A copy of a (partial) RunConfig mapping with every old key moved to its new place; anything else as it was
    (a malformed mapping is left for from_dict to reject)."""
    if not isinstance(data, dict) or not any(_holds(data, old) for old in RENAMED):
        return data
    data = copy.deepcopy(data)
    for old in RENAMED:
        if _holds(data, old):
            _move(data, old, source)
    return data


def _holds(data: dict, old: str) -> bool:
    section, name = old.split(".")
    sec = data.get(section)
    if not isinstance(sec, dict) or name not in sec:
        return False
    return not (RENAMED[old].startswith(f"{old}.") and isinstance(sec[name], dict))  # the new section, not a scalar


def _move(data: dict, old: str, source: str) -> None:
    section, name = old.split(".")
    value = data[section].pop(name)
    note(old)
    if old == "eval.check":
        if not value:
            return
        if data[section].get("verifiers"):
            raise ConfigError(f"{source}config key 'eval.check' is the old form of eval.verifiers: set only one")
        value = [value]
    *parents, leaf = RENAMED[old].split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            return  # e.g. `collapse: 3`: from_dict names the bad section
    if leaf in node and old != "eval.check":  # eval.verifiers: [] beside check: NAME is what old files hold
        raise ConfigError(f"{source}config key '{old}' is the old name of '{RENAMED[old]}': set only one")
    node[leaf] = value


def upgrade_override(cfg: Any, dotted: str, raw: str) -> tuple[str, str] | None:
    """An override's (key, value text) under the new layout; None when there is nothing to set (`eval.check=`)."""
    if dotted not in RENAMED:
        return dotted, raw
    note(dotted)
    if dotted == "eval.check":
        if not raw.strip():
            return None
        if cfg.eval.verifiers:
            raise ConfigError("config key 'eval.check' is the old form of eval.verifiers: set only one")
    return RENAMED[dotted], raw
