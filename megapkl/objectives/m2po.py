"""M2PO: second-moment trust region by token masking (TETPO paper sec. 1 baseline; docs/spec.md
section 4.4).

Variant implemented: "greedy_all". With M2_t = Delta_t^2 over every token of the optimizer
minibatch, drop the tokens with the largest M2 one at a time until the mean M2 of the kept tokens is
at most tau (default 0.04). Nothing is dropped when the mean is already <= tau; if no non-empty kept
set satisfies the bound, every token is dropped. The drop rule is applied as a value cut (drop
M2 >= the k-th largest value), so tokens tied with the last dropped one are dropped too and the mask
does not depend on token order or partition. The surrogate is -1/N sum_t m_t w_t A_m with N counting
all tokens (masked ones included). (The other public variant solves for one bound over "harmful"
tokens only; it is not implemented.)
"""
import math

import torch

from megapkl.objectives.stats import Stats, Terms


def m2_cut(m2: torch.Tensor, tau: float) -> float:
    """Value cut of the greedy trust region: tokens with M2 >= cut are dropped (inf: none)."""
    m2 = m2.to(torch.float64)
    n = m2.shape[0]
    total = m2.sum()
    if total <= tau * n:
        return math.inf
    ordered = torch.sort(m2, descending=True).values
    removed = torch.cumsum(ordered, 0)                # sum of the k largest, k = 1..n
    kept = torch.arange(n - 1, -1, -1, device=m2.device, dtype=torch.float64)  # n - k
    ok = (kept > 0) & (total - removed <= tau * kept)
    if not bool(ok.any()):
        return -math.inf
    k = int(torch.argmax(ok.to(torch.int8)))        # first k (0-based) that satisfies the bound
    return float(ordered[k])


def m2po_mask(delta: torch.Tensor, tau: float, m2_all: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask [N] of the local tokens; the cut comes from all tokens of the minibatch."""
    m2 = delta.to(torch.float64) ** 2
    cut = m2_cut(m2 if m2_all is None else m2_all, tau)
    return m2 < cut


def m2po(s: Stats) -> Terms:
    """coef_t = m_t w_t A_m."""
    mask = m2po_mask(s.delta, s.cfg.m2_threshold, s.ctx.m2_values)
    coef = mask * s.w * s.adv
    return Terms(coef=coef, value=coef, token_metrics={"m2po/mask_frac": ~mask})
