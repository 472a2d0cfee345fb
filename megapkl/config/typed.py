"""Strict mapping -> dataclass conversion.

Every config section is a plain dataclass. `build(cls, mapping, key=..., source=...)` turns a YAML
mapping into an instance and fails loudly, naming the file and the dotted key, on unknown keys (with a
did-you-mean suggestion), wrong types and out-of-range values. Range bounds live in field metadata
(`rng(lo, hi)`); cross-field rules live in an optional `check(self, err)` method on the dataclass.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Callable, Literal, Union

from megapkl.errors import MegapklError


class ConfigError(MegapklError, ValueError):
    """A config problem. `key` is the dotted key, `source` the file (or '<dict>', '<override>').

    `line` (1-based, optional) is where in `source` the key was written; `related` names further dotted
    keys of a cross-field conflict; `detail` is the bare message, so a loader can re-attribute the
    error to the file that introduced the key without parsing the formatted text.
    """

    def __init__(self, message: str, key: str = "", source: str = "", *, line: int | None = None,
                 related: tuple[str, ...] = ()) -> None:
        self.key = key
        self.source = source
        self.line = line
        self.related = tuple(related)
        self.detail = message
        where = f"{source}:{line}: " if source and line else (f"{source}: " if source else "")
        at = f"{key}: " if key else ""
        super().__init__(f"{where}{at}{message}")


def rng(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
        hi_open: bool = False, **extra: Any) -> dict[str, Any]:
    """Field metadata for a numeric range check ([lo, hi], endpoints optionally open)."""
    return {"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, **extra}


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def suggest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple, dict):
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _fail(msg: str, key: str, source: str) -> typing.NoReturn:
    raise ConfigError(msg, key=key, source=source)


def convert(tp: Any, value: Any, key: str, source: str) -> Any:
    """Convert `value` to type `tp` or raise a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            _fail(f"expected a mapping (section {tp.__name__}), got {value!r}", key, source)
        return build(tp, value, key=key, source=source)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            _fail(f"must not be null (expected {type_name(tp)})", key, source)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, key, source)
            except ConfigError as exc:
                errors.append((arg, exc))
        # A mapping meant for a section: its own error (unknown key, bad value) is the useful one.
        for arg, exc in errors:
            if isinstance(value, dict) and dataclasses.is_dataclass(arg):
                raise exc
        hint = ""
        if isinstance(value, str):
            words = [str(a) for arg, _ in errors if typing.get_origin(arg) is Literal
                     for a in typing.get_args(arg)]
            hint = suggest(value, words)
        _fail(f"expected {type_name(tp)}, got {value!r}{hint}", key, source)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        hint = suggest(str(value), [str(a) for a in allowed]) if isinstance(value, str) else ""
        _fail(f"expected one of {', '.join(repr(a) for a in allowed)}, got {value!r}{hint}", key, source)
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(f"expected a boolean (true/false), got {value!r}", key, source)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(f"expected an integer, got {value!r}", key, source)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        _fail(f"expected a number, got {value!r}", key, source)
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(f"expected a string, got {value!r}", key, source)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            _fail(f"expected a list, got {value!r}", key, source)
        return [convert(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            _fail(f"expected a list of {len(args)} items, got {value!r}", key, source)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value))
        if len(value) != len(args):
            _fail(f"expected a list of {len(args)} items, got {len(value)}: {value!r}", key, source)
        return tuple(convert(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        kt, vt = typing.get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            _fail(f"expected a mapping, got {value!r}", key, source)
        return {convert(kt, k, join(key, str(k)), source): convert(vt, v, join(key, str(k)), source)
                for k, v in value.items()}
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def check_range(value: Any, meta: typing.Mapping[str, Any], key: str, source: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
        op = ">" if meta.get("lo_open") else ">="
        _fail(f"must be {op} {lo}, got {value!r}", key, source)
    if hi is not None and (value > hi or (meta.get("hi_open") and value == hi)):
        op = "<" if meta.get("hi_open") else "<="
        _fail(f"must be {op} {hi}, got {value!r}", key, source)


def build(cls: type, mapping: typing.Mapping[str, Any], *, key: str = "", source: str = "<dict>") -> Any:
    """Instantiate dataclass `cls` from `mapping` with strict validation."""
    if not isinstance(mapping, dict):
        _fail(f"expected a mapping, got {mapping!r}", key, source)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    retired = getattr(cls, "RETIRED", {})
    for name in mapping:
        if name in retired and name not in fields:
            kept, why = retired[name]
            if type(mapping[name]) is not type(kept) or mapping[name] != kept:
                _fail(f"removed key '{name}' ({why}): it can only be {kept!r}; delete it",
                      join(key, str(name)), source)
        elif name not in fields:
            _fail(f"unknown key '{name}'{suggest(str(name), fields)}", join(key, str(name)), source)
    kwargs = {}
    for name, f in fields.items():
        sub = join(key, name)
        if name in mapping:
            kwargs[name] = convert(hints[name], mapping[name], sub, source)
            check_range(kwargs[name], f.metadata, sub, source)
        elif dataclasses.is_dataclass(hints[name]):
            # An absent section is built from {} so that its own `check` still runs.
            kwargs[name] = build(hints[name], {}, key=sub, source=source)
    obj = cls(**kwargs)
    checker: Callable[..., None] | None = getattr(obj, "check", None)
    if checker is not None:
        def err(msg: str, field_name: str = "", *related: str) -> typing.NoReturn:
            raise ConfigError(msg, key=join(key, field_name) if field_name else key, source=source,
                              related=tuple(join(key, r) for r in related))
        checker(err)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
