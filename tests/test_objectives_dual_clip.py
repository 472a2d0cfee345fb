"""Dual clip (verl `clip_ratio_c`, slime `--eps-clip-c`) and GSPO's aggregation (logged value vs gradient)."""
import math

import pytest
import torch

from megapkl.objectives import PolicyLossConfig, TokenBatch, policy_loss

from reference.gen import make_batch
from reference.harness import run_library


def coupled_batch(ratios, advantages):
    """One token per response, prox = behav, so rho = w = the given ratio."""
    n = len(ratios)
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64) * 0.1).requires_grad_()
    return TokenBatch(logp=logp, logp_behav=torch.full((n,), math.log(0.1), dtype=torch.float64),
                      advantages=torch.tensor(advantages, dtype=torch.float64),
                      response_index=torch.arange(n), group_index=torch.arange(n),
                      positions=torch.ones(n, dtype=torch.int64))


def test_dual_clip_hand_values():
    # rho = [4, 2, 0.5, 4], A = [-1, -1, -1, +1], eps 0.2, c = 3
    # A < 0: surrogate max(3A, min(rho A, clip(rho) A)): [-3 (dual, no gradient), -2, -0.8 (clipped), 1.2]
    batch = coupled_batch([4.0, 2.0, 0.5, 4.0], [-1.0, -1.0, -1.0, 1.0])
    out = policy_loss(PolicyLossConfig.from_dict({"name": "grpo", "clip_ratio_c": 3.0}), batch)
    assert out.coef.tolist() == pytest.approx([0.0, -2.0, 0.0, 0.0])
    assert out.loss.item() == pytest.approx(-(-3.0 - 2.0 - 0.8 + 1.2) / 4)
    assert out.metrics["clip/dual_frac"] == pytest.approx(0.25)
    assert out.metrics["clip/frac"] == pytest.approx(0.75)
    off = policy_loss(PolicyLossConfig.from_dict({"name": "grpo"}), coupled_batch([4.0, 2.0, 0.5, 4.0],
                                                                                   [-1.0, -1.0, -1.0, 1.0]))
    assert off.coef.tolist() == pytest.approx([-4.0, -2.0, 0.0, 0.0])
    assert "clip/dual_frac" not in off.metrics


def test_dual_clip_matches_verl_per_token_formula():
    """verl compute_policy_loss (vanilla): where A < 0, min(-A c, max(-A rho, -A clip(rho)))."""
    d = make_batch(110, learner_scale=1.2, with_prox=False)
    cfg = {"name": "dapo", "clip_ratio_c": 1.5}
    out, batch, leaves = run_library(cfg, d)
    logp = leaves["logp"]
    rho = torch.exp(logp - d["logp_behav"])
    a = d["advantages"]
    l1 = torch.maximum(-a * rho, -a * torch.clamp(rho, 0.8, 1.28))
    per_token = torch.where(a < 0, torch.minimum(-a * 1.5, l1), l1)
    verl = per_token.mean()
    verl_grad, = torch.autograd.grad(verl, logp)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(verl.item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, verl_grad, rtol=1e-12, atol=1e-15)
    assert out.metrics["clip/dual_frac"] > 0.02, "vacuous: the dual clip never binds on this batch"


def test_dual_clip_off_by_default_and_presets_unchanged():
    from megapkl.config import load_config
    for preset in ("grpo", "dapo", "sis_grpo", "sis_dapo"):
        cfg = load_config(f"configs/objectives/{preset}.yaml")
        assert cfg.objective.clip_ratio_c is None, preset


@pytest.mark.parametrize("cfg,needle", [
    ({"name": "grpo", "clip_ratio_c": 1.0}, "objective.clip_ratio_c"),
    ({"name": "proximal_kl", "clip_ratio_c": 3.0}, "objective.clip_ratio_c"),
    ({"name": "gspo", "clip_ratio_c": 3.0}, "objective.clip_ratio_c"),
    ({"name": "gspo", "aggregation": "seq_mean"}, "objective.aggregation"),
    ({"name": "gspo", "aggregation": "seq_mean", "sis": {"enabled": True}}, "objective.aggregation"),
])
def test_bad_combinations_are_refused_naming_the_key(cfg, needle):
    with pytest.raises(ValueError) as e:
        PolicyLossConfig.from_dict(cfg)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg.strip(), msg


def gspo_surrogate(logp, d, eps_lo, eps_hi):
    """Naive GSPO objective (1/M) sum_m min(s_m A_m, clip(s_m) A_m), s_m = exp(mean_t Delta_t), autograd."""
    ridx, M = d["response_index"], len(d["group_index"])
    total = logp.new_zeros(())
    for m in range(M):
        sel = ridx == m
        s = torch.exp((logp[sel] - d["logp_behav"][sel]).mean())
        a = float(d["advantages"][sel][0])
        total = total + torch.minimum(s * a, torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * a)
    return total / M


def test_gspo_logged_loss_gradient_is_the_applied_gradient():
    """Every aggregation GSPO accepts: autograd of the logged value == the gradient loss.backward() applies."""
    d = make_batch(111, learner_scale=0.02, prox_scale=0.0)
    accepted_modes = []
    for agg in ("seq_mean_token_mean", "seq_mean"):
        cfg = {"name": "gspo", "aggregation": agg, "eps_clip_low": 0.2, "eps_clip_high": 0.2}
        try:
            PolicyLossConfig.from_dict(cfg)
        except ValueError as e:
            assert "objective.aggregation" in str(e)
            continue
        accepted_modes.append(agg)
        out, batch, leaves = run_library(cfg, d)
        out.loss.backward()
        logp = leaves["logp"].detach().clone().requires_grad_()
        value = -gspo_surrogate(logp, d, 0.2, 0.2)
        grad, = torch.autograd.grad(value, logp)
        assert out.loss.item() == pytest.approx(value.item(), rel=1e-12)
        torch.testing.assert_close(leaves["logp"].grad, grad, rtol=1e-10, atol=1e-14)
    assert accepted_modes == ["seq_mean_token_mean"]
