"""Policy versions on disk: save, load, delete, checkpoint references, resume, bad files."""
from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from megapkl.rollout.fp8 import FP8Transform
from megapkl.rollout.version_store import VersionStore, VersionStoreError


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


# ------------------------------------------------------------------------- the rollout stage

def stage_for(run_dir, *overrides):
    """The rollout stage of one process, with the policy versions and the engine slot the trainer
    would hand it (`.versions`, `.slot` here)."""
    from megapkl.config import load_config
    from megapkl.config.layout import Layout
    from megapkl.models.spec import spec_from_model_config
    from megapkl.rollout.factory import build_run_engine, build_tokenizer_and_data
    from megapkl.rollout.rewards import build_reward
    from megapkl.train.engine_slot import EngineSlot
    from megapkl.train.policy_versions import PolicyVersions
    from megapkl.train.rollouts import Replica, RolloutStage

    cfg = load_config("configs/demo/cpu_demo.yaml", [
        "parallel.data=1", f"run_dir={run_dir}", "rollout.protocol=uniform_stale",
        "rollout.max_staleness=3", "rollout.snapshot_pool=4", "rollout.refresh_every=null",
        "rollout.prompts_per_batch=8", "rollout.responses_per_prompt=2",
        "advantage.filter_constant_groups=false", *overrides])
    r = cfg.rollout
    tokenizer, dataset, task = build_tokenizer_and_data(cfg.model, cfg.data, r.max_prompt_len)
    versions = PolicyVersions.of(r, Path(cfg.run_dir), reader=True)
    engine = build_run_engine(r, cfg.model, spec_from_model_config(cfg.model), tokenizer,
                              work_dir=Path(cfg.run_dir), seed=cfg.seed,
                              layout=Layout.of(cfg.parallel, world=1))
    slot = EngineSlot(engine, versions)
    stage = RolloutStage(r, cfg.advantage, cfg.data, dataset=dataset,
                         reward=build_reward(cfg.reward, cfg.data, tokenizer, task),
                         versions=versions, slot=slot, replica=Replica(), seed=cfg.seed)
    return types.SimpleNamespace(stage=stage, versions=versions, slot=slot)


def engine_weights(run, version: int):
    g = torch.Generator().manual_seed(version)
    return ((n, torch.randn(p.shape, generator=g) * 0.5)
            for n, p in run.slot.engine.model.state_dict().items())


def test_stage_generates_by_version_from_disk_and_resumes(tmp_path, fp8=True):
    """FP8 rollouts (the plain path is covered by the trainer tests)."""
    from megapkl.rollout.engine import RolloutError
    from megapkl.train.agree import RanksFailed

    run = stage_for(tmp_path / "run", f"rollout.fp8={str(fp8).lower()}")
    stage = run.stage
    for v in range(5):
        run.versions.remember(v, lambda: engine_weights(run, v))
        run.versions.forget_before(v - 3)
    assert run.versions.store.versions() == [1, 2, 3, 4]
    if fp8:  # stored already quantized
        from safetensors import safe_open
        with safe_open(str(run.versions.store.path(4)), framework="pt") as h:
            assert h.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
    versions = [4, 1, 3, 2, 4, 1, 3, 2]
    samples = stage.collect(0, versions)
    assert [s.version for s in samples] == [v for v in versions for _ in range(2)]
    assert stage.load_metrics()["rollout/versions_loaded"] == 4.0  # each version once
    assert stage.timers.totals["sync"] > 0
    # Checkpoint (references), the run directory loses the files, resume restores them.
    ckpt = tmp_path / "ckpt"
    run.versions.save_files(ckpt)
    state = stage.state_dict()
    assert "pool" not in state and sorted(p.name for p in (ckpt / "policy_versions").iterdir()) == \
        [f"v{v:08d}.safetensors" for v in (1, 2, 3, 4)]
    run.versions.store.delete_before(100)
    again = stage_for(tmp_path / "run", f"rollout.fp8={str(fp8).lower()}")
    again.versions.load_files(ckpt)
    again.stage.load_state_dict(state)
    a, b = stage.collect(1, versions), again.stage.collect(1, versions)
    assert all(torch.equal(x.logp_behav, y.logp_behav) and torch.equal(x.response_ids, y.response_ids)
               for x, y in zip(a, b))
    # A needed version missing on disk is an error naming the file, not a silent skip.
    gone = 3 if again.slot.engine.version != 3 else 2
    again.versions.store.path(gone).unlink()
    with pytest.raises(RanksFailed, match=rf"the rollout failed on rank 0: VersionStoreError: "
                                          rf"policy version {gone} is needed but its file "
                                          rf".*v0000000{gone}\.safetensors is missing"):
        again.stage.collect(2, [gone] * 8)
    with pytest.raises(RolloutError, match=r"rollout.snapshot_pool \(4\)"):
        for v in range(5, 7):
            run.versions.remember(v, lambda: engine_weights(run, v))
        run.versions.forget_before(0)
