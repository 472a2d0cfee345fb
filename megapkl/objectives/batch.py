"""`TokenBatch`: one packed batch of action tokens, and `LossOutput` (docs/spec.md section 8)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass
class TokenBatch:
    """Action tokens of M responses, packed in response order (docs/spec.md section 8).

    Tokens of a response are contiguous, responses appear in increasing `response_index`, and
    `positions` run 1..T_m within each response. Per-token tensors are [N]; SIS fields are [N, K].
    `logp` is the differentiable learner log-prob; every other tensor is treated as a constant.
    """

    logp: Tensor
    logp_behav: Tensor
    advantages: Tensor
    response_index: Tensor
    group_index: Tensor
    positions: Tensor
    logp_prox: Optional[Tensor] = None
    logp_init: Optional[Tensor] = None
    token_ids: Optional[Tensor] = None
    topk_ids: Optional[Tensor] = None
    topk_logp_behav: Optional[Tensor] = None
    topk_logp: Optional[Tensor] = None
    response_uid: Optional[Tensor] = None
    step: int = 0
    entropy: Optional[Tensor] = None  # [N] differentiable full-vocabulary entropy, for entropy_coef

    @property
    def num_tokens(self) -> int:
        return int(self.logp.shape[0])

    @property
    def num_responses(self) -> int:
        return int(self.group_index.shape[0])

    @property
    def uids(self) -> Tensor:
        if self.response_uid is not None:
            return self.response_uid.to(torch.int64)
        return torch.arange(self.num_responses, dtype=torch.int64, device=self.logp.device)

    @property
    def prox(self) -> Tensor:
        """logp_prox, defaulting to logp_behav (coupled proximal reference)."""
        return self.logp_behav if self.logp_prox is None else self.logp_prox

    def lengths(self) -> Tensor:
        """T_m [M] int64 from the packed response_index (searchsorted: responses are in order)."""
        bounds = torch.searchsorted(self.response_index,
                                    torch.arange(self.num_responses + 1, device=self.response_index.device))
        return bounds.diff()

    def validate(self, need_sis: bool = False, need_init: bool = False,
                 full_lengths: Optional[Tensor] = None, need_entropy: bool = False) -> None:
        """Shape and layout checks; raises ValueError naming the offending field.

        Without `full_lengths` the batch must hold whole responses (positions 1..T_m). With it (a
        context-parallel shard) a response may hold any increasing subset of positions 1..T_m.
        """
        n, m = self.num_tokens, self.num_responses
        for name in ("logp", "logp_behav", "advantages", "response_index", "positions",
                     "logp_prox", "logp_init", "token_ids", "entropy"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"TokenBatch.{name}: expected shape [{n}], got {list(t.shape)}")
        if self.group_index.dim() != 1:
            raise ValueError(f"TokenBatch.group_index: expected shape [M], got {list(self.group_index.shape)}")
        if self.response_uid is not None and tuple(self.response_uid.shape) != (m,):
            raise ValueError(f"TokenBatch.response_uid: expected shape [{m}], got {list(self.response_uid.shape)}")
        if n == 0:
            raise ValueError("TokenBatch: no action tokens")
        if full_lengths is not None:
            self._validate_shard(full_lengths)
        else:
            self._validate_whole()
        if need_entropy and self.entropy is None:
            raise ValueError("TokenBatch.entropy: required when entropy_coef != 0")
        if need_init and self.logp_init is None:
            raise ValueError("TokenBatch.logp_init: required when kl_init_coef > 0")
        if need_sis:
            for name in ("token_ids", "topk_ids", "topk_logp_behav", "topk_logp"):
                if getattr(self, name) is None:
                    raise ValueError(f"TokenBatch.{name}: required when sis.enabled")
            k = self.topk_ids.shape[-1]
            for name in ("topk_ids", "topk_logp_behav", "topk_logp"):
                if tuple(getattr(self, name).shape) != (n, k):
                    raise ValueError(f"TokenBatch.{name}: expected shape [{n}, {k}], "
                                     f"got {list(getattr(self, name).shape)}")

    def _validate_whole(self) -> None:
        """Layout of whole responses: 0..M-1 in order, each with positions 1..T_m."""
        ridx, n, m = self.response_index, self.num_tokens, self.num_responses
        lo, hi = torch.aminmax(ridx.diff()) if n > 1 else (0, 0)
        if int(ridx[0]) != 0 or int(ridx[-1]) != m - 1 or int(lo) < 0 or int(hi) > 1:
            raise ValueError("TokenBatch.response_index: tokens must be packed in response order, "
                             "responses 0..M-1 each with at least one token")
        lengths = self.lengths()
        starts = torch.cumsum(lengths, 0) - lengths
        expect = torch.arange(1, n + 1, device=ridx.device) - starts.index_select(0, ridx)
        if not torch.equal(self.positions.to(torch.int64), expect):
            raise ValueError("TokenBatch.positions: must run 1..T_m within each response")

    def _validate_shard(self, full_lengths: Tensor) -> None:
        """Layout of a shard: responses in order, increasing positions within 1..T_m. Checked
        with one host read of a few reductions (a loss call per micro-batch runs it); which
        rule failed is worked out only then."""
        ridx, pos, m = self.response_index, self.positions.to(torch.int64), self.num_responses
        if tuple(full_lengths.shape) != (m,):
            raise ValueError(f"LossContext.response_lengths: expected shape [{m}], got {list(full_lengths.shape)}")
        if m == 0:  # tokens of no response
            raise ValueError("TokenBatch.response_index: must be non-decreasing within 0..M-1")
        # With responses in 0..M-1 and positions in 1..2^32-1, (response, position) pairs
        # strictly increase in token order exactly when responses never decrease and positions
        # increase within one.
        top = full_lengths.index_select(0, ridx.clamp(0, m - 1))
        key = ridx * 2**32 + pos
        gap = key.diff().min() if key.numel() > 1 else key.new_ones(())
        first, last, gap, low, high, over = torch.stack(
            [ridx.min(), ridx.max(), gap, pos.min(), pos.max(), (pos - top).max()]).tolist()
        if first >= 0 and last < m and gap > 0 and low >= 1 and high < 2**32 and over <= 0:
            return
        self._shard_error(full_lengths)

    def _shard_error(self, full_lengths: Tensor) -> None:
        """The rule `_validate_shard` found broken, as its ValueError."""
        ridx, pos, m = self.response_index, self.positions.to(torch.int64), self.num_responses
        step = ridx.diff()
        bad_order = (step < 0).any() | (ridx.min() < 0) | (ridx.max() >= m)
        top = full_lengths.index_select(0, ridx.clamp(0, m - 1))
        bad_pos = (pos < 1).any() | (pos > top).any() | ((pos.diff() <= 0) & (step == 0)).any()
        order, positions = torch.stack([bad_order, bad_pos]).tolist()
        if order:
            raise ValueError("TokenBatch.response_index: must be non-decreasing within 0..M-1")
        if positions:
            raise ValueError("TokenBatch.positions: must increase within each response and lie in 1..T_m")


@dataclass
class LossOutput:
    """Result of `policy_loss` (docs/spec.md section 8).

    `loss` has the value of the paper's surrogate (negated, aggregated) plus optional terms, and the
    gradient -(coef / Z) w.r.t. `batch.logp` (docs/spec.md section 2). `coef` is detached, [N].
    """

    loss: Tensor
    coef: Tensor
    normalizer: float
    metrics: dict[str, float] = field(default_factory=dict)
    parts: Any = None  # MetricParts: the reducible form of `metrics` (sums, counts, max, min)
