"""docs/install.md's recipe agrees with pyproject.toml and with the pinned packages' own metadata
(sglang's torch pin, megatron-core's Transformer Engine range, the Python versions), keeps the
order that makes Transformer Engine's source-only extension build against the pinned torch, and
megapkl says, on a CUDA machine, why Transformer Engine is missing instead of falling back quietly.
"""
from __future__ import annotations

import importlib.metadata as md
import logging
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from megapkl.models import provider
from megapkl.models.spec import SpecError

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "install.md").read_text()
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def recipe() -> list[str]:
    """The commands of the doc's recipe (its first bash block), comments dropped."""
    block = re.search(r"```bash\n(.*?)```", DOC, re.S)
    assert block, "docs/install.md: the recipe's ```bash block is missing"
    return [ln.strip() for ln in block.group(1).splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def pin(reqs: list[str], name: str) -> str:
    for text in reqs:
        r = Requirement(text)
        if r.name == name:
            exact = [s.version for s in r.specifier if s.operator == "=="]
            assert exact, f"pyproject.toml: {name} must be pinned (==)"
            return exact[0]
    raise AssertionError(f"pyproject.toml does not name {name}")


def doc_pins(text: str) -> dict[str, set[str]]:
    """name -> every version the text pins it at (`name==X`)."""
    out: dict[str, set[str]] = {}
    for name, version in re.findall(r"([A-Za-z][\w.-]*)==([0-9][\w.]*)", text):
        out.setdefault(name.lower(), set()).add(version)
    return out


def line_index(lines: list[str], *needles: str) -> int:
    hits = [i for i, ln in enumerate(lines) if all(n in ln for n in needles)]
    assert hits, f"docs/install.md: no recipe command with {needles}"
    return hits[0]


GPU = PROJECT["optional-dependencies"]["gpu"]
TORCH, TE = pin(GPU, "torch"), pin(GPU, "transformer-engine")


def test_recipe_pins_are_pyprojects():
    """Every version the recipe (and the whole doc) installs is the one pyproject pins."""
    pins = doc_pins(DOC)
    assert pins["torch"] == {TORCH}
    for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"):
        assert pins[name] == {TE}, name
    assert pins["megatron-core"] == {pin(PROJECT["dependencies"], "megatron-core")}
    assert pins["sglang"] == {pin(GPU, "sglang")}


def test_recipe_order_builds_te_against_the_pinned_torch():
    """torch first, TE's extension without build isolation, megapkl's gpu extra last."""
    lines = recipe()
    torch_at = line_index(lines, "pip install", f"torch=={TORCH}")
    ext_at = line_index(lines, "pip install", f"transformer-engine-torch=={TE}")
    extra_at = line_index(lines, "pip install", ".[gpu]")
    assert "--no-build-isolation" in lines[ext_at]
    assert torch_at < ext_at < extra_at
    assert line_index(lines, "import", "transformer_engine.pytorch") > extra_at


def test_pins_admitted_by_the_pinned_packages_metadata():
    """sglang pins our torch; megatron-core's `dev` extra admits our Transformer Engine."""
    sglang = {Requirement(r).name: Requirement(r) for r in md.requires("sglang")}
    assert sglang["torch"].specifier == SpecifierSet(f"=={TORCH}")
    te = [Requirement(r) for r in md.requires("megatron-core")
          if Requirement(r).name == "transformer-engine"]
    assert te and te[0].specifier.contains(TE, prereleases=True)
    table = re.search(r"\| Transformer Engine \|.*admits `([^`]*)`", DOC)
    assert table and SpecifierSet(table.group(1)) == te[0].specifier


def test_python_versions_stated_are_the_metadatas():
    """The doc's Python floor is pyproject's, which is sglang's Requires-Python."""
    ours = SpecifierSet(PROJECT["requires-python"])
    assert ours.contains("3.11") and ours.contains("3.12")  # the two the doc names
    assert f'`requires-python = "{PROJECT["requires-python"]}"`' in DOC
    assert f'`Requires-Python: {md.metadata("sglang")["Requires-Python"]}`' in DOC
    assert f'`Requires-Python: {md.metadata("megatron-core")["Requires-Python"]}`' in DOC


def test_readme_and_slurm_readme_point_to_the_recipe():
    for name in ("README.md", "slurm/README.md"):
        text = (REPO / name).read_text()
        assert "docs/install.md" in text, name
    slurm = (REPO / "slurm" / "README.md").read_text()
    assert f"--no-build-isolation transformer-engine-torch=={TE}" in slurm
    assert slurm.index("--no-build-isolation") < slurm.index("megapkl[gpu]")


def test_te_import_failure_names_its_cause(caplog):
    """Here Transformer Engine is not installed: the cause is the import error's own message;
    on a CUDA machine it is logged once, on one line; without CUDA nothing is logged."""
    error = provider.te_import_error()
    if error is None:
        pytest.skip("Transformer Engine imports on this machine")
    assert "transformer_engine" in error and "\n" not in error
    provider.te_available.cache_clear()
    with caplog.at_level(logging.WARNING, logger=provider.__name__):
        assert provider.te_available(False) is False
        assert not caplog.records
        assert provider.te_available(True) is False
        assert provider.te_available(True) is False  # once per process
    provider.te_available.cache_clear()
    (record,) = caplog.records
    assert error in record.getMessage() and "\n" not in record.getMessage()


def test_a_config_that_needs_te_names_the_key_and_the_cause():
    error = "ImportError: libcudnn.so.9: cannot open shared object file"
    with pytest.raises(SpecError, match=r"parallel\.context \(2\).*libcudnn\.so\.9"):
        provider.kernel_plan(cuda=True, te=False, cp=2, te_error=error)
    with pytest.raises(SpecError, match=r"use_te.*libcudnn\.so\.9"):
        provider.kernel_plan(cuda=True, te=False, use_te=True, te_error=error)
    assert provider.kernel_plan(cuda=False, te=False, cp=2).layer_spec == "local"  # CPU: no TE


# ---- the CPU install and the tested bounds (docs/install.md, "On a CPU machine")

CPU_DOC = DOC[DOC.index("## On a CPU machine"):DOC.index("## On a GPU node")]
SETUP = (REPO / "tools" / "setup_env.sh").read_text()


def test_the_cpu_install_says_which_torch_build_setup_installs():
    """tools/setup_env.sh's torch and torchvision, as the doc names them; where this environment
    holds that torch on x86_64 Linux (setup_env.sh made it), its build is the CUDA one the doc
    says, NVIDIA libraries included."""
    import platform

    import torch

    torch_v = re.search(r'MEGAPKL_TORCH_VERSION:-([0-9.]+)', SETUP).group(1)
    vision_v = re.search(r'MEGAPKL_TORCHVISION_VERSION:-([0-9.]+)', SETUP).group(1)
    assert f"installs megapkl with torch {torch_v}" in CPU_DOC and f"torchvision {vision_v}" in CPU_DOC
    assert torch_v == TORCH  # the GPU stack's pin
    build = re.search(rf"`{re.escape(torch_v)}\+(cu\d+)`", CPU_DOC).group(1)
    if torch.__version__.split("+")[0] == torch_v and platform.machine() == "x86_64":
        assert torch.__version__ == f"{torch_v}+{build}" and torch.version.cuda is not None
        assert any(d.metadata["Name"].startswith("nvidia-") for d in md.distributions())


def test_the_demo_script_installs_the_test_extras_and_sglang():
    demo = (REPO / "tools" / "demo.sh").read_text()
    assert "bash tools/setup_env.sh test" in demo
    assert '-e ".[$extra]"' in SETUP and 'if [ "$extra" = "test" ]; then' in SETUP
    assert '--no-deps "$(ls "$CACHE"/sglang-' in SETUP
    assert "`bash tools/demo.sh` runs\n`tools/setup_env.sh test`" in CPU_DOC
    test_extra = PROJECT["optional-dependencies"]["test"]
    for name in ("pytest", "pytest-xdist", "scipy", "wandb", "sglang-router"):
        assert any(Requirement(r).name == name for r in test_extra), name
        assert name in CPU_DOC, name


def test_every_dependency_declares_the_lower_bound_ci_runs():
    """Each dependency's lowest admitted version is what tools/test_bounds.sh installs, .ci/run
    runs it, and the versions the doc names are those bounds."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    try:
        from lower_bounds import lower_bounds
    finally:
        sys.path.remove(str(REPO / "tools"))
    bounds = lower_bounds()
    for text in PROJECT["dependencies"]:
        r = Requirement(text)
        assert r.specifier.contains(bounds[r.name.lower()]), text
        assert not r.specifier.contains(_below(bounds[r.name.lower()])), text
    assert "bash tools/test_bounds.sh" in (REPO / ".ci" / "run").read_text()
    assert "tools/lower_bounds.py" in (REPO / "tools" / "test_bounds.sh").read_text()
    for name in ("torch", "numpy", "math-verify", "submitit"):
        assert f"{name} {bounds[name]}" in CPU_DOC, name
    torch_spec = next(Requirement(t).specifier for t in PROJECT["dependencies"]
                      if Requirement(t).name == "torch")
    assert torch_spec.contains(TORCH) and not torch_spec.contains("2.15.0")  # tested: 2.14.1


def _below(version: str) -> str:
    """A version just under `version` (its last number minus one, or an earlier minor)."""
    parts = [int(p) for p in version.split(".")]
    i = max(i for i, p in enumerate(parts) if p > 0)
    return ".".join(map(str, parts[:i] + [parts[i] - 1])) + (".999" if i < len(parts) - 1 else "")
