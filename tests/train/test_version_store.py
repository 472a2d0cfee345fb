"""Policy versions on disk: save, load, delete, checkpoint references, resume, bad files."""
from __future__ import annotations

import os

import pytest
import torch

from megapkl.rollout.fp8 import FP8Transform
from megapkl.train.version_store import VersionStore, VersionStoreError


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(10, 8, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
            ("model.norm.weight", torch.randn(8, generator=g))]


def same(a, b) -> bool:
    a, b = list(a), list(b)
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.contiguous().view(torch.uint8))
        for (_, x), (_, y) in zip(a, b))


def test_save_load_delete(tmp_path):
    store = VersionStore(tmp_path / "v")
    for v in (0, 2, 3):
        store.save(v, iter(weights(v)))
    assert store.versions() == [0, 2, 3] and 2 in store and 1 not in store
    assert same(store.load(2), weights(2))
    assert store.delete_before(3) == [0, 2]
    assert store.versions() == [3] and not store.path(0).exists()


def test_fp8_versions_are_stored_quantized(tmp_path):
    store = VersionStore(tmp_path / "v")
    store.save(5, FP8Transform()(weights(5)))
    loaded = dict(store.load(5))
    assert loaded["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert same(sorted(loaded.items()), sorted(FP8Transform()(weights(5))))


def test_only_the_writer_writes(tmp_path):
    reader = VersionStore(tmp_path / "v", writer=False)
    consumed = []
    assert reader.save(1, ((n, consumed.append(n) or t) for n, t in weights(1))) is None
    assert len(consumed) == 3 and reader.versions() == []
    VersionStore(tmp_path / "v").save(1, weights(1))
    assert reader.delete_before(5) == [] and reader.versions() == [1]


def test_checkpoint_references_survive_deletion_and_resume_anywhere(tmp_path):
    run = VersionStore(tmp_path / "run" / "policy_versions")
    for v in (4, 5):
        run.save(v, weights(v))
    ckpt = tmp_path / "ckpt" / "policy_versions"
    run.link_into(ckpt, run.versions())
    assert os.path.samefile(ckpt / "v00000004.safetensors", run.path(4))  # referenced, not copied
    run.delete_before(6)
    assert run.versions() == [] and VersionStore(ckpt, writer=False).versions() == [4, 5]
    # Resume: fresh stores (any number of engine ranks; the store holds no rank state).
    for writer in (True, False, False):
        resumed = VersionStore(tmp_path / "run" / "policy_versions", writer=writer)
        resumed.restore_from(ckpt, [4, 5])
        assert same(resumed.load(5), weights(5))
    with pytest.raises(VersionStoreError, match="v00000007.safetensors is missing"):
        VersionStore(tmp_path / "run2").restore_from(ckpt, [7])


def test_missing_and_corrupt_files_name_the_file(tmp_path):
    store = VersionStore(tmp_path / "v")
    with pytest.raises(VersionStoreError, match=r"version 3 is needed but its file .*v00000003"
                                                r"\.safetensors is missing"):
        store.load(3)
    store.save(3, weights(3))
    store.path(3).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(VersionStoreError, match=r"v00000003\.safetensors is corrupt"):
        list(store.load(3))
    store.save(3, weights(3))
    data = store.path(3).read_bytes()
    store.path(3).write_bytes(data[: len(data) - 40])  # truncated
    with pytest.raises(VersionStoreError, match=r"v00000003\.safetensors is corrupt"):
        list(store.load(3))
    store.save(4, weights(4))
    os.replace(store.path(4), store.path(3))  # a file holding another version
    with pytest.raises(VersionStoreError, match="holds version '4'"):
        store.load(3)
