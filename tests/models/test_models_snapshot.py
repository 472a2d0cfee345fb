"""Snapshot store: frozen CPU copies of the policy swapped in for a forward pass."""

import pytest
import torch

from tiny_models import forward_logits, train_setup, train_step


def _snapshot_worker(rank, world_size, ckpt):
    from megapkl.models.snapshot import SnapshotStore

    groups, model, ddp, opt, sched = train_setup(ckpt, dict(tp=2), seed=1)
    store = SnapshotStore(ddp)
    with torch.no_grad():
        before = forward_logits(model, groups, ckpt.ids)
    store.save("v0", meta={"version": 0})
    train_step(ddp, opt, sched, seed=10)
    out = {}
    with torch.no_grad():
        out["after"] = forward_logits(model, groups, ckpt.ids)
        with store.swapped_in("v0"):
            out["swapped"] = forward_logits(model, groups, ckpt.ids)
        out["restored"] = forward_logits(model, groups, ckpt.ids)
        try:
            with store.swapped_in("v0"):
                raise ValueError("boom")
        except ValueError:
            pass
        out["restored_after_error"] = forward_logits(model, groups, ckpt.ids)
    # The optimizer continues from the live weights, unaffected by the swaps.
    store.save("v1")
    out["step"] = train_step(ddp, opt, sched, seed=11).grad_norm
    half = SnapshotStore(model, dtype=torch.bfloat16)
    half.save("bf16")
    out["bytes"] = (store.nbytes("v0"), half.nbytes("bf16"))
    out["keys"], out["meta"] = store.keys(), store.meta("v0")
    store.drop("v1")
    out["keys_after_drop"] = store.keys()
    out["device"] = {t.device.type for t in store._snapshots["v0"].values()}
    with pytest.raises(KeyError, match="no snapshot 'nope'"):
        store.swapped_in("nope").__enter__()
    return before, out


def _reference_step(rank, world_size, ckpt):
    groups, model, ddp, opt, sched = train_setup(ckpt, dict(tp=2), seed=1)
    train_step(ddp, opt, sched, seed=10)
    return train_step(ddp, opt, sched, seed=11).grad_norm


def test_snapshot_swap(dist_run, dense_ckpt):
    results = dist_run(_snapshot_worker, 2, dense_ckpt)
    ref_norm = dist_run(_reference_step, 2, dense_ckpt)[0]
    for before, out in results:
        assert torch.equal(out["swapped"], before)
        assert not torch.equal(out["after"], before)
        assert torch.equal(out["restored"], out["after"])
        assert torch.equal(out["restored_after_error"], out["after"])
        assert out["step"] == pytest.approx(ref_norm, rel=1e-6)
        full, half = out["bytes"]
        assert half * 2 == full
        assert out["keys"] == ["v0", "v1"] and out["keys_after_drop"] == ["v0"]
        assert out["meta"] == {"version": 0} and out["device"] == {"cpu"}
