"""`LossContext`: statistics that reach beyond the tokens of one loss call (docs/spec.md section 7).

The objective math only ever sees local tokens. When those are a shard of the optimizer minibatch
(context-parallel chunks, micro-batches, data-parallel ranks), `megapkl.parallel` fills a
`LossContext` with the detached global quantities, and the same code gives the single-process
answer. Every field left `None` means "the local batch is the whole minibatch".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor


@dataclass
class ResponseTable:
    """Detached per-response sums of every response in the optimizer minibatch (for group statistics).

    uid: [R] global response ids; group: [R] prompt-group ids; delta_sum: sum_t (logp - logp_behav);
    logp_sum / behav_sum: sequence log-likelihoods under pi_theta and mu (GEPO).
    """

    uid: Tensor
    group: Tensor
    delta_sum: Tensor
    logp_sum: Tensor
    behav_sum: Tensor

    def rows(self, uids: Tensor) -> Tensor:
        """Row of each requested uid; raises if a uid is missing (a group member was not gathered)."""
        order = torch.argsort(self.uid)
        sorted_uid = self.uid.index_select(0, order)
        pos = torch.searchsorted(sorted_uid, uids).clamp(max=sorted_uid.numel() - 1)
        found = sorted_uid.index_select(0, pos) == uids
        if not bool(found.all()):
            missing = uids[~found][:5].tolist()
            raise ValueError(f"LossContext.response_table: responses {missing} are not in the table")
        return order.index_select(0, pos)


@dataclass
class LossContext:
    """Global (detached) statistics injected by the parallel layer; see module docstring.

    num_tokens / num_responses: size of the whole optimizer minibatch (normalizer Z of docs/spec.md
    section 5).
    response_lengths: [M] full T_m of the local responses, when the local tokens are a subset.
    complete_sums: turns local partial per-response sums [M, k] into complete ones (CP all-reduce).
    credit: local l [N] -> C_t [N] computed over the complete responses (CP gather).
    response_table: every response of the minibatch (TETPO / GEPO group statistics).
    m2_values: Delta^2 of every token of the minibatch (M2PO's global mask).
    token_means: [2] float64 (mean log pi_theta, mean A) over every token of the minibatch (Clip-Cov).
    owns_response: [M] bool, the one rank that counts a response's sequence value and metrics.
    """

    num_tokens: Optional[float] = None
    num_responses: Optional[float] = None
    response_lengths: Optional[Tensor] = None
    complete_sums: Optional[Callable[[Tensor], Tensor]] = None
    credit: Optional[Callable[[Tensor], Tensor]] = None
    response_table: Optional[ResponseTable] = None
    m2_values: Optional[Tensor] = None
    token_means: Optional[Tensor] = None
    owns_response: Optional[Tensor] = None

    @property
    def is_local(self) -> bool:
        return self.response_lengths is None and self.complete_sums is None
