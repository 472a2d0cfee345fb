"""Sequence-level IS control: geometric-mean sequence weight with future-KL credit (PKL eq. 11)."""
import torch

from megapkl.objectives.stats import Stats, Terms


def seq_is(s: Stats) -> Terms:
    """coef_t = g_m (A_m - C_t), g_m = (pi_theta(y_m) / mu(y_m))^{1/T_m} = exp(mean_t Delta_t)."""
    g = torch.exp(s.seq_sum(s.delta) / s.lengths)
    coef = s.tok(g) * (s.adv - s.credit)
    return Terms(coef=coef, value=coef * s.logp)
