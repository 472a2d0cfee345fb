"""docs/spec.md section 2 gradient contract: d out.loss / d logp == -coef / Z, and nothing else gets
a gradient.

Every other input (logp_behav, logp_prox, logp_init, topk_logp, topk_logp_behav, advantages) is passed
with requires_grad=True and must receive no gradient (None or exactly zero): credit C_t, weights w,
tempering alpha, the SIS test and the clip gates are all detached. The entropy bonus is not part of
coef; its gradient goes to `entropy` only, with value -entropy_coef * f_t / Z.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference.gen import make_batch  # noqa: E402
from reference.harness import run_library  # noqa: E402
from reference.naive import OBJECTIVES  # noqa: E402

OTHER = ("logp_behav", "logp_prox", "logp_init", "topk_logp", "topk_logp_behav", "advantages")

CONFIGS = [(n, {"name": n}, {"top_k": 3} if n == "dppo_tv" else {}) for n in OBJECTIVES]
CONFIGS += [(f"{n}-smtm", {"name": n, "aggregation": "seq_mean_token_mean"}, {})
            for n in ("pg", "grpo", "proximal_kl", "seq_is", "is_free", "cispo", "m2po", "tetpo")]
CONFIGS += [(f"{n}-seq_mean", {"name": n, "aggregation": "seq_mean"}, {}) for n in ("grpo", "gepo")]
CONFIGS += [(f"dual-{n}", {"name": n, "clip_ratio_c": 1.5}, {"top_k": 3, "learner_scale": 1.2})
            for n in ("grpo", "dapo", "dppo_tv", "clip_cov")]
CONFIGS += [("dual-sis-grpo", {"name": "grpo", "clip_ratio_c": 1.5, "sis": {"enabled": True, "top_k": 3}},
             {"top_k": 3, "learner_scale": 1.2})]
CONFIGS += [("pkl-tsn", {"name": "proximal_kl", "aggregation": "token_sum_norm", "norm_constant": 77.0}, {})]
CONFIGS += [("pkl-tail", {"name": "proximal_kl", "horizon": 3, "tail": "linear", "cost_clip": None}, {})]
CONFIGS += [(f"sis-{n}-K{k}", {"name": n, "sis": {"enabled": True, "top_k": k}}, {"top_k": k})
            for n in ("pg", "grpo", "dapo", "cispo", "proximal_kl", "gspo") for k in (1, 3, 8)]
CONFIGS += [(f"klinit-{n}", {"name": n, "kl_init_coef": 0.1}, {"with_init": True, "top_k": 3}) for n in OBJECTIVES]
CONFIGS += [("dppo_tv-smtm", {"name": "dppo_tv", "aggregation": "seq_mean_token_mean"}, {"top_k": 2}),
            ("clip_cov-smtm", {"name": "clip_cov", "aggregation": "seq_mean_token_mean"}, {})]
CONFIGS += [("klinit-sis-pkl-smtm", {"name": "proximal_kl", "kl_init_coef": 0.1, "aggregation": "seq_mean_token_mean",
                                     "sis": {"enabled": True, "top_k": 3}}, {"with_init": True, "top_k": 3})]
CONFIGS += [(f"entropy-{n}", {"name": n, "entropy_coef": 0.03, "kl_init_coef": 0.01},
             {"with_entropy": True, "with_init": True}) for n in ("grpo", "proximal_kl", "gspo", "tetpo")]


@pytest.mark.parametrize("cid,cfg,bk", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_grad_equals_minus_coef_over_Z(cid, cfg, bk):
    d = make_batch(101, **bk)
    # learner drifted enough that clips / tempering / masks are active
    req = ("logp",) + OTHER + (("entropy",) if bk.get("with_entropy") else ())
    out, batch, leaves = run_library(cfg, d, requires_grad=req)
    assert not out.coef.requires_grad, "coef must be detached"
    assert out.loss.dim() == 0
    out.loss.backward()
    Z = float(out.normalizer)
    g = leaves["logp"].grad
    assert g is not None, "no gradient reached logp"
    expect = -out.coef.detach() / Z
    torch.testing.assert_close(g, expect, rtol=1e-10, atol=1e-14)
    assert bool((out.coef != 0).any()), "vacuous: all coefficients are zero"
    for k in OTHER:
        if k in leaves:
            gk = leaves[k].grad
            assert gk is None or bool((gk == 0).all()), f"{cid}: gradient leaked into {k}"
    if "entropy" in leaves:
        ge = leaves["entropy"].grad
        T = torch.bincount(d["response_index"]).double()[d["response_index"]]
        agg = out_agg(cfg)
        f = 1.0 / T if agg == "seq_mean_token_mean" else torch.ones_like(T)
        torch.testing.assert_close(ge, -cfg["entropy_coef"] * f / Z, rtol=1e-10, atol=1e-14)


def out_agg(cfg):
    from megapkl.objectives import PolicyLossConfig
    return PolicyLossConfig.from_dict(cfg).aggregation


def test_grad_through_upstream_graph():
    """logp may be a non-leaf (computed from parameters): the loss backpropagates -coef/Z through it."""
    d = make_batch(102)
    theta = torch.zeros(d["logp"].shape[0], dtype=torch.float64, requires_grad=True)
    d = dict(d)
    base = d["logp"].clone()
    from megapkl.objectives import PolicyLossConfig, policy_loss
    from reference.gen import to_token_batch
    batch, _ = to_token_batch(d, requires_grad=())
    batch.logp = base + 2.0 * theta
    out = policy_loss(PolicyLossConfig.from_dict({"name": "grpo"}), batch)
    out.loss.backward()
    torch.testing.assert_close(theta.grad, -2.0 * out.coef / out.normalizer, rtol=1e-10, atol=1e-14)
