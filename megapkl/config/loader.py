"""Load a run config from YAML: `extends:` layering, dotted overrides, provenance-aware errors.

    cfg = load_config("configs/experiments/pkl_1p7b.yaml", ["objective.beta=0.3", "train.lr=1e-6"])
    text = dump_config(cfg)            # the fully resolved config a run records

Layering. A file may say `extends: base.yaml` or `extends: [a.yaml, b.yaml]` (paths relative to
the file). Files are applied parents first, depth first, and *each file once*, at its first
position: an experiment `extends: [../base/controlled_staleness.yaml, ../objectives/grpo.yaml]`
applies default.yaml, controlled_staleness.yaml, grpo.yaml's own keys, then the experiment, even
though both parents extend default.yaml. Mappings merge key by key, later wins; lists and scalars
are replaced whole; `null` is a value (e.g. `cost_clip: null`), except that an empty section header
(`objective:` with nothing under it) changes nothing. A cycle is an error naming the files.

Overrides `a.b.c=VALUE` are applied after all files, VALUE parsed as YAML (`[0,5]`, `null`, `full`,
`1e-6`). Every error names the dotted key and the file (and line) that set it, or `<override>`.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from megapkl.config import yamlio
from megapkl.config.run import RunConfig, check_local_files
from megapkl.config.typed import ConfigError

OVERRIDE_SOURCE = "<override>"
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
Origin = tuple[str, Optional[int]]  # (file or '<override>', 1-based line or None)


@dataclass
class _Layer:
    """One file's own keys (its `extends:` removed) with the line of every key."""

    source: str
    body: dict[str, Any]
    lines: dict[str, int]

    def origin(self, path: str) -> Origin:
        return self.source, self.lines.get(path)


# ---- public API

def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), *,
                workdir: str | os.PathLike | None = None, tokenizes: bool = True) -> RunConfig:
    """Read, layer, override, validate and resolve the run config at `path`. With `workdir` (the
    directory the run starts in), the files it reads from that machine must exist as well
    (`config validate`, `plan`, `submit` and `train` ask; `config show` does not; see
    `megapkl.config.local_files`); `tokenizes` false (`plan`, which reads nothing yet): no
    tokenizer, weights or prompt files are needed, the prompt files already there must parse."""
    top = _display(Path(path))
    merged, prov = merged_mapping(path, overrides)
    return _build(merged, prov, top, workdir, tokenizes)


def loads_config(text: str, overrides: Iterable[str] = (), *, source: str = "<string>",
                 base_dir: str | os.PathLike = ".") -> RunConfig:
    """Like `load_config` for YAML text; `extends:` paths are relative to `base_dir`."""
    layers = _linearize_text(text, source, Path(base_dir), [], set())
    merged, prov = _merge_all(layers, overrides)
    return _build(merged, prov, source)


def config_from_dict(mapping: Mapping[str, Any], overrides: Iterable[str] = (), *,
                     source: str = "<dict>") -> RunConfig:
    """Validate a plain mapping (no `extends:`) plus overrides into a resolved RunConfig."""
    layer = _Layer(source, copy.deepcopy(dict(mapping)), {})
    merged, prov = _merge_all([layer], overrides)
    return _build(merged, prov, source)


def merged_mapping(path: str | os.PathLike, overrides: Iterable[str] = ()
                   ) -> tuple[dict[str, Any], dict[str, Origin]]:
    """The raw merged mapping before validation, and where each dotted key came from."""
    layers = _linearize_file(Path(path), [], set(), referrer=None)
    return _merge_all(layers, overrides)


def locate(exc: ConfigError, path: str | os.PathLike, overrides: Iterable[str] = ()
           ) -> ConfigError:
    """`exc` (a rule checked after loading, e.g. by the launcher) attributed to the file and line
    of `path` + `overrides` that set its key, as the loader's own errors are."""
    return _attribute(exc, merged_mapping(path, overrides)[1], _display(Path(path)))


def dump_config(cfg: RunConfig) -> str:
    """YAML of the fully resolved config; `load_config` of this text gives an equal RunConfig."""
    header = ("# megapkl resolved run config: every default filled in.\n"
              "# Reload it with `megapkl config show FILE` or megapkl.config.load_config(FILE).\n")
    return header + yamlio.dump(cfg.resolve().to_dict())


