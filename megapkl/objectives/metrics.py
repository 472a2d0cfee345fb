"""Metrics every objective reports (SPEC section 9), as plain floats."""
from __future__ import annotations

import torch
from torch import Tensor

from megapkl.objectives.stats import Stats, Terms


def collect_metrics(s: Stats, terms: Terms, coef: Tensor, loss: Tensor) -> dict[str, float]:
    """Loss, coefficient, IS, proximal-KL, clip, SIS and objective-specific statistics."""
    d = s.logp_prox - s.logp
    abs_delta = s.delta.abs()
    out: dict[str, Tensor] = {
        "loss": loss,
        "coef/mean": coef.mean(),
        "coef/abs_max": coef.abs().max(),
        "is/w_mean": s.w.mean(),
        "is/w_max": s.w.max(),
        "is/w_min": s.w.min(),
        "is/log_dev": s.seq_sum(abs_delta).mean(),
        "kl/prox_k3": (torch.exp(d) - d - 1).mean(),
    }
    if terms.clipped is not None:
        out["clip/frac"] = terms.clipped.to(s.dtype).mean()
    if s.cfg.uses_credit:
        c, eps = s.credit, s.cfg.cost_clip
        out["pkl/cost_clip_frac"] = (s.l.abs() > eps).to(s.dtype).mean() if eps is not None \
            else torch.zeros((), dtype=s.dtype)
        out["pkl/credit_mean"] = c.mean()
        out["pkl/credit_abs_max"] = c.abs().max()
    if s.sis is not None:
        z = s.sis.accepted
        out["sis/accept_rate"] = z.to(s.dtype).mean()
        out["sis/log_dev"] = s.seq_sum(torch.where(z, torch.zeros_like(abs_delta), abs_delta)).mean()
        out["sis/xi_k"] = s.sis.xi_k.mean()
    if s.cfg.kl_init_coef > 0:
        out["kl/init_k3"] = (torch.exp(s.batch.logp_init.detach() - s.logp)
                             - (s.batch.logp_init.detach() - s.logp) - 1).mean()
    if s.batch.entropy is not None:
        out["entropy"] = s.batch.entropy.detach().mean()
    out.update(terms.metrics)
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out.values()]).tolist()
    return dict(zip(out.keys(), values))
