"""CISPO: clipped, detached importance weight on the score (Proximal KL eq. 9; SIS eq. 36)."""
import torch

from megapkl.objectives.stats import Stats, Terms


def cispo(s: Stats) -> Terms:
    """coef_t = clip(w_t, c_lo, c_hi) A_m; loss sg[coef] log pi. PKL uses [0, 5], SIS [0, 1+eps_hi].

    The clip bounds the weight but never zeroes the gradient; `clip/frac` counts tokens whose weight
    was clipped. SIS-accepted tokens take weight 1.
    """
    lo, hi = s.cfg.is_clip
    coef = s.sis_override(s.adv, torch.clamp(s.w, lo, hi) * s.adv)
    clipped = (s.w < lo) | (s.w > hi)
    if s.accepted is not None:
        clipped = clipped & ~s.accepted
    return Terms(coef=coef, value=coef * s.logp, clipped=clipped)
