"""Distributed checkpoints reshard: save at one layout, load at another, continue identically.

Each case: train one step, save (model + distributed Adam + scheduler + RNG), remember the logits
and what a second step gives; a fresh model at another layout (different random init) loads the
checkpoint and must reproduce the logits and the second step (so the Adam moments, the step
count and the LR schedule were restored, not just the weights).
"""

import pytest
import torch

from tiny_models import build_loaded, forward_logits, train_setup, train_step


def _weights(model, groups):
    from megapkl.models.hf import export_hf_weights

    return dict(export_hf_weights(model, groups=groups))


def _save_worker(rank, world_size, ckpt, layout, path):
    from megapkl.models.checkpoint import save_checkpoint

    groups, model, ddp, opt, sched = train_setup(ckpt, layout, seed=1)
    train_step(ddp, opt, sched, seed=10)
    with torch.no_grad():
        logits = forward_logits(model, groups, ckpt.ids)
    save_checkpoint(path, ddp, opt, sched, step=1, extra={"note": "after one step"})
    stats = train_step(ddp, opt, sched, seed=11)
    return logits, stats, _weights(model, groups)


def _load_worker(rank, world_size, ckpt, layout, path):
    from megapkl.models.checkpoint import load_checkpoint

    groups, model, ddp, opt, sched = train_setup(ckpt, layout, seed=2)
    with torch.no_grad():  # weights differ from the checkpoint's before loading
        model.embedding.word_embeddings.weight.mul_(0.5)
    result = load_checkpoint(path, ddp, opt, sched)
    with torch.no_grad():
        logits = forward_logits(model, groups, ckpt.ids)
    stats = train_step(ddp, opt, sched, seed=11)
    return result, logits, stats, _weights(model, groups)


CASES = {  # id: (model, saving world, saving layout, loading world, loading layout)
    "tp2_to_tp1": ("dense", 2, dict(tp=2), 1, dict()),
    "tp1_to_tp2": ("dense", 1, dict(), 2, dict(tp=2)),
    "dp1_to_dp2": ("dense", 1, dict(), 2, dict()),
    "moe_ep2_to_tp2sp": ("moe", 2, dict(ep=2), 2, dict(tp=2, sp=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_reshards(dist_run, dense_ckpt, moe_ckpt, tmp_path, case):
    kind, save_world, save_layout, load_world, load_layout = CASES[case]
    ckpt = dense_ckpt if kind == "dense" else moe_ckpt
    path = str(tmp_path / "ckpt")
    saved = dist_run(_save_worker, save_world, ckpt, save_layout, path)[0]
    for result, logits, stats, weights in dist_run(_load_worker, load_world, ckpt, load_layout,
                                                   path):
        assert result.step == 1 and result.extra == {"note": "after one step"}
        assert result.rng_restored == (save_layout == load_layout)  # DP does not matter
        torch.testing.assert_close(logits, saved[0], atol=1e-5, rtol=0)
        assert stats.lr == pytest.approx(saved[1].lr)  # warmup position restored
        assert stats.grad_norm == pytest.approx(saved[1].grad_norm, rel=1e-5)
        for name, ref in saved[2].items():
            torch.testing.assert_close(weights[name], ref, atol=1e-5, rtol=0, msg=name)


def _load_missing(rank, world_size, ckpt, path):
    from megapkl.models.checkpoint import load_checkpoint

    _, model = build_loaded(ckpt.path, ckpt.name)
    try:
        load_checkpoint(path, model)
    except FileNotFoundError as exc:
        return str(exc)
    return "no error"


def test_missing_checkpoint(dist_run, dense_ckpt, tmp_path):
    (msg,) = dist_run(_load_missing, 1, dense_ckpt, str(tmp_path / "none"))
    assert "no megatron distributed checkpoint" in msg
