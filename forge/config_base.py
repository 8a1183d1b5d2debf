"""The machinery every config section uses: `ConfigError`, range rules on fields, (de)serialisation, key docs.

Sections are `@dataclass(kw_only=True)` classes that live beside their component (`forge.lr.AdaptiveConfig`,
`forge.guard.CollapseConfig`, ...); `forge.config.RunConfig` nests them. Nothing here knows `RunConfig`, so a
component module imports this file (stdlib and yaml only) without importing the whole config.

A field's range rule sits on the field: `lr: float = ranged(1e-3, "> 0")`; `check_tree` checks every float is finite,
then every rule (a list field item by item), then each section's own cross-field `check(prefix)`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from forge.errors import UserError


class ConfigError(UserError):
    """A config key, value or file a person got wrong."""


# ---------------------------------------------------------------- rules beside the fields

_BOUND = re.compile(r"(>=|>) (-?[\d.]+)")
_INTERVAL = re.compile(r"in ([\[(])(-?[\d.]+), (-?[\d.]+)([\])])")


def ranged(default: Any, rule: str, note: str = "") -> Any:
    """A dataclass field with a range rule: `rule` is `>= N`, `> N` or an interval `in [a, b)`; a failing value is
    the error "config key 'K' must be <rule> <note>, got V" (a list default is copied per instance)."""
    _predicate(rule)  # a typo in a rule fails at import, not at the first bad value
    meta = {"rule": rule, "note": note}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@functools.cache
def _predicate(rule: str) -> Callable[[float], bool]:
    if m := _BOUND.fullmatch(rule):
        op, bound = m.group(1), float(m.group(2))
        return (lambda v: v >= bound) if op == ">=" else (lambda v: v > bound)
    if m := _INTERVAL.fullmatch(rule):
        lo_closed, lo, hi, hi_closed = m.group(1) == "[", float(m.group(2)), float(m.group(3)), m.group(4) == "]"
        return lambda v: (lo <= v if lo_closed else lo < v) and (v <= hi if hi_closed else v < hi)
    raise ValueError(f"bad range rule {rule!r}: use '>= N', '> N' or 'in [a, b)'")


def require(ok: bool, key: str, why: str) -> None:
    """Raise the one-line ConfigError "config key 'KEY' WHY" unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}' {why}")


def check_tree(cfg: Any) -> None:
    """Every float finite (NaN or inf would reach the weights), every field rule, then each section's `check`."""
    leaves = list(_leaf_items(cfg, ""))
    for name, v, _ in leaves:
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"config key '{name}' must be a finite number, got {v!r}: set a real value")
    for name, v, meta in leaves:
        if "rule" in meta and not _predicate(meta["rule"])(v):
            note = meta["note"] if meta["note"].startswith(",") or not meta["note"] else " " + meta["note"]
            require(False, name, f"must be {meta['rule']}{note}, got {v!r}")
    _check_sections(cfg, "")


def _leaf_items(obj: Any, prefix: str) -> Iterator[tuple[str, Any, typing.Mapping]]:
    """(dotted key, value, field metadata) per leaf; a list field yields `key[i]` per item."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _leaf_items(value, f"{key}.")
        elif isinstance(value, list):
            yield from ((f"{key}[{i}]", v, f.metadata) for i, v in enumerate(value))
        else:
            yield key, value, f.metadata


def _check_sections(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_sections(value, f"{prefix}{f.name}.")
    if prefix and hasattr(obj, "check"):
        obj.check(prefix)


# ---------------------------------------------------------------- (de)serialisation


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(data: dict[str, Any], cls: type, prefix: str = "", source: str = "", base: Any = None) -> Any:
    """Build a dataclass from a (possibly partial) nested dict, checking every key and type; the keys `data` sets
    replace those of `base` (updated in place; default: a fresh `cls()`), section by section."""
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"{source}config section '{section}' must be a mapping, got {type(data).__name__}")
    obj = cls() if base is None else base
    for key, value in data.items():
        _set_field(obj, key, value, prefix, source)
    return obj


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation, for the dataclass fields only (not ClassVars)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _set_field(obj: Any, key: str, value: Any, prefix: str, source: str) -> None:
    types_ = field_types(type(obj))
    full = f"{prefix}{key}"
    if key not in types_:
        raise ConfigError(f"{source}unknown config key '{full}'{suggest(key, types_, prefix)}")
    hint = types_[key]
    if dataclasses.is_dataclass(hint):
        setattr(obj, key, from_dict(value, hint, f"{full}.", source, base=getattr(obj, key)))
    else:
        setattr(obj, key, _coerce(value, hint, full, source))


def suggest(key: str, names: Iterable[str], prefix: str) -> str:
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
    scalar = _SCALARS.get(hint)
    return value if scalar is None else scalar(value, bad)


def _to_bool(value: Any, bad: ConfigError) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise bad


def _to_number(kind: type) -> Callable[[Any, ConfigError], Any]:
    """int: ints and numeric strings; float: ints, floats and numeric strings; never a bool."""
    accepted = (int,) if kind is int else (int, float)

    def convert(value: Any, bad: ConfigError) -> Any:
        if isinstance(value, bool) or not isinstance(value, (*accepted, str)):
            raise bad
        try:
            return kind(value)
        except ValueError:
            raise bad from None

    return convert


def _to_str(value: Any, bad: ConfigError) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise bad
    return value


_SCALARS: dict[Any, Callable[[Any, ConfigError], Any]] = {
    bool: _to_bool,
    int: _to_number(int),
    float: _to_number(float),
    str: _to_str,
}


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def set_dotted(root: Any, dotted: str, raw: str) -> None:
    """Set one `section.field` key from override text (parsed as YAML, then type-checked)."""
    parts = dotted.strip().split(".")
    obj, prefix = root, ""
    for p in parts[:-1]:
        hints = field_types(type(obj))
        if p not in hints or not dataclasses.is_dataclass(hints[p]):
            raise ConfigError(f"unknown config section '{prefix}{p}'{suggest(p, _sections(obj), prefix)}")
        obj, prefix = getattr(obj, p), f"{prefix}{p}."
    _set_field(obj, parts[-1], _parse_value(raw, field_types(type(obj)).get(parts[-1])), prefix, "")


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
    return [k for k, t in field_types(type(obj)).items() if dataclasses.is_dataclass(t)]


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


def config_diff(old: Any, new: Any) -> dict[str, list]:
    """Dotted key -> [old, new] for every leaf whose value differs (in declaration order)."""
    before, after = _leaves(old), _leaves(new)
    return {k: [before[k], v] for k, v in after.items() if before[k] != v}


def _leaves(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out.update(_leaves(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {f"{prefix}{f.name}": v})
    return out


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
    """The field's docstring in its section's class, on one line."""


def describe_keys(section: str, root: type) -> list[KeyDoc]:
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


def _describe(cls: type, default: Any, prefix: str) -> Iterator[KeyDoc]:
    hints, docs = field_types(cls), field_docs(cls)
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
