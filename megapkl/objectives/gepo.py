"""GEPO: group-expectation-normalized sequence weight (TETPO paper sec. 1 baseline; docs/spec.md
section 4.4).

Per group, with sequence log-likelihoods Lpi_i = sum_t log pi_theta and Lmu_i = sum_t log mu:
q_j = mu_j / sum_k mu_k,  E_q[mu] = sum_j q_j mu_j,  weight_i = pi_theta(y_i) / E_q[mu],
all in log space: log weight_i = Lpi_i - (LSE_j 2 Lmu_j - LSE_k Lmu_k). The weight replaces the
sequence ratio of a GSPO-style clipped surrogate; no sample is dropped from the group statistics.
"""
import torch

from megapkl.objectives.gspo import sequence_clip_terms
from megapkl.objectives.segments import group_ids, group_logsumexp
from megapkl.objectives.stats import Stats, Terms


def gepo_weights(l_pi, l_mu, group_index):
    """weight_i = pi_theta(y_i) / E_q[mu] per response, float64."""
    dense, counts = group_ids(group_index)
    ng = counts.shape[0]
    l_mu = l_mu.to(torch.float64)
    log_den = group_logsumexp(2 * l_mu, dense, ng) - group_logsumexp(l_mu, dense, ng)
    return torch.exp(l_pi.to(torch.float64) - log_den[dense])


def gepo(s: Stats) -> Terms:
    """coef_t = weight_m A_m active(weight_m, A_m), GSPO-style clipped surrogate."""
    cfg = s.cfg
    table, rows = s.response_table()
    weight = gepo_weights(table.logp_sum, table.behav_sum, table.group).index_select(0, rows).to(s.dtype)
    return sequence_clip_terms(s, weight, cfg.eps_clip_low, cfg.eps_clip_high)
