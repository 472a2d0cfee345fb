"""TETPO: target-ESS tempering of sequence ratios (TETPO paper sec. 2, Thm. 2-3, Prop. 2; SPEC 4.2).

Per group with sequence log-ratios L_i, ESS(alpha) = (sum_i e^{alpha L_i})^2 / sum_i e^{2 alpha L_i}.
alpha* = max{alpha in [0, 1] : ESS(alpha) >= kappa G}: 1 when the group is healthy, otherwise found by
bisection keeping the feasible end (so ESS(alpha*) >= kappa G holds exactly and Thm. 3's dispersion
bound 1/kappa - 1 applies). Weights wt_i = G softmax_i(alpha* L_i), computed in log space.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapkl.objectives.segments import group_ids, group_logsumexp
from megapkl.objectives.stats import Stats, Terms, clip_active


def log_ess(alpha: Tensor, L: Tensor, dense: Tensor, num_groups: int) -> Tensor:
    """log ESS_g(alpha) = 2 LSE(alpha L) - LSE(2 alpha L), per group; alpha is per group."""
    a = alpha[dense] * L
    return 2 * group_logsumexp(a, dense, num_groups) - group_logsumexp(2 * a, dense, num_groups)


@dataclass
class Tempering:
    alpha: Tensor         # [groups]
    weights: Tensor       # [M], mean 1 within each group
    ess_before: Tensor    # [groups] ESS(1) / G
    ess_after: Tensor     # [groups] ESS(alpha*) / G
    dense: Tensor         # [M] dense group id of each response


def temper(L: Tensor, group_index: Tensor, kappa: float, n_iter: int) -> Tempering:
    """Target-ESS exponent per group by bisection on [0, 1] (Thm. 2), and the tempered weights."""
    L = L.to(torch.float64)
    dense, counts = group_ids(group_index)
    ng = counts.shape[0]
    log_target = torch.log(kappa * counts.to(torch.float64))
    ones = torch.ones(ng, dtype=torch.float64, device=L.device)
    log_ess1 = log_ess(ones, L, dense, ng)
    gmax = L.new_full((ng,), -torch.inf).scatter_reduce(0, dense, L, "amax")
    gmin = L.new_full((ng,), torch.inf).scatter_reduce(0, dense, L, "amin")
    # All-equal ratios (one-member groups included) have ESS = G exactly: alpha* = 1 (Thm. 2 (iv)),
    # decided here rather than by a round-off-prone comparison when kappa = 1.
    healthy = (log_ess1 >= log_target) | (gmax == gmin)
    lo, hi = torch.zeros_like(ones), ones.clone()
    for _ in range(n_iter):
        mid = 0.5 * (lo + hi)
        ok = log_ess(mid, L, dense, ng) >= log_target
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    alpha = torch.where(healthy, ones, lo)
    a = alpha[dense] * L
    log_w = a - group_logsumexp(a, dense, ng)[dense]
    weights = counts.to(torch.float64)[dense] * torch.exp(log_w)
    g = counts.to(torch.float64)
    return Tempering(alpha=alpha, weights=weights, ess_before=torch.exp(log_ess1) / g,
                     ess_after=torch.exp(log_ess(alpha, L, dense, ng)) / g, dense=dense)


def temper_groups(L: Tensor, group_index: Tensor, kappa: float, n_iter: int) -> tuple[Tensor, Tensor]:
    """(alpha* of each response's group [M], tempered weights [M])."""
    t = temper(L, group_index, kappa, n_iter)
    return t.alpha[t.dense], t.weights


def tetpo(s: Stats) -> Terms:
    """coef = wt_m A_m active(wt_m, A_m): straight-through tempered sequence weight (TETPO eq. 7).

    Groups are tempered over all their members in the minibatch (the response table), wherever
    those members sit; the group metrics are therefore global.
    """
    cfg = s.cfg
    table, rows = s.response_table()
    t = temper(table.delta_sum, table.group, cfg.kappa, cfg.bisection_steps)
    wt = t.weights.index_select(0, rows).to(s.dtype)
    adv = s.adv_seq
    active = clip_active(wt, adv, cfg.eps_clip_low, cfg.eps_clip_high)
    clipped = torch.clamp(wt, 1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high)
    metrics = {
        "tetpo/alpha_mean": t.alpha.mean(), "tetpo/alpha_min": t.alpha.min(),
        "tetpo/tempered_frac": (t.alpha < 1).to(torch.float64).mean(),
        "tetpo/ess_frac_before": t.ess_before.mean(), "tetpo/ess_frac_after": t.ess_after.mean(),
    }
    return Terms(coef=s.tok(wt * adv * active), value=torch.minimum(wt * adv, clipped * adv),
                 sequence_level=True, clipped=s.tok(~active), metrics=metrics)
