"""The config reference (docs/config.md), written from the typed config itself.

Every section of `RunConfig` and every key in it, with its type, code default, range and the
comment written beside the field in the source (`# ...` on its line or the lines just above),
so the reference cannot drift from the code: `megapkl config reference --out docs/config.md`
rewrites it, and a test fails when the file differs from what this module writes.

    from megapkl.config.reference import render
    text = render()
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any, Iterator, Optional

from megapkl.config import yamlio
from megapkl.config.run import RunConfig
from megapkl.config.sections_train import BenchmarkConfig
from megapkl.config.typed import type_name

HEADER = """\
# Config reference

<!-- Written by `megapkl config reference --out docs/config.md` from megapkl/config/; do not edit
by hand (tests/test_config_reference.py fails when this file differs from what it writes). -->

A run config is one YAML file of the sections below (`extends:` earlier files, `KEY=VALUE`
overrides on every command; README "Configs"). Unknown keys, wrong types, values out of range and
conflicting fields are errors naming the file, line and dotted key; `megapkl config validate FILE`
checks a file, `megapkl config show FILE` prints it resolved. **default** is the code's default:
the shipped presets change many (`configs/base/default.yaml` sets the Proximal KL paper's values,
the protocol and objective presets theirs), and a run's resolved `config.yaml` shows every value it
used. "unset" (null) defaults are filled when the config is resolved, as the key's text says.

`config validate`, `plan`, `submit`, `sweep` and `train` also check the files the job will read,
relative paths taken from the directory it starts in (megapkl never downloads them):
`model.hf_checkpoint` must hold `config.json` and safetensors weights (`*.safetensors` or
`model.safetensors.index.json`); `model.tokenizer`, or the checkpoint when it tokenizes
`data.train_path`, must hold `tokenizer.json` or `tokenizer_config.json`; `data.train_path` and,
when evaluation runs (`eval.every` or `eval.at_start`), each benchmark's file (its `path`, else
`<eval.data_dir>/<name>.jsonl`; a synthetic task needs none) must exist, every JSON line an object
with the prompt and answer fields the prompt reader requires (a bad one is refused as
`FILE:LINE: why`; Parquet files are only looked for). `plan` sizes the job from the model preset:
it needs no weights and checks only the prompt files already there. On a profile with a
`container:`, `submit` also refuses any of these paths, the run and checkpoint directories or the
submit directory itself when it lies outside the container's mounts (only the listed mounts count:
megapkl mounts nothing by itself, and a runtime's own default binds, such as Apptainer's $HOME,
may be off on a cluster). Each refusal is one line naming the file and line that set the key.
"""


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its source comment}: the `# ...` on the field's own lines, after the comment
    lines directly above it."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    code_lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:  # the class body
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and code_lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        out[node.target.id] = " ".join(above + own)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _yaml(value: Any) -> str:
    """A default as it would be written in YAML, on one line."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, list):
        value = [_plain(v) for v in value]
    text = yamlio.dump({"x": _plain(value)}).strip()
    text = text[len("x:"):].strip()
    return " ".join(text.split()) if "\n" not in text else _flow(value)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, tuple):
        return list(value)
    return value


def _flow(value: Any) -> str:
    """YAML flow style for nested lists/mappings (one table cell)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(_plain(v)) for v in value) + "]"
    return yamlio.dump({"x": value}).strip()[len("x:"):].strip()


def _range(meta: typing.Mapping[str, Any]) -> str:
    lo, hi = meta.get("lo"), meta.get("hi")
    parts = []
    if lo is not None:
        parts.append(f"{'>' if meta.get('lo_open') else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if meta.get('hi_open') else '<='} {hi:g}")
    return ", ".join(parts)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def sections(cls: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted prefix, dataclass) of every section, parents first ('' is the top level)."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            yield from sections(hints[f.name], f"{prefix}{f.name}.")
    if cls is RunConfig:
        yield "eval.benchmarks[].", BenchmarkConfig


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, range, comment) of a section's own keys (subsections excluded)."""
    hints, notes = typing.get_type_hints(cls), field_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            continue
        out.append((f"{prefix}{f.name}", type_name(hints[f.name]), _yaml(_default(f)),
                    _range(f.metadata), notes.get(f.name, "")))
    return out


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc  # dataclass' generated signature


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(title: Optional[str] = None) -> str:
    """The whole reference as Markdown."""
    parts = [HEADER if title is None else title]
    for prefix, cls in sections():
        name = prefix.rstrip(".") or "top level"
        parts.append(f"## `{name}`\n" if prefix else "## Top level\n")
        doc = _doc(cls)
        if doc:
            parts.append(doc + "\n")
        parts.append("| key | type | default | range | meaning |\n|---|---|---|---|---|")
        for key, tp, default, rng_, note in rows(cls, prefix):
            parts.append(f"| `{key}` | `{_cell(tp)}` | `{_cell(default)}` | {_cell(rng_)} | "
                         f"{_cell(note)} |")
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


__all__ = ["field_comments", "render", "rows", "sections"]
