"""A config field that nothing reads is a defect: every field of the run config's dataclasses must be
read somewhere in the package outside `megapkl/config/` (where fields are only defined, validated
and resolved).

"Read" is checked textually: the field's attribute name appears as an attribute access (`.name`) or
as a quoted string (getattr / dict lookups) in a module outside megapkl/config. It is a necessary
condition, not proof of use, but it catches a field that was added and never wired up.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from megapkl.config.run import RunConfig

PACKAGE = Path(__file__).resolve().parents[1] / "megapkl"

# Fields being wired up on other branches (each entry says by whom); remove an entry when it lands.
PENDING = {
    # Not a pending wiring: free text for people, kept in the run's resolved config.yaml.
    "description": "documentation only",
}


def _fields(cls, prefix: str = ""):
    """Dotted names of every leaf field, recursing into nested config dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if nested and typing.get_origin(tp) is not list:
            yield from _fields(nested[0], name + ".")
        else:
            yield name


def _source_outside_config() -> str:
    return "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if "config" not in p.relative_to(PACKAGE).parts[:1])


def _pending(name: str) -> bool:
    return any(name == k or name.startswith(k + ".") for k in PENDING)


def test_every_config_field_is_read_outside_the_config_package() -> None:
    src = _source_outside_config()
    unread = []
    for name in _fields(RunConfig):
        attr = name.rsplit(".", 1)[-1]
        pattern = rf"\.{attr}\b|[\"']{attr}[\"']"
        if not re.search(pattern, src) and not _pending(name):
            unread.append(name)
    assert not unread, f"config fields nothing reads (wire them up or delete them): {unread}"


def test_the_check_finds_an_unread_field() -> None:
    """The textual check is not vacuous: a made-up field name is reported."""
    assert not re.search(r"\.surely_unused_field_xyz\b", _source_outside_config())
    assert "objective.tv_delta" in set(_fields(RunConfig))
    assert "checkpoint.every" in set(_fields(RunConfig))


def test_plot_smooths_with_the_runs_ema_alpha(tmp_path) -> None:
    """`logging.ema_alpha` is read back by `megapkl plot` from the run's resolved config."""
    from megapkl.config import load_config
    from megapkl.config.typed import to_dict
    from megapkl.analysis.plot import run_ema_alpha
    import yaml

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/base/controlled_staleness.yaml")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    assert run_ema_alpha(tmp_path) == cfg.logging.ema_alpha == 0.20
    assert run_ema_alpha(tmp_path / "missing") == 0.1
