"""Turn `reward.verifiers` entries into callables: a built-in name or an import path 'pkg.module:function'.

Every mistake is a `UserError` with a one-line message. A verifier is also checked to accept
`prompts=`, `completions=` and extra columns by keyword, because that is how `score_completions` calls it.

Python callables handed to `forge.train(reward_funcs=[...])` are named 'module:qualname' in the config
(`callable_spec`; also listed in `reward.callables`) and resolved, inside `provided(...)`, to the objects
given, so a function defined in a notebook works in-process. Outside it such a name is imported like any
import path; one that cannot be (a notebook's `__main__`, a closure) is a UserError saying to run or resume
the run through `forge.train` with the same functions (`check_callables`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
from typing import TYPE_CHECKING

from forge.errors import UserError
from forge.rewards.verifiers import BUILTIN, Verifier

if TYPE_CHECKING:
    from forge.rewards.config import RewardConfig

CONFIGURED = ("code_exec",)
"""Built-ins built from RewardConfig fields (code_exec: the sandbox limits) when they are resolved."""
CORRECTNESS = ("math_answer", "code_exec")
"""Built-ins that judge correctness against the reference answer: by default they decide eval pass@1/pass@k."""

_PROVIDED: dict[str, Verifier] = {}  # 'module:qualname' -> the callable forge.train was given (see `provided`)


def callable_spec(fn: Verifier) -> str:
    """The 'module:qualname' a Python callable is recorded under in reward.verifiers.

    >>> from forge.rewards.verifiers import format_tags
    >>> callable_spec(format_tags)
    'forge.rewards.verifiers:format_tags'
    """
    owner = fn if hasattr(fn, "__qualname__") else type(fn)  # a callable object: its class names it
    return f"{getattr(owner, '__module__', None) or '__main__'}:{owner.__qualname__}"


def callable_name(fn: Verifier) -> str:
    """A callable's verifier name (its score column, metrics `reward/<name>/...`): its __name__, like TRL."""
    return getattr(fn, "__name__", None) or type(fn).__name__


@contextlib.contextmanager
def provided(functions: dict[str, Verifier]):
    """Within the block, each 'module:qualname' in `functions` resolves to its callable (forge.train's
    reward_funcs); restored afterwards."""
    before = dict(_PROVIDED)
    _PROVIDED.update(functions)
    try:
        yield
    finally:
        _PROVIDED.clear()
        _PROVIDED.update(before)


def provided_object(spec: str) -> object | None:
    """The object forge.train was given under 'module:qualname' (a reward function, an environment class, a tool),
    or None."""
    return _PROVIDED.get(spec)


def check_callables(reward: RewardConfig, resume: bool = False) -> None:
    """Every Python callable a run was given (reward.callables) is provided here or importable by its name;
    else a UserError saying to go through forge.train with the same functions."""
    missing = []
    for spec in reward.callables:
        if spec in _PROVIDED:
            continue
        try:
            resolve_verifier(spec, reward)
        except UserError:
            missing.append(spec)
    if missing:
        how = "forge.train(..., resume=True, reward_funcs=[...])" if resume else "forge.train(..., reward_funcs=[...])"
        raise UserError(
            f"this run's reward functions {', '.join(missing)} were Python callables given to forge.train and "
            f"cannot be imported here; {'resume' if resume else 'run'} it through {how} with the same functions"
        )


def resolve_verifier(spec: str, reward: RewardConfig | None = None) -> tuple[str, Verifier]:
    """(name, fn) for a built-in name or 'pkg.module:function' (name = the function's attribute name).
    `reward` configures the built-ins that take settings (code_exec); None = their defaults."""
    spec = spec.strip()
    if spec in _PROVIDED:
        fn = _PROVIDED[spec]
        _check_signature(spec, fn)
        return callable_name(fn), fn
    if "=" in spec.split(":", 1)[0]:
        return _model_verifier(spec)
    if spec in CONFIGURED:
        return spec, _configured(spec, reward)
    if ":" not in spec:
        return spec, _builtin(spec)
    module_path, _, attr = spec.partition(":")
    if not module_path or not attr or ":" in attr:
        raise UserError(f"verifier '{spec}' in reward.verifiers must look like 'pkg.module:function'")
    fn = _attribute(_import(spec, module_path), attr)
    if fn is None:
        raise UserError(f"verifier '{spec}': module '{module_path}' has no attribute '{attr}'; check the name")
    if not callable(fn):
        raise UserError(f"verifier '{spec}' is a {type(fn).__name__}, not a function; point it at a callable")
    _check_signature(spec, fn)
    return attr.rsplit(".", 1)[-1], fn


def _attribute(obj: object, dotted: str) -> object | None:
    """obj.a.b for 'a.b' (a qualname: a function in a class or namespace), None when a part is missing."""
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def resolve_verifiers(specs: list[str], reward: RewardConfig | None = None) -> list[tuple[str, Verifier]]:
    """Resolve each spec; two verifiers with the same name would share one score column, so that is an error."""
    if reward is not None:
        check_callables(reward)
    resolved = [resolve_verifier(s, reward) for s in specs]
    names = [name for name, _ in resolved]
    for name in names:
        if names.count(name) > 1:
            raise UserError(f"reward.verifiers names '{name}' twice; list each verifier once")
    return resolved


def _model_verifier(spec: str) -> tuple[str, Verifier]:
    """'reward_model=PATH' or 'llm_judge=PATH': a model-based verifier loaded from a local directory."""
    from forge.rewards.judges import FACTORIES

    kind, _, path = spec.partition("=")
    if kind not in FACTORIES or not path:
        raise UserError(f"verifier '{spec}': use reward_model=PATH or llm_judge=PATH (a local model directory)")
    return kind, FACTORIES[kind](path)


def _configured(name: str, reward: RewardConfig | None) -> Verifier:
    from forge.rewards.code_exec import limits_from, make_code_exec
    from forge.rewards.config import RewardConfig

    r = reward or RewardConfig()
    return make_code_exec(limits_from(r.code_exec), allow_network=r.code_exec.allow_network)


def _builtin(name: str) -> Verifier:
    from forge.rewards.weak import WEAK
    from forge.tasks.arith import CHECKS as ARITH_CHECKS

    weak = {**WEAK, **ARITH_CHECKS}  # generic label-free verifiers, then the tasks' own checks
    if name in BUILTIN:
        return BUILTIN[name]
    if name == "env_reward":
        from forge.env.rewards import env_reward

        return env_reward
    if name in weak:
        return weak[name]
    names = [*BUILTIN, *CONFIGURED, "env_reward", *weak]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    valid = ", ".join(names)
    raise UserError(
        f"unknown verifier '{name}' in reward.verifiers; {hint}built-ins: {valid}, or an import path 'pkg.module:fn'"
    )


def _import(spec: str, module_path: str) -> object:
    try:
        return importlib.import_module(module_path)
    except Exception as e:  # ImportError, or any error raised while the user's module runs
        why = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(
            f"verifier '{spec}': cannot import module '{module_path}' ({why}); check it is on PYTHONPATH"
        ) from None


def _check_signature(spec: str, fn: Verifier) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins and C callables have no signature to check
    try:
        sig.bind_partial(prompts=[], completions=[], some_column=[])
    except TypeError as e:
        raise UserError(
            f"verifier '{spec}' must accept (prompts, completions, **kwargs) by keyword ({e}); add **kwargs"
        ) from None
