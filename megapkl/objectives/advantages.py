"""Reward advantages per response (docs/spec.md section 3; PKL paper eq. A.2 and C.1).

All functions take per-response rewards [M] and prompt-group ids [M] and return advantages [M].
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megapkl.objectives.segments import group_ids, group_mean

AdvantageMode = Literal["group_mean", "group_std", "raw"]


def compute_advantages(rewards: Tensor, group_index: Tensor, mode: AdvantageMode = "group_mean",
                       perturb_baseline: bool = False, std_eps: float = 1e-5) -> Tensor:
    """A_m from verifier rewards.

    group_mean: R_m - mean_g R.  group_std (eq. A.2): (R_m - mean_g R) / (s_g + std_eps), s_g the
    sample standard deviation (G-1 denominator; a one-member group has s = 0 and advantage 0).
    raw: R_m.  perturb_baseline (eq. C.1): add 1{max_g R > min_g R} after normalization.
    """
    rewards = rewards.to(torch.float64) if not rewards.is_floating_point() else rewards
    dense, counts = group_ids(group_index)
    if mode == "raw":
        adv = rewards.clone()
    else:
        centered = rewards - group_mean(rewards, dense, counts)
        if mode == "group_mean":
            adv = centered
        elif mode == "group_std":
            g = counts.to(rewards.dtype)
            ss = rewards.new_zeros(counts.shape[0]).index_add_(0, dense, centered * centered)
            std = torch.sqrt(ss / torch.clamp(g - 1, min=1))
            adv = centered / (std[dense] + std_eps)
        else:
            raise ValueError(f"advantage mode: expected group_mean | group_std | raw, got {mode!r}")
    if perturb_baseline:
        adv = adv + nonconstant_groups(rewards, dense, counts.shape[0]).to(adv.dtype)
    return adv


def nonconstant_groups(rewards: Tensor, dense: Tensor, num_groups: int) -> Tensor:
    """Per response: 1 if its group's rewards are not all equal (I_g of eq. C.1), else 0."""
    gmax = rewards.new_full((num_groups,), -torch.inf).scatter_reduce(0, dense, rewards, "amax")
    gmin = rewards.new_full((num_groups,), torch.inf).scatter_reduce(0, dense, rewards, "amin")
    return (gmax > gmin)[dense]

