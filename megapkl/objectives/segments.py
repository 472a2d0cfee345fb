"""Per-response and per-group segment reductions on packed token tensors (all O(N))."""
from __future__ import annotations

import torch
from torch import Tensor


def packed_sum(values: Tensor, lengths: Tensor) -> Tensor:
    """Sum over each response of a packed per-token tensor (responses contiguous, in order)."""
    return torch.segment_reduce(values, "sum", lengths=lengths)


def group_ids(group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Dense group ids 0..G-1 for each response and the number of members of each group."""
    _, dense, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    return dense, counts


def group_logsumexp(x: Tensor, dense: Tensor, num_groups: int) -> Tensor:
    """log(sum_i exp(x_i)) within each group, stable for x in the hundreds: [M] -> [groups]."""
    gmax = x.new_full((num_groups,), -torch.inf).scatter_reduce(0, dense, x, "amax", include_self=True)
    gmax = torch.where(torch.isfinite(gmax), gmax, torch.zeros_like(gmax))
    sums = x.new_zeros(num_groups).index_add_(0, dense, torch.exp(x - gmax[dense]))
    return gmax + torch.log(sums)


def group_mean(x: Tensor, dense: Tensor, counts: Tensor) -> Tensor:
    """Mean over each group's members, broadcast back to the members: [M] -> [M]."""
    sums = x.new_zeros(counts.shape[0]).index_add_(0, dense, x)
    return (sums / counts.to(x.dtype))[dense]