def parse_override(text: str) -> tuple[str, Any]:
    """`objective.beta=0.3` -> ('objective.beta', 0.3); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"expected KEY=VALUE (e.g. objective.beta=0.3), got '{text}'",
                          source=OVERRIDE_SOURCE)
    key, _, raw = text.partition("=")
    key = key.strip()
    if not _KEY.match(key):
        raise ConfigError(f"'{key}' is not a dotted key (e.g. objective.beta) in '{text}'",
                          source=OVERRIDE_SOURCE)
    if key == "extends":
        raise ConfigError("extends can only be set in a file", key=key, source=OVERRIDE_SOURCE)
    try:
        value = yamlio.load_value(raw)
    except Exception as exc:  # noqa: BLE001 - any YAML problem in the value
        raise ConfigError(f"cannot parse the value '{raw}' as YAML: {' '.join(str(exc).split())}",
                          key=key, source=OVERRIDE_SOURCE) from None
    return key, value


# ---- extends: read files parents-first, each once

def _display(path: Path) -> str:
    """How a file is named in messages: relative to the working directory when below it."""
    try:
        rel = os.path.relpath(path.resolve())
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if rel.startswith("..") else rel


def _read(path: Path, display: str, referrer: Optional[tuple[str, Optional[int], str]]) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        why = "no such file" if isinstance(exc, FileNotFoundError) else exc.strerror or str(exc)
        if referrer is None:
            raise ConfigError(f"cannot read config: {why}", source=display) from None
        source, line, key = referrer
        raise ConfigError(f"cannot read extended file '{display}': {why}", key=key, source=source,
                          line=line) from None


def _linearize_file(path: Path, stack: list[tuple[Path, str]], done: set[Path],
                    referrer: Optional[tuple[str, Optional[int], str]]) -> list[_Layer]:
    display = _display(path)
    text = _read(path, display, referrer)
    stack.append((path.resolve(), display))
    layers = _linearize_text(text, display, path.parent, stack, done)
    stack.pop()
    done.add(path.resolve())
    return layers


def _linearize_text(text: str, source: str, base_dir: Path, stack: list[tuple[Path, str]],
                    done: set[Path]) -> list[_Layer]:
    data, lines = yamlio.parse_mapping(text, source, "the top level must be a mapping of sections")
    layers: list[_Layer] = []
    for parent, key in _extends_list(data.pop("extends", None), source, lines):
        ppath = Path(parent) if os.path.isabs(parent) else base_dir / parent
        resolved = ppath.resolve()
        chain = [d for p, d in stack] + [_display(ppath)]
        if any(p == resolved for p, _ in stack):
            raise ConfigError(f"extends cycle: {' -> '.join(chain)}", key=key, source=source,
                              line=lines.get(key))
        if resolved not in done:
            layers += _linearize_file(ppath, stack, done, (source, lines.get(key), key))
    own = {k: v for k, v in lines.items() if not k.startswith("extends")}
    return layers + [_Layer(source, data, own)]


def _extends_list(value: Any, source: str, lines: dict[str, int]) -> list[tuple[str, str]]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(f"expected a file path or a list of file paths, got {value!r}",
                          key="extends", source=source, line=lines.get("extends"))
    if isinstance(value, str):
        return [(value, "extends")]
    return [(v, f"extends[{i}]") for i, v in enumerate(items)]


# ---- merging with provenance

def _merge_all(layers: list[_Layer], overrides: Iterable[str]
               ) -> tuple[dict[str, Any], dict[str, Origin]]:
    merged: dict[str, Any] = {}
    prov: dict[str, Origin] = {}
    for layer in layers:
        _merge(merged, layer.body, prov, layer.origin)
    for text in [overrides] if isinstance(overrides, str) else list(overrides or ()):
        key, value = parse_override(text)
        _merge(merged, _nest(key, value), prov, lambda p: (OVERRIDE_SOURCE, None))
    return merged, prov


def _nest(key: str, value: Any) -> dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _merge(dst: dict, src: dict, prov: dict[str, Origin], origin: Callable[[str], Origin],
           prefix: str = "") -> None:
    for k, v in src.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        old = dst.get(k)
        if isinstance(old, dict) and isinstance(v, dict):
            prov.setdefault(path, origin(path))
            _merge(old, v, prov, origin, path)
        elif isinstance(old, dict) and v is None:
            continue  # an empty section header: nothing to change
        else:
            for p in [p for p in prov if p == path or p.startswith((path + ".", path + "["))]:
                del prov[p]
            dst[k] = copy.deepcopy(v)
            _record(v, path, prov, origin)


def _record(value: Any, path: str, prov: dict[str, Origin], origin: Callable[[str], Origin]) -> None:
    prov[path] = origin(path)
    if isinstance(value, dict):
        for k, v in value.items():
            _record(v, f"{path}.{k}", prov, origin)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _record(v, f"{path}[{i}]", prov, origin)


# ---- validation with errors attributed to the file that set the key

def _build(merged: dict[str, Any], prov: dict[str, Origin], top: str,
           workdir: str | os.PathLike | None = None, tokenizes: bool = True) -> RunConfig:
    try:
        cfg = RunConfig.from_dict(merged, source=top)
        if workdir is not None:
            def err(msg: str, key: str, *related: str):
                raise ConfigError(msg, key=key, source=top, related=related)
            check_local_files(cfg, workdir, err, tokenizes=tokenizes)
        return cfg
    except ConfigError as exc:
        raise _attribute(exc, prov, top) from None


def _lookup(prov: dict[str, Origin], key: str) -> Optional[Origin]:
    """Origin of `key`, or of the list holding it (`eval.benchmarks[2].name` -> the list)."""
    while key:
        if key in prov:
            return prov[key]
        if not key.endswith("]") and "[" not in key:
            return None
        key = key[:key.rfind("[")] if key.endswith("]") else key[:key.rfind(".")]
    return None


def _attribute(exc: ConfigError, prov: dict[str, Origin], top: str) -> ConfigError:
    keys = [exc.key, *exc.related] if exc.key else list(exc.related)
    found = [(k, o) for k in keys if (o := _lookup(prov, k)) is not None]
    source, line = found[0][1] if found else (top, None)
    notes = [f"{k} is set in {_where(o)}" for k, o in found if o != (source, line)]
    detail = exc.detail + (f" ({'; '.join(notes)})" if notes else "")
    return ConfigError(detail, key=exc.key, source=source, line=line, related=exc.related)


def _where(origin: Origin) -> str:
    source, line = origin
    return f"{source}:{line}" if line else source
