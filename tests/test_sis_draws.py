"""SIS uniform draws (docs/spec.md section 4.3): counter-based, a pure function of (seed, step, uid,
position).

Also: policy_loss's SIS acceptance is partition invariant (split into sub-batches of whole responses
with response_uid preserved), and its acceptance equals the reference's test fed with the same draws.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference.gen import make_batch, subset_responses  # noqa: E402
from reference.harness import run_library, run_reference  # noqa: E402
from reference.naive import naive_sis_accept  # noqa: E402


def draws(seed, step, uid, pos):
    from megapkl.objectives.sis import uniform_draws
    return uniform_draws(seed, step, torch.as_tensor(uid, dtype=torch.int64), torch.as_tensor(pos, dtype=torch.int64))


def _tokens(n=5000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    uid = torch.randint(0, 10 ** 9, (n,), generator=gen)
    pos = torch.randint(1, 40000, (n,), generator=gen)
    return uid, pos


def test_draws_dtype_range_shape():
    uid, pos = _tokens()
    u = draws(0, 0, uid, pos)
    assert u.dtype == torch.float64
    assert tuple(u.shape) == (5000,)
    assert bool((u >= 0).all()) and bool((u < 1).all())


def test_draws_permutation_invariant():
    uid, pos = _tokens()
    u = draws(3, 11, uid, pos)
    perm = torch.randperm(len(uid), generator=torch.Generator().manual_seed(1))
    assert torch.equal(draws(3, 11, uid[perm], pos[perm]), u[perm])


def test_draws_split_invariant():
    uid, pos = _tokens()
    u = draws(3, 11, uid, pos)
    cuts = [0, 1, 17, 1000, 1001, 4000, 5000]
    parts = [draws(3, 11, uid[a:b], pos[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(parts), u)
    # one token at a time
    for i in (0, 123, 4999):
        assert draws(3, 11, uid[i:i + 1], pos[i:i + 1]).item() == u[i].item()
    # the value does not depend on the other tokens present (duplicates are identical)
    both = draws(3, 11, torch.stack([uid[5], uid[5]]), torch.stack([pos[5], pos[5]]))
    assert both[0].item() == both[1].item() == u[5].item()


@pytest.mark.parametrize("what", ["seed", "step", "uid", "pos"])
def test_draws_change_with_every_counter(what):
    uid, pos = _tokens()
    u = draws(3, 11, uid, pos)
    args = {"seed": 3, "step": 11, "uid": uid, "pos": pos}
    args[what] = {"seed": 4, "step": 12, "uid": uid + 1, "pos": pos + 1}[what]
    v = draws(args["seed"], args["step"], args["uid"], args["pos"])
    assert (u == v).double().mean().item() < 1e-3
    # and they are not trivially related (no strong correlation)
    c = torch.corrcoef(torch.stack([u, v]))[0, 1].item()
    assert abs(c) < 0.06


def test_draws_no_uid_position_aliasing():
    # (uid, pos) and (uid+1, pos-1) etc. must not collide systematically
    uid = torch.arange(200).repeat_interleave(50)
    pos = torch.arange(1, 51).repeat(200)
    u = draws(0, 0, uid, pos)
    assert torch.unique(u).numel() == u.numel()


def test_draws_roughly_uniform():
    scipy_stats = pytest.importorskip("scipy.stats")
    uid = torch.arange(500).repeat_interleave(200)
    pos = torch.arange(1, 201).repeat(500)
    u = draws(9, 2, uid, pos)
    assert scipy_stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    # consecutive positions of the same response are not correlated
    x = u.view(500, 200)
    c = torch.corrcoef(torch.stack([x[:, :-1].reshape(-1), x[:, 1:].reshape(-1)]))[0, 1].item()
    assert abs(c) < 0.02
    # counts in 10 bins
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert scipy_stats.chisquare(counts.numpy()).pvalue > 1e-3


def test_default_uid_is_batch_index():
    d = make_batch(300, top_k=3)
    cfg = {"name": "pg", "sis": {"enabled": True, "top_k": 3}, "seed": 2}
    out1, _, _ = run_library(cfg, d)
    d2 = dict(d)
    d2["response_uid"] = torch.arange(len(d["group_index"]))
    out2, _, _ = run_library(cfg, d2)
    assert torch.equal(out1.coef, out2.coef)


@pytest.mark.parametrize("name", ["pg", "grpo", "proximal_kl", "cispo"])
def test_policy_loss_sis_partition_invariant(name):
    K = 3
    uid = [1000 + 37 * m for m in range(12)]
    d = make_batch(301, top_k=K, response_uid=uid, step=5)
    cfg = {"name": name, "sis": {"enabled": True, "top_k": K}, "seed": 11, "aggregation": "token_sum_norm",
           "norm_constant": 100.0}
    full, _, _ = run_library(cfg, d)
    assert 0.05 < full.metrics["sis/accept_rate"] < 0.95, "test setup: acceptance must be mixed"
    # whole groups move together (credit / advantages are per response, token_sum_norm fixes Z)
    for parts in ([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]], [[8, 9, 10, 11, 0, 1, 2, 3], [4, 5, 6, 7]]):
        n_acc = 0.0
        for keep in parts:
            sub = subset_responses(d, keep)
            out, _, _ = run_library(cfg, sub)
            tok = torch.tensor(sub["_token_subset"])
            torch.testing.assert_close(out.coef, full.coef[tok], rtol=1e-12, atol=0)
            n_acc += out.metrics["sis/accept_rate"] * len(tok)
        assert n_acc == pytest.approx(full.metrics["sis/accept_rate"] * len(full.coef), abs=1e-9)


def test_policy_loss_sis_draws_depend_on_uid_and_step():
    K = 3
    d = make_batch(302, top_k=K, response_uid=list(range(12)), step=5)
    cfg = {"name": "pg", "sis": {"enabled": True, "top_k": K}, "seed": 11}
    base, _, _ = run_library(cfg, d)
    for change in ({"step": 6}, {"response_uid": torch.arange(12) + 50}):
        d2 = dict(d)
        d2.update(change)
        out, _, _ = run_library(cfg, d2)
        assert not torch.equal(out.coef, base.coef), f"acceptance ignores {list(change)}"
    out, _, _ = run_library({**cfg, "seed": 12}, d)
    assert not torch.equal(out.coef, base.coef), "acceptance ignores the seed"


def test_policy_loss_acceptance_matches_reference_test():
    """The library's accept decisions equal the naive test fed with the library's draws."""
    from megapkl.objectives.sis import uniform_draws
    K = 4
    d = make_batch(303, top_k=K, response_uid=list(range(7, 19)), step=9)
    cfg = {"name": "pg", "sis": {"enabled": True, "top_k": K}, "seed": 21}
    u = uniform_draws(21, 9, d["response_uid"][d["response_index"]], d["positions"])
    z = naive_sis_accept(d["logp"], d["logp_behav"], d["token_ids"], d["topk_ids"], d["topk_logp_behav"],
                         d["topk_logp"], u)
    out, _, _ = run_library(cfg, d)
    A = d["advantages"]
    w = (d["logp"] - d["logp_behav"]).exp()
    expect = torch.where(torch.tensor(z, dtype=torch.bool), A, w * A)
    torch.testing.assert_close(out.coef, expect, rtol=1e-12, atol=1e-15)
    assert 0 < sum(z) < len(z)
    ref = run_reference(cfg, d)
    assert out.metrics["sis/accept_rate"] == pytest.approx(ref[3]["sis/accept_rate"], abs=1e-15)
