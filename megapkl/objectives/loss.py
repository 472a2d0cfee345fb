"""`policy_loss`: every objective's loss, coefficients and metrics (docs/spec.md sections 2, 5, 6,
8, 9).

loss = -(1/Z) sum_t coef_t logp_t in gradient, with the value of the paper's negated surrogate:
objectives give detached coefficients and surrogate values (`Terms`), the aggregation supplies the
per-token weight a_t and the normalizer Z, and optional KL-to-init / entropy terms are added.
Without a `LossContext` this is the single-process reference; with one (filled by
`megapkl.parallel`) the same code computes a shard's part of the global loss.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megapkl.config.objective import ObjectiveConfig
from megapkl.objectives.batch import LossOutput, TokenBatch
from megapkl.objectives.context import LossContext
from megapkl.objectives.metrics import collect_metrics
from megapkl.objectives.registry import get_objective
from megapkl.objectives.stats import Stats


def aggregation(cfg: ObjectiveConfig, s: Stats) -> tuple[Optional[Tensor], float]:
    """Per-token weight a_t (None = 1) and normalizer Z of docs/spec.md section 5."""
    agg, ctx = cfg.aggregation, s.ctx
    n_tok = float(s.num_tokens) if ctx.num_tokens is None else float(ctx.num_tokens)
    n_resp = float(s.num_responses) if ctx.num_responses is None else float(ctx.num_responses)
    if agg == "token_mean":
        return None, n_tok
    if agg == "seq_mean_token_mean":
        return s.tok(1.0 / s.lengths), n_resp
    if agg == "seq_mean":
        return None, n_resp
    if agg == "token_sum_norm":
        return None, float(cfg.norm_constant)
    raise ValueError(f"objective.aggregation: unknown {agg!r}")


def _weighted(x: Tensor, a: Optional[Tensor]) -> Tensor:
    return x if a is None else x * a


def k3(log_ref: Tensor, logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || ref) per token: exp(ref - logp) - (ref - logp) - 1."""
    d = log_ref - logp
    return torch.exp(d) - d - 1


def policy_loss(cfg: ObjectiveConfig, batch: TokenBatch, ctx: Optional[LossContext] = None,
                validate: bool = True) -> LossOutput:
    """Loss, detached coefficients and metrics of `cfg.name` on `batch` (docs/spec.md section 8)."""
    if cfg.aggregation is None or cfg.eps_clip_low is None:
        cfg = cfg.resolve()
    ctx = ctx or LossContext()
    if validate:
        batch.validate(need_sis=cfg.needs_topk, need_init=cfg.kl_init_coef > 0,
                       full_lengths=ctx.response_lengths, need_entropy=cfg.entropy_coef != 0)
    s = Stats(cfg, batch, ctx)
    terms = get_objective(cfg.name)(s)
    a, z = aggregation(cfg, s)
    coef = _weighted(terms.coef, a)
    if terms.sequence_level:
        value = -terms.value[s.owned].sum() / z
    else:
        value = -_weighted(terms.value, a).sum() / z
    if cfg.kl_init_coef > 0:
        init = batch.logp_init.detach()
        value = value + cfg.kl_init_coef * _weighted(k3(init, s.logp), a).sum() / z
        # d k3 / d logp = 1 - exp(init - logp): folded into the score coefficient (docs/spec.md
        # section 6).
        coef = coef - cfg.kl_init_coef * _weighted(1 - torch.exp(init - s.logp), a)
    coef = coef.detach()
    score = -(coef * batch.logp).sum() / z
    loss = score + (value.detach() - score.detach())
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * _weighted(batch.entropy, a).sum() / z
    parts = collect_metrics(s, terms, coef, loss.detach())
    return LossOutput(loss=loss, coef=coef, normalizer=z, metrics=parts.finalize(), parts=parts)
