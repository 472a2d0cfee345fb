"""GSPO: clipped length-normalized sequence ratio (SIS paper eq. 35; with SIS eq. 40-41)."""
import torch

from megapkl.objectives.stats import Stats, Terms, clip_active


def gspo(s: Stats) -> Terms:
    """coef_t = s_m A_m active(s_m, A_m), s_m = exp(mean_t Delta_t); surrogate min(s A, clip(s) A).

    grad s_m = s_m (1/T_m) sum_t grad logp_t: the 1/T_m comes from the default
    seq_mean_token_mean aggregation. With SIS, accepted tokens contribute a zero log-ratio to s_m
    (eq. 40) but keep their score gradient.
    """
    cfg = s.cfg
    delta = s.delta if s.accepted is None else torch.where(s.accepted, torch.zeros_like(s.delta), s.delta)
    ratio = torch.exp(s.seq_sum(delta) / s.lengths)
    return sequence_clip_terms(s, ratio, cfg.eps_clip_low, cfg.eps_clip_high)


def sequence_clip_terms(s: Stats, ratio, eps_low: float, eps_high: float) -> Terms:
    """Terms of min(x_m A_m, clip(x_m) A_m) for a per-response ratio x_m (gspo, gepo)."""
    adv = s.adv_seq
    active = clip_active(ratio, adv, eps_low, eps_high)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return Terms(coef=s.tok(ratio * adv * active), value=torch.minimum(ratio * adv, clipped * adv),
                 sequence_level=True, clipped=s.tok(~active))
