"""Clip-Cov: GRPO with a log-prob x advantage covariance mask (SIS paper eq. 38, Table 2).

Cov_t = (log pi_theta(a_t) - mean log pi)(A_t - mean A), both means over every action token of the
optimizer minibatch (all ranks and micro-batches: `LossContext.token_means`, filled by the parallel
layer's pre-pass). Tokens with Cov_t > omega are detached:
coef_t = 1[Cov_t <= omega] w_t A_m active(rho_t, A_m), on top of GRPO's clip (Table 2). The paper's
deterministic threshold is used, not the random subset of the original method.
"""
import torch
from torch import Tensor

from megapkl.objectives.grpo import grpo
from megapkl.objectives.stats import Stats, Terms


def covariance(logp: Tensor, adv: Tensor, means: Tensor | None = None) -> Tensor:
    """[N] per-token covariance term; `means` = (mean log pi, mean A) of the minibatch, else local."""
    logp, adv = logp.to(torch.float64), adv.to(torch.float64)
    if means is None:
        means = torch.stack([logp.mean(), adv.mean()])
    return (logp - means[0]) * (adv - means[1])


def clip_cov(s: Stats) -> Terms:
    """coef_t = 1[Cov_t <= omega] * GRPO coef_t; masked tokens contribute no surrogate value."""
    keep = covariance(s.logp, s.adv, s.ctx.token_means) <= s.cfg.cov_omega
    base = grpo(s)
    return Terms(coef=base.coef * keep, value=base.value * keep, clipped=base.clipped,
                 token_metrics={**base.token_metrics, "clip_cov/mask_frac": ~keep})
