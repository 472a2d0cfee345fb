"""Unclipped token-wise importance-weighted policy gradient (Proximal KL paper eq. 10)."""
from megapkl.objectives.stats import Stats, Terms


def pg(s: Stats) -> Terms:
    """coef_t = w_t A_m; surrogate w_t sg[A_m]. With SIS, accepted tokens use w = 1."""
    w = s.sis_weight(s.w)
    return Terms(coef=w * s.adv, value=w * s.adv)
