"""M2PO: second-moment trust region by token masking (TETPO paper sec. 1 baseline; SPEC 4.4).

Variant implemented: "greedy_all". With M2_t = Delta_t^2 over every token of the optimizer
minibatch, drop the tokens with the largest M2 one at a time until the mean M2 of the kept tokens is
at most tau (default 0.04). Nothing is dropped when the mean is already <= tau; if no non-empty kept
set satisfies the bound, every token is dropped. The surrogate is -1/N sum_t m_t w_t A_m with N
counting all tokens (masked ones included). (The other public variant solves for one bound over
"harmful" tokens only; it is not implemented.)
"""
import torch

from megapkl.objectives.stats import Stats, Terms


def m2po_mask(delta: torch.Tensor, tau: float) -> torch.Tensor:
    """Keep-mask [N] of the greedy second-moment trust region."""
    m2 = (delta.to(torch.float64)) ** 2
    n = m2.shape[0]
    total = m2.sum()
    if total <= tau * n:
        return torch.ones(n, dtype=torch.bool, device=delta.device)
    order = torch.argsort(m2, descending=True)
    removed = torch.cumsum(m2[order], 0)              # sum of the k largest, k = 1..n
    kept = torch.arange(n - 1, -1, -1, device=delta.device, dtype=torch.float64)  # n - k
    ok = (kept > 0) & (total - removed <= tau * kept)
    k = int(torch.argmax(ok.to(torch.int8))) + 1 if bool(ok.any()) else n
    mask = torch.ones(n, dtype=torch.bool, device=delta.device)
    mask[order[:k]] = False
    return mask


def m2po(s: Stats) -> Terms:
    """coef_t = m_t w_t A_m."""
    mask = m2po_mask(s.delta, s.cfg.m2_threshold)
    coef = mask * s.w * s.adv
    return Terms(coef=coef, value=coef, metrics={"m2po/mask_frac": 1.0 - mask.to(torch.float64).mean()})
