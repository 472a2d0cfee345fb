"""Detached per-token statistics shared by every objective (docs/spec.md sections 1-2), and `Terms`.

`Stats` is built once per loss call; objectives read what they need from it and return `Terms`:
a detached per-token score coefficient (docs/spec.md section 2) and the surrogate value for logging.
Everything that needs more than the local tokens (per-response sums under context parallelism,
future-KL windows, group statistics) goes through `LossContext` (see context.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from megapkl.config.objective import ObjectiveConfig
from megapkl.objectives.batch import TokenBatch
from megapkl.objectives.context import LossContext, ResponseTable
from megapkl.objectives.credit import future_kl_credit
from megapkl.objectives.segments import packed_sum
from megapkl.objectives.sis import SISResult, sis_accept, uniform_draws


def clip_active(x: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """True where min(x A, clip(x, 1-eps_lo, 1+eps_hi) A) has a nonzero gradient (docs/spec.md
    section 4)."""
    return ~(((adv > 0) & (x > 1 + eps_high)) | ((adv < 0) & (x < 1 - eps_low)))


@dataclass
class Terms:
    """What an objective contributes before aggregation.

    coef: [N] detached score coefficient (gradient factor of logp_t before the aggregation weight).
    value: surrogate value to maximize, per token [N] or, when sequence_level, per response [M].
    clipped: [N] bool where a clip gate or IS clip is active (for `clip/frac`), or None.
    metrics: objective-specific metrics already global (e.g. TETPO group statistics).
    token_metrics: objective-specific per-token tensors reported as token means.
    """

    coef: Tensor
    value: Tensor
    sequence_level: bool = False
    clipped: Optional[Tensor] = None
    metrics: dict[str, Tensor] = field(default_factory=dict)
    token_metrics: dict[str, Tensor] = field(default_factory=dict)


class Stats:
    """Detached quantities of docs/spec.md section 1 for one batch, computed once."""

    def __init__(self, cfg: ObjectiveConfig, batch: TokenBatch, ctx: LossContext) -> None:
        self.cfg, self.batch, self.ctx = cfg, batch, ctx
        self.logp = batch.logp.detach()
        self.dtype = self.logp.dtype
        self.num_tokens, self.num_responses = batch.num_tokens, batch.num_responses
        self.ridx = batch.response_index
        self.logp_behav = batch.logp_behav.detach()
        self.logp_prox = batch.prox.detach()
        self.delta = self.logp - self.logp_behav           # log w_t
        self.w = torch.exp(self.delta)
        self.l = self.logp - self.logp_prox                # log rho_t
        self.adv = batch.advantages.detach().to(self.dtype)
        self.local_lengths = batch.lengths()               # local tokens per response [M]
        full = ctx.response_lengths
        self.lengths_int = self.local_lengths if full is None else full.to(torch.int64)
        self.lengths = self.lengths_int.to(self.dtype)     # T_m
        self.owned = ctx.owns_response if ctx.owns_response is not None else self.local_lengths > 0
        starts = (torch.cumsum(self.local_lengths, 0) - self.local_lengths).clamp(max=self.num_tokens - 1)
        # A_m; a response with no local tokens is never owned, so its placeholder value is unused.
        self.adv_seq = self.adv.index_select(0, starts)
        self.sis: Optional[SISResult] = self._sis() if cfg.sis.enabled else None
        self._credit: Optional[Tensor] = None

    def _sis(self) -> SISResult:
        b = self.batch
        u = uniform_draws(self.cfg.seed, b.step, self.tok(b.uids), b.positions)
        return sis_accept(self.w, b.token_ids, b.topk_ids, b.topk_logp.detach(),
                          b.topk_logp_behav.detach(), u)

    @property
    def accepted(self) -> Optional[Tensor]:
        return None if self.sis is None else self.sis.accepted

    def seq_sum(self, x: Tensor) -> Tensor:
        """Per-response sum [M] of a per-token tensor over the complete response."""
        partial = packed_sum(x, self.local_lengths)
        if self.ctx.complete_sums is None:
            return partial
        return self.ctx.complete_sums(partial.unsqueeze(-1)).squeeze(-1)

    def tok(self, x_seq: Tensor) -> Tensor:
        """Broadcast a per-response tensor to its tokens."""
        return x_seq.index_select(0, self.ridx)

    @property
    def credit(self) -> Tensor:
        """Future-KL credit C_t (eq. 5) over complete responses, computed on first use."""
        if self._credit is None:
            c = self.cfg
            if self.ctx.credit is not None:
                self._credit = self.ctx.credit(self.l)
            else:
                self._credit = future_kl_credit(self.l, self.ridx, self.batch.positions,
                                                self.lengths_int, c.beta, c.horizon, c.cost_clip, c.tail)
        return self._credit

    def response_table(self) -> tuple[ResponseTable, Tensor]:
        """Every response of the minibatch and the table row of each local response."""
        table = self.ctx.response_table
        if table is None:
            table = ResponseTable(uid=self.batch.uids, group=self.batch.group_index,
                                  delta_sum=self.seq_sum(self.delta), logp_sum=self.seq_sum(self.logp),
                                  behav_sum=self.seq_sum(self.logp_behav))
            return table, torch.arange(self.num_responses, device=self.logp.device)
        return table, table.rows(self.batch.uids)

    def sis_weight(self, x: Tensor) -> Tensor:
        """x with SIS-accepted tokens set to weight 1 (SIS eq. 10); x itself without SIS."""
        return x if self.sis is None else torch.where(self.sis.accepted, torch.ones_like(x), x)

    def sis_override(self, accepted_value: Tensor, other: Tensor) -> Tensor:
        """Accepted tokens take `accepted_value` (no correction, no gate), others keep `other`."""
        return other if self.sis is None else torch.where(self.sis.accepted, accepted_value, other)
