"""DPPO-TV: GRPO with a total-variation trust-region mask (SIS paper eq. 37, Table 2).

TV_t = 1/2 ||pi_theta(.|prefix) - mu(.|prefix)||_1 between the current and the behavior next-token
distributions. Only the behavior top-K ids K_t are recorded, so the distributions are compared on
K_t plus one bin holding the mass outside it:

    TV_t ~= 1/2 (sum_{v in K_t} |pi(v) - mu(v)| + |(1 - sum_K pi) - (1 - sum_K mu)|),

a lower bound of the true TV (merging bins never increases an L1 distance). A token whose TV exceeds
`tv_delta` is masked: coef_t = 1[TV_t <= delta] w_t A_m active(rho_t, A_m), on top of GRPO's clip
("all variants build on GRPO", Table 2).
"""
import torch
from torch import Tensor

from megapkl.objectives.grpo import grpo
from megapkl.objectives.stats import Stats, Terms


def topk_tv(topk_logp: Tensor, topk_logp_behav: Tensor) -> Tensor:
    """[N] TV on the behavior top-K plus the lumped residual mass (float64)."""
    p = torch.exp(topk_logp.to(torch.float64))
    q = torch.exp(topk_logp_behav.to(torch.float64))
    inside = (p - q).abs().sum(dim=-1)
    residual = (p.sum(dim=-1) - q.sum(dim=-1)).abs()
    return 0.5 * (inside + residual)


def dppo_tv(s: Stats) -> Terms:
    """coef_t = 1[TV_t <= delta] * GRPO coef_t; masked tokens contribute no surrogate value."""
    b = s.batch
    tv = topk_tv(b.topk_logp.detach(), b.topk_logp_behav.detach())
    keep = tv <= s.cfg.tv_delta
    base = grpo(s)
    return Terms(coef=base.coef * keep, value=base.value * keep, clipped=base.clipped,
                 token_metrics={**base.token_metrics, "dppo/mask_frac": ~keep, "dppo/tv": tv})
