"""One DDP + distributed-Adam step equals a single-process torch reference at any layout.

Reference: the Hugging Face model, cross-entropy on a fixed batch, `clip_grad_norm_(1.0)` and
torch.optim.Adam (0.9, 0.999, 1e-8, no weight decay). megatron at TP1xDP1, TP2xDP1, TP1xDP2
(and EP2 / TP2+SP for the MoE model) must report the same pre-clip gradient norm and end with
the same parameters.
"""

import pytest
import torch
import torch.nn.functional as F

from tiny_models import build_loaded, positions

LR = 1e-3
ROWS = 4  # batch rows, split over data-parallel ranks


def _batch(ckpt):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (ROWS, ckpt.ids.shape[1]), generator=gen)
    labels = torch.randint(0, 128, ids.shape, generator=gen)
    return ids, labels


def _reference(ckpt, clip):
    from transformers import AutoModelForCausalLM

    from megapkl.rollout.embedded import checkpoint_tensors

    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    ids, labels = _batch(ckpt)
    logits = model(ids).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0).step()
    # under the checkpoint's names, which megapkl exports (transformers 5 fuses MoE experts)
    return float(norm), {n: p.clone() for n, p in checkpoint_tensors(model)}


def _megatron_step(rank, world_size, ckpt, layout, clip):
    from megapkl.models.hf import export_hf_weights
    from megapkl.models.optimizer import (OptimSettings, build_optimizer, build_scheduler,
                                          finalize_grads, optimizer_step, wrap_ddp, zero_grads)

    groups, model = build_loaded(ckpt.path, ckpt.name, **layout)
    settings = OptimSettings(lr=LR, clip_grad=clip)
    ddp = wrap_ddp([model], settings)
    opt = build_optimizer(ddp, settings)
    sched = build_scheduler(opt, settings)
    zero_grads(ddp, opt)
    ids, labels = _batch(ckpt)
    rows = ROWS // groups.dp_size
    sl = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
    per_token = ddp[0](ids[sl], positions(ids[sl]), None, labels=labels[sl])
    per_token.mean().backward()  # DDP averages over data-parallel ranks: the global mean
    finalize_grads(ddp)
    stats = optimizer_step(opt, sched)
    weights = dict(export_hf_weights(model, groups=groups))
    return stats, (weights if rank == 0 else None)


def _compare(results, ref_norm, ref_params, atol=2e-5):
    for stats, _ in results:
        assert stats.update_successful
        assert stats.lr == pytest.approx(LR)
        assert stats.grad_norm == pytest.approx(ref_norm, rel=1e-5)
    weights = results[0][1]
    assert set(weights) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(weights[name], ref, atol=atol, rtol=0, msg=name)


DENSE = {"tp1": (1, dict()), "tp2_dp1": (2, dict(tp=2)), "tp1_dp2": (2, dict())}
MOE = {"tp1": (1, dict()), "ep2_dp2": (2, dict(ep=2)), "tp2sp": (2, dict(tp=2, sp=True))}


@pytest.mark.parametrize("layout", list(DENSE))
def test_dense_step_matches_single_process(dist_run, dense_ckpt, layout):
    world, kw = DENSE[layout]
    ref_norm, ref_params = _reference(dense_ckpt, clip=1.0)
    assert ref_norm > 1.0  # clipping is active
    _compare(dist_run(_megatron_step, world, dense_ckpt, kw, 1.0), ref_norm, ref_params)


@pytest.mark.parametrize("layout", list(MOE))
def test_moe_step_matches_single_process(dist_run, moe_ckpt, layout):
    world, kw = MOE[layout]
    ref_norm, ref_params = _reference(moe_ckpt, clip=1.0)
    _compare(dist_run(_megatron_step, world, moe_ckpt, kw, 1.0), ref_norm, ref_params)


def test_lr_schedule():
    from megapkl.models.optimizer import OptimSettings, lr_at

    warm = OptimSettings(lr=1.0, warmup_steps=4)
    assert [lr_at(warm, n) for n in (1, 2, 4, 5, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    cos = OptimSettings(lr=1.0, min_lr=0.1, lr_schedule="cosine", warmup_steps=2,
                        decay_steps=6)
    assert lr_at(cos, 2) == 1.0 and lr_at(cos, 4) == pytest.approx(0.55)
    assert lr_at(cos, 6) == pytest.approx(0.1) and lr_at(cos, 9) == 0.1
    with pytest.raises(ValueError, match="decay_steps"):
        OptimSettings(lr_schedule="cosine")


def _scheduler_lrs(rank, world_size, ckpt, settings, steps):
    from megapkl.models.optimizer import (build_optimizer, build_scheduler, optimizer_step,
                                          wrap_ddp, zero_grads)

    _, model = build_loaded(ckpt.path, ckpt.name)
    ddp = wrap_ddp([model], settings)
    opt = build_optimizer(ddp, settings)
    sched = build_scheduler(opt, settings)
    lrs = []
    for _ in range(steps):
        zero_grads(ddp, opt)
        lrs.append(optimizer_step(opt, sched).lr)
    return lrs


def test_scheduler_follows_lr_at(dist_run, dense_ckpt):
    from megapkl.models.optimizer import OptimSettings, lr_at

    settings = OptimSettings(lr=1e-3, min_lr=1e-4, lr_schedule="cosine", warmup_steps=2,
                             decay_steps=5)
    (lrs,) = dist_run(_scheduler_lrs, 1, dense_ckpt, settings, 7)
    assert lrs == pytest.approx([lr_at(settings, n) for n in range(1, 8)])
