"""The declared requirements (pyproject.toml) admit what the pinned sglang and megatron-core
require, read from their installed METADATA (no GPU, no download): a pin of ours must satisfy
their specifier, and a pin of theirs must satisfy ours. Run in the test process: reading
metadata imports neither package.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def ours(extra: str | None = None) -> dict[str, Requirement]:
    reqs = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    out = {}
    for text in reqs:
        r = Requirement(text)
        if canonicalize_name(r.name) != "megapkl":
            out[canonicalize_name(r.name)] = r
    return out


def pins(reqs: dict[str, Requirement]) -> dict[str, str]:
    """name -> version of the requirements that pin one exact version (`==X`)."""
    out = {}
    for name, r in reqs.items():
        exact = [s.version for s in r.specifier if s.operator == "==" and "*" not in s.version]
        if exact:
            out[name] = exact[0]
    return out


def theirs(dist: str, extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    """`dist`'s requirements that apply here (markers evaluated; `extras` included)."""
    try:
        requires = md.requires(dist) or []
    except md.PackageNotFoundError:
        pytest.fail(f"{dist} is not installed: run `bash tools/setup_env.sh test`")
    out = {}
    for text in requires:
        r = Requirement(text)
        env = default_environment()
        if r.marker is not None:
            applies = any(r.marker.evaluate({**env, "extra": e}) for e in ("", *extras))
            if not applies:
                continue
        out[canonicalize_name(r.name)] = r
    return out


def gpu_pin(name: str) -> str:
    got = pins(ours("gpu")).get(name)
    assert got, f"pyproject.toml: the gpu extra must pin {name}==<version>"
    return got


def mismatches(mine: dict[str, Requirement], other: dict[str, Requirement]) -> list[str]:
    problems = []
    for name, version in pins(mine).items():
        if name in other and not other[name].specifier.contains(version, prereleases=True):
            problems.append(f"we pin {name}=={version}; they require {other[name]}")
    for name, version in pins(other).items():
        if name in mine and not mine[name].specifier.contains(version, prereleases=True):
            problems.append(f"they pin {name}=={version}; we require {mine[name]}")
    return problems


def test_installed_sglang_is_the_pinned_one():
    assert md.version("sglang") == gpu_pin("sglang")
    assert md.version("sglang-router") == gpu_pin("sglang-router")
    assert md.version("megatron-core") == pins(ours())["megatron-core"]


def test_gpu_stack_admits_sglangs_requirements():
    """transformers, torch, and every other package both sides name (sglang's exact pins of
    tokenizers, sentencepiece, apache-tvm-ffi, compressed-tensors, xgrammar, openai ...)."""
    mine = {**ours(), **ours("gpu"), **ours("contract")}
    assert not mismatches(mine, theirs("sglang"))
    assert theirs("sglang")["transformers"].specifier.contains(pins(ours())["transformers"])
    assert theirs("sglang")["torch"].specifier.contains(gpu_pin("torch"))


def test_transformers_admits_sglangs_tokenizers():
    """sglang pins tokenizers; transformers (ours, pinned) must accept that version."""
    tok = pins(theirs("sglang"))["tokenizers"]
    assert theirs("transformers")["tokenizers"].specifier.contains(tok)


def test_gpu_stack_admits_megatron_cores_requirements():
    """megatron-core's own requirements, and the transformer-engine range it declares (in its
    `dev` extra, the combination NVIDIA tests) must admit our torch and transformer-engine."""
    mcore = theirs("megatron-core", extras=("dev",))
    assert mcore["torch"].specifier.contains(gpu_pin("torch"))
    assert mcore["transformer-engine"].specifier.contains(gpu_pin("transformer-engine"),
                                                         prereleases=True)
    assert not mismatches({**ours(), **ours("gpu")},
                          {k: v for k, v in mcore.items() if k in ("torch", "numpy", "packaging")})


def test_the_check_fails_on_a_mismatch():
    """The comparison itself: a pin outside the other side's specifier is reported."""
    a = {"torch": Requirement("torch==2.13.0")}
    b = {"torch": Requirement("torch==2.14.1"), "x": Requirement("x>=1")}
    assert mismatches(a, b) and mismatches(b, a)
    assert not mismatches({"torch": Requirement("torch>=2.13")}, b)
    assert re.match(r"we pin torch==2\.13\.0", mismatches(a, b)[0])
    assert SpecifierSet("<2.12.0,>=2.9.0a0").contains("2.11.0")


def test_requires_python_is_the_pinned_packages_floor():
    """pyproject's Python range lies inside sglang's and megatron-core's Requires-Python, and its
    floor is the highest of theirs (3.10 would install and then fail on sglang)."""
    ours_py = SpecifierSet(PROJECT["requires-python"])
    floors = []
    for dist in ("sglang", "megatron-core"):
        theirs_py = SpecifierSet(md.metadata(dist)["Requires-Python"])
        floors += [s.version for s in theirs_py if s.operator == ">="]
        for minor in range(8, 15):
            v = f"3.{minor}"
            if ours_py.contains(v):
                assert theirs_py.contains(v), f"requires-python admits {v}, {dist} does not"
    floor = max(floors, key=lambda v: tuple(int(x) for x in v.split(".")))
    assert ours_py.contains(floor) and not ours_py.contains(f"3.{int(floor.split('.')[1]) - 1}")
