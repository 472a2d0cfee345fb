"""IS-free control: future-KL shaped advantage with no importance weight (PKL eq. 12)."""
from megapkl.objectives.stats import Stats, Terms


def is_free(s: Stats) -> Terms:
    """coef_t = A_m - C_t; loss -sg[A_m - C_t] log pi."""
    coef = s.adv - s.credit
    return Terms(coef=coef, value=coef * s.logp)
