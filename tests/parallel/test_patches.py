"""The patch registry: every patch of torch or megatron-core holds on the installed versions, a
moved upstream fails in one line naming the patch (and the CPU layer then applies nothing), the
speed-only patches can be left out, and private torch.distributed access lives in one module."""
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from megapkl.parallel import patches
from megapkl.parallel.forked import run_forked
from megapkl.parallel.patches import PATCHES, Patch, PatchError

REPO = Path(__file__).resolve().parents[2]


def test_every_patch_holds_on_the_installed_versions(megatron_loaded):
    """Every patch registered for the installed versions (tools/test_bounds.sh runs the CPU demo
    on the lowest torch, where its own registrations apply)."""
    here = [p for p in PATCHES
            if all(patches._in_range(patches.version_of(k), v) for k, v in p.versions.items())]
    assert {p.name for p in PATCHES} - {p.name for p in here} == \
        {"no-compile-at-import-2.13", "dist-pg-timeout-2.13"}  # torch 2.13's own
    for patch in here:
        assert patches.moved(patch) == [], patch.name
        assert patches.check(patch.name) is patch


@pytest.mark.parametrize("change, said", [
    (dict(replaces=("json.dumps",), params={"json.dumps": ("obj", "indent")}), "json.dumps takes (obj, "),
    (dict(uses=("json.dumps",), params={"json.dumps": ("indent", "obj")}), "not (indent, obj)"),
    (dict(replaces=("json.no_such_function",)), "json.no_such_function is gone"),
    (dict(versions={"torch": "<2.0"}), "was not tested with torch 2."),
])
def test_a_moved_upstream_fails_in_one_line_naming_the_patch(monkeypatch, change, said):
    fake = Patch("fake-patch", "megapkl/somewhere.py", {"torch": ">=2"}, "why", "retires")
    monkeypatch.setitem(patches.BY_NAME, "fake-patch", dataclasses.replace(fake, **change))
    with pytest.raises(PatchError) as err:
        patches.check("fake-patch")
    message = str(err.value)
    assert "\n" not in message and "patch 'fake-patch'" in message and said in message, message
    assert "fake-patch" not in patches._VERIFIED


def test_an_untested_version_passes_on_request_when_nothing_moved(monkeypatch, capsys):
    fake = Patch("fake-version", "megapkl/somewhere.py", {"torch": "<2.0"}, "why", "retires",
                 uses=("json.dumps",), params={"json.dumps": ("obj",)})
    monkeypatch.setitem(patches.BY_NAME, "fake-version", fake)
    monkeypatch.setenv("MEGAPKL_ALLOW_UNTESTED", "1")
    monkeypatch.delitem(patches._VERIFIED, "fake-version", raising=False)
    assert patches.check("fake-version") is fake
    assert "runs untested with torch" in capsys.readouterr().err
    patches._VERIFIED.pop("fake-version")


def test_apply_writes_only_registered_targets():
    patches.check("cpu-device")
    with pytest.raises(PatchError, match="does not register torch.cuda.is_available"):
        patches.apply("cpu-device", torch.cuda, "is_available", lambda: True)
    assert torch.cuda.is_available.__module__ == "torch.cuda"


def _install_after_megatron_moved(rank, world_size):
    """megatron-core 0.19's signature of the RoPE function patch 'rope-tables' replaces."""
    from megatron.core.models.common.embeddings import rope_utils

    from megapkl.parallel import compat

    def moved(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
              multi_latent_attention=None):
        return t

    import os

    os.environ["MEGAPKL_SPEED_PATCHES"] = "1"  # rope-tables is one of them
    zeros = torch.zeros
    patches._VERIFIED.clear()  # checked in the pytest process this rank was forked from
    rope_utils._apply_rotary_pos_emb_bshd = moved
    try:
        compat.install()
    except PatchError as exc:
        return str(exc), compat.is_installed(), torch.zeros is zeros
    return None, compat.is_installed(), torch.zeros is zeros


def test_install_refuses_a_moved_megatron_and_applies_nothing(megatron_loaded):
    ((message, installed, untouched),) = run_forked(_install_after_megatron_moved, 1,
                                                   install_compat=False, init_distributed=False)
    assert message is not None and "patch 'rope-tables'" in message and "\n" not in message
    assert "mla_rotary_interleaved" in message
    assert not installed and untouched


def _install_without_speed_patches(rank, world_size):
    import os

    from megatron.core.models.common.embeddings import rope_utils

    from megapkl.parallel import compat

    os.environ["MEGAPKL_SPEED_PATCHES"] = "0"
    patches._VERIFIED.clear()
    reduce = torch.distributed.all_reduce
    compat.install()
    return (compat.installed_patches(), hasattr(rope_utils._apply_rotary_pos_emb_bshd, "__wrapped__"),
            torch.distributed.all_reduce is reduce, torch.ones(2, device="cuda").device.type)


def test_the_speed_patches_can_be_left_out(megatron_loaded):
    ((applied, rope_wrapped, reduce_kept, device),) = run_forked(
        _install_without_speed_patches, 1, install_compat=False, init_distributed=False)
    speed = {p.name for p in PATCHES if p.speed_only}
    correctness = [p.name for p in PATCHES if p.cpu_only and not p.speed_only]
    assert applied == correctness and not speed & set(applied)
    assert not rope_wrapped and reduce_kept and device == "cpu"


def test_the_cpu_layer_applies_every_cpu_patch():
    from megapkl.parallel import compat

    preloaded = {"no-compile-at-import", "no-compile-at-import-2.13"}  # one of them, by torch
    applied = {name for name, _, _ in compat._PATCHES} | preloaded
    assert applied == {p.name for p in PATCHES if p.cpu_only}
    assert all(p.site.endswith("compat.py") for p in PATCHES if p.cpu_only)


PRIVATE = re.compile(r"distributed_c10d|\._world\b|bound_device_id|pg_group_ranks|pg_map")


def _private_dist_uses(path: Path) -> list[str]:
    """Lines of `path` that reach torch.distributed's private API: a `_name` attribute of
    torch.distributed (as `dist`, `c10d` or in full), or the names only its internals have."""
    text = path.read_text()
    found = [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
             if PRIVATE.search(line) and not line.lstrip().startswith("#")]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base.split(".")[0] in ("dist", "c10d") or base.startswith("torch.distributed"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_torch_distributed_access_lives_in_one_module():
    allowed = {"megapkl/parallel/dist_internals.py", "megapkl/parallel/patches.py"}
    bad = [f"{p.relative_to(REPO)}:{use}" for p in sorted((REPO / "megapkl").rglob("*.py"))
           if p.relative_to(REPO).as_posix() not in allowed for use in _private_dist_uses(p)]
    assert not bad, "private torch.distributed use outside dist_internals.py:\n" + "\n".join(bad)
    assert _private_dist_uses(REPO / "megapkl" / "parallel" / "dist_internals.py")  # it sees them


def test_docs_table_lists_every_patch_with_its_range():
    rows = {}
    for line in (REPO / "docs" / "patches.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 4:
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == {p.name for p in PATCHES}, set(rows) ^ {p.name for p in PATCHES}
    for p in PATCHES:
        for pkg, rng in p.versions.items():
            assert f"{pkg} {rng}" in rows[p.name], (p.name, rows[p.name])
