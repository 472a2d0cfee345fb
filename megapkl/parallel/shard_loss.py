"""`policy_loss` and the pre-pass statistics of one shard, including a shard with no action token.

Under context parallelism a CP rank may hold none of a micro-batch's action tokens (a long prompt
and a short response can put every label position in the other ranks' chunks). The objective
library requires at least one token, but this rank must still take part in the CP collectives
that the other ranks of its group make inside `policy_loss` (per-response sums, the future-KL
gather), and in the backward pass through the model (the attention K/V all-gather).

The stand-in: the same call on one zero-valued placeholder token whose collectives contribute
nothing (partial sums of zeros, an empty credit gather), whose loss is multiplied by 0 but stays
attached to the (empty) log-prob graph, and whose metric parts are silenced (zero sums and
counts, -inf/+inf extremes) while keeping the same keys as every other rank, so the metric
all-reduce lines up.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from megapkl.config.objective import ObjectiveConfig
from megapkl.objectives import TokenBatch, policy_loss
from megapkl.objectives.batch import LossOutput
from megapkl.objectives.context import LossContext, ResponseTable
from megapkl.objectives.metrics import MetricParts
from megapkl.parallel.reductions import prepass_statistics


def shard_policy_loss(cfg: ObjectiveConfig, batch: TokenBatch, ctx: LossContext) -> LossOutput:
    """`policy_loss(cfg, batch, ctx)`; with no local token, the silent stand-in (loss 0, no coef)."""
    if batch.num_tokens > 0:
        return policy_loss(cfg, batch, ctx)
    out = policy_loss(cfg, _stand_in_batch(batch), _stand_in_context(ctx, batch.num_responses))
    return LossOutput(loss=out.loss * 0.0, coef=out.coef[:0], normalizer=out.normalizer,
                      metrics={}, parts=silence(out.parts))


def shard_prepass(cfg: ObjectiveConfig, batch: TokenBatch, ctx: LossContext) -> tuple[ResponseTable, Tensor]:
    """`reductions.prepass_statistics` (complete response sums, local Delta^2), stand-in when empty."""
    if batch.num_tokens > 0:
        return prepass_statistics(cfg, batch, ctx)
    table, m2 = prepass_statistics(cfg, _stand_in_batch(batch), _stand_in_context(ctx, batch.num_responses))
    return table, m2[:0]


def silence(parts: MetricParts) -> MetricParts:
    """Same keys, neutral values: contributes nothing when merged or all-reduced."""
    return MetricParts(
        sums={k: 0.0 for k in parts.sums}, counts={k: 0.0 for k in parts.counts},
        maxes={k: -float("inf") for k in parts.maxes}, mins={k: float("inf") for k in parts.mins},
        totals={k: 0.0 for k in parts.totals}, values=dict(parts.values),
        samples={k: v[:0] for k, v in parts.samples.items()})


def _placeholder(t: Optional[Tensor], shape: tuple[int, ...], dtype) -> Optional[Tensor]:
    return None if t is None else torch.zeros(shape, dtype=dtype, device=t.device)


def _stand_in_batch(batch: TokenBatch) -> TokenBatch:
    """One token of response 0 at position 1, every value 0 (w = rho = 1, advantage 0).

    logp is the sum of the (empty) learner log-probs, so the loss stays attached to the model's
    graph and the backward pass (with its collectives) runs on this rank too.
    """
    dtype = batch.logp.dtype
    one = lambda t: None if t is None else t.sum().reshape(1)  # noqa: E731  value 0, keeps grad_fn
    k = None if batch.topk_ids is None else batch.topk_ids.shape[-1]
    idx = torch.zeros(1, dtype=torch.int64, device=batch.logp.device)
    return TokenBatch(
        logp=one(batch.logp), logp_behav=torch.zeros(1, dtype=dtype, device=idx.device),
        advantages=torch.zeros(1, dtype=dtype, device=idx.device), response_index=idx,
        group_index=batch.group_index, positions=idx + 1,
        logp_prox=_placeholder(batch.logp_prox, (1,), dtype),
        logp_init=_placeholder(batch.logp_init, (1,), dtype),
        token_ids=None if batch.token_ids is None else idx - 1,   # id -1: never in a top-K
        topk_ids=None if k is None else torch.zeros(1, k, dtype=torch.int64, device=idx.device),
        topk_logp_behav=_placeholder(batch.topk_logp_behav, (1, k or 0), dtype),
        topk_logp=_placeholder(batch.topk_logp, (1, k or 0), dtype),
        response_uid=batch.response_uid, step=batch.step, entropy=one(batch.entropy))


def _stand_in_context(ctx: LossContext, num_responses: int) -> LossContext:
    """The shard's context with this rank's contributions to every collective set to nothing."""
    return dataclasses.replace(ctx, complete_sums=_silent_sums(ctx.complete_sums),
                               credit=_silent_credit(ctx.credit),
                               owns_response=torch.zeros(num_responses, dtype=torch.bool))


def _silent_sums(sums):
    if sums is None:
        return torch.zeros_like
    return lambda partial: sums(torch.zeros_like(partial))   # all-reduce of zeros


def _silent_credit(credit):
    if credit is None:
        return torch.zeros_like

    def run(l: Tensor) -> Tensor:
        credit(l[:0])  # the gather must still happen (the other CP ranks wait); send no token
        return torch.zeros_like(l)
    return run
