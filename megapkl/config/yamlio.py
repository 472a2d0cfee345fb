"""YAML reading and writing for configs: safe, line-aware, and without YAML 1.1's number traps.

PyYAML follows YAML 1.1, where `lr: 1e-6` is the *string* '1e-6' (a float needs a dot) and
`time: 4:00:00` is the base-60 integer 14400. Both bite RL configs, so the config loader and dumper
use one resolver table: decimal/hex integers, floats with a dot or an exponent, .inf/.nan, and no
base-60 numbers. Reading also records the line of every key (for error messages) and rejects
duplicate keys, which PyYAML would silently collapse.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

from megapkl.config.typed import ConfigError

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$|^0x[0-9a-fA-F_]+$")
_FLOAT = re.compile(r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?$
                       |^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$
                       |^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$""", re.X)


def _resolver_table() -> dict[str, list]:
    base = yaml.SafeLoader.yaml_implicit_resolvers
    table = {ch: [(tag, rx) for tag, rx in lst if tag not in (_INT_TAG, _FLOAT_TAG)]
             for ch, lst in base.items()}
    for ch in "-+0123456789":
        table.setdefault(ch, []).append((_INT_TAG, _INT))
    for ch in "-+0123456789.":
        table.setdefault(ch, []).append((_FLOAT_TAG, _FLOAT))
    return table


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader with the number rules above."""


class ConfigDumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings ConfigLoader would read as something else."""


ConfigLoader.yaml_implicit_resolvers = _resolver_table()
ConfigDumper.yaml_implicit_resolvers = ConfigLoader.yaml_implicit_resolvers


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = len(data) <= 8 and all(isinstance(v, (int, float, bool)) or v is None for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


ConfigDumper.add_representer(list, _represent_list)


def load_value(text: str) -> Any:
    """One YAML scalar/flow value, as an override's right-hand side (`[0,5]`, `null`, `1e-6`)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader


def parse(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """Parse a YAML document: (data, {dotted key: 1-based line}). Errors name `source` and line."""
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        if node is not None:
            _walk(node, "", lines, source)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(str(exc.problem or exc.context or exc).split())
        raise ConfigError(f"YAML syntax error: {problem}", source=source,
                          line=mark.line + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML error: {' '.join(str(exc).split())}", source=source) from None
    finally:
        loader.dispose()
    return data, lines


def _walk(node: yaml.Node, prefix: str, lines: dict[str, int], source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for knode, vnode in node.value:
            if knode.tag == _MERGE_TAG:
                continue
            name = str(knode.value)
            path = f"{prefix}.{name}" if prefix else name
            if name in seen:
                raise ConfigError(f"duplicate key '{name}' (an earlier line sets it already)",
                                  key=path, source=source, line=knode.start_mark.line + 1)
            seen.add(name)
            lines[path] = knode.start_mark.line + 1
            _walk(vnode, path, lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}[{i}]"
            lines[path] = item.start_mark.line + 1
            _walk(item, path, lines, source)


def dump(data: Any) -> str:
    """YAML text that `parse` reads back to equal data (key order kept)."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)


def parse_mapping(text: str, source: str, what: str) -> tuple[dict, dict]:
    """`parse`, requiring a top-level mapping (an empty document is {}); `what` names it in the error."""
    data, lines = parse(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what}, got {type(data).__name__}", source=source, line=1)
    return data, lines
