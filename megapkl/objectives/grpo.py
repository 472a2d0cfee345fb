"""GRPO with decoupled PPO clip (Proximal KL paper eq. 8; SIS paper eq. 15/34 for DAPO and SIS).

Optional dual clip (Ye et al. 2020, arXiv:1912.09729), as verl's `clip_ratio_c` and slime's
`--eps-clip-c` apply it: where A < 0 the per-token surrogate is max(c A, min(rho A, clip(rho) A)),
so a token whose ratio exceeds c contributes the constant c A and no gradient.
"""
import torch

from megapkl.objectives.stats import Stats, Terms, clip_active


def grpo(s: Stats) -> Terms:
    """coef_t = w_t A_m active(rho_t, A_m), surrogate (pi_k/mu) min(rho A, clip(rho) A).

    The clip gate acts on rho = pi_theta/pi_k (movement from the frozen proximal reference); the
    factor pi_k/mu corrects for the behavior policy, so the gradient weight is w = (pi_k/mu) rho.
    `dapo` is this objective with eps_clip_high 0.28 (asymmetric "clip-higher"). SIS-accepted tokens
    are on-policy samples of pi_theta: coef = A, no gate (SIS eq. 10, 15), the dual clip included.
    """
    cfg = s.cfg
    rho = torch.exp(s.l)
    r = torch.exp(s.logp_prox - s.logp_behav)
    adv = s.adv
    active = clip_active(rho, adv, cfg.eps_clip_low, cfg.eps_clip_high)
    clipped_rho = torch.clamp(rho, 1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high)
    surrogate = torch.minimum(rho * adv, clipped_rho * adv)
    metrics = {}
    if cfg.clip_ratio_c is not None:
        c = cfg.clip_ratio_c
        # A < 0: min(rho A, clip(rho) A) = A max(rho, clip(rho)); below c A the bound binds.
        dual = (adv < 0) & (torch.maximum(rho, clipped_rho) > c)
        active = active & ~dual
        surrogate = torch.where(dual, c * adv, surrogate)
        metrics["clip/dual_frac"] = dual if s.accepted is None else dual & ~s.accepted
    coef = s.sis_override(adv, s.w * adv * active)
    value = s.sis_override(adv, r * surrogate)
    clipped = ~active if s.accepted is None else ~active & ~s.accepted
    return Terms(coef=coef, value=value, clipped=clipped, token_metrics=metrics)
