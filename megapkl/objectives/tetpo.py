"""TETPO: target-ESS tempering of sequence ratios (TETPO paper sec. 2, Thm. 2-3, Prop. 2;
docs/spec.md section 4.2).

Per group with sequence log-ratios L_i, ESS(alpha) = (sum_i e^{alpha L_i})^2 / sum_i e^{2 alpha L_i}.
alpha* = max{alpha in [0, 1] : ESS(alpha) >= kappa G}: 1 when the group is healthy, otherwise found by
bisection keeping the feasible end (so ESS(alpha*) >= kappa G holds exactly and Thm. 3's dispersion
bound 1/kappa - 1 applies). Weights wt_i = G softmax_i(alpha* L_i), computed in log space.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapkl.objectives.metrics import quantile_metrics
from megapkl.objectives.segments import group_ids
from megapkl.objectives.stats import Stats, Terms, clip_active


def log_ess(alpha: Tensor, L: Tensor, valid: Tensor) -> Tensor:
    """log ESS_g(alpha) = 2 LSE(alpha L) - LSE(2 alpha L) per group; L is [groups, G_max] padded."""
    a = torch.where(valid, alpha.unsqueeze(-1) * L, -torch.inf)
    return 2 * torch.logsumexp(a, dim=-1) - torch.logsumexp(2 * a, dim=-1)


@dataclass
class Tempering:
    alpha: Tensor         # [groups]
    weights: Tensor       # [M], mean 1 within each group
    ess_before: Tensor    # [groups] ESS(1) / G
    ess_after: Tensor     # [groups] ESS(alpha*) / G
    dense: Tensor         # [M] dense group id of each response


def _pad_groups(L: Tensor, dense: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Members of each group as rows of a [groups, G_max] matrix (so the bisection is dense math)."""
    order = torch.argsort(dense, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(L.numel(), device=L.device) - starts.index_select(0, dense.index_select(0, order))
    mat = L.new_zeros((counts.numel(), int(counts.max())))
    valid = torch.zeros(mat.shape, dtype=torch.bool, device=L.device)
    rows = dense.index_select(0, order)
    mat[rows, slot] = L.index_select(0, order)
    valid[rows, slot] = True
    where = torch.empty_like(order)
    where[order] = slot
    return mat, valid, where


def temper(L: Tensor, group_index: Tensor, kappa: float, n_iter: int) -> Tempering:
    """Target-ESS exponent per group by bisection on [0, 1] (Thm. 2), and the tempered weights."""
    L = L.to(torch.float64)
    dense, counts = group_ids(group_index)
    mat, valid, slot = _pad_groups(L, dense, counts)
    g = counts.to(torch.float64)
    log_target = torch.log(kappa * g)
    ones = torch.ones_like(g)
    log_ess1 = log_ess(ones, mat, valid)
    spread = torch.where(valid, mat, -torch.inf).amax(-1) - torch.where(valid, mat, torch.inf).amin(-1)
    # All-equal ratios (one-member groups included) have ESS = G exactly: alpha* = 1 (Thm. 2 (iv)),
    # decided here rather than by a round-off-prone comparison when kappa = 1.
    healthy = (log_ess1 >= log_target) | (spread == 0)
    lo, hi = torch.zeros_like(g), ones.clone()
    for _ in range(n_iter):
        mid = 0.5 * (lo + hi)
        ok = log_ess(mid, mat, valid) >= log_target
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    alpha = torch.where(healthy, ones, lo)
    a = torch.where(valid, alpha.unsqueeze(-1) * mat, -torch.inf)
    w = g.unsqueeze(-1) * torch.softmax(a, dim=-1)           # G softmax(alpha* L) per group
    weights = w[dense, slot]
    return Tempering(alpha=alpha, weights=weights, ess_before=torch.exp(log_ess1) / g,
                     ess_after=torch.exp(log_ess(alpha, mat, valid)) / g, dense=dense)


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
        # per-group distributions (every shard holds every group: already global)
        **quantile_metrics("tetpo/alpha", t.alpha), **quantile_metrics("tetpo/ess_frac_before", t.ess_before),
        **quantile_metrics("tetpo/ess_frac_after", t.ess_after),
    }
    return Terms(coef=s.tok(wt * adv * active), value=torch.minimum(wt * adv, clipped * adv),
                 sequence_level=True, clipped=s.tok(~active), metrics=metrics)
