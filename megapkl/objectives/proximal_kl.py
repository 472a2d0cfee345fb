"""Proximal KL: token-wise IS with bounded future-KL credit (Proximal KL paper eq. 5-7, Alg. 1)."""
from megapkl.objectives.stats import Stats, Terms


def proximal_kl(s: Stats) -> Terms:
    """coef_t = w_t (A_m - C_t), surrogate w_t sg[A_m - C_t] (eq. 7); no PPO clip.

    w is the learner-to-behavior weight; the proximal reference enters only through C_t (eq. 5).
    With SIS, accepted tokens use w = 1.
    """
    shaped = s.adv - s.credit
    w = s.sis_weight(s.w)
    return Terms(coef=w * shaped, value=w * shaped)
