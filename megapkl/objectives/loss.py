"""`policy_loss`: single-process reference semantics of every objective (SPEC sections 2, 5, 6, 8, 9).

loss = -(1/Z) sum_t coef_t logp_t in gradient, with the value of the paper's negated surrogate:
objectives give detached coefficients and surrogate values (`Terms`), the aggregation supplies the
per-token weight a_t and the normalizer Z, and optional KL-to-init / entropy terms are added.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megapkl.config.objective import ObjectiveConfig
from megapkl.objectives.batch import LossOutput, TokenBatch
from megapkl.objectives.metrics import collect_metrics
from megapkl.objectives.registry import get_objective
from megapkl.objectives.stats import Stats


def aggregation(cfg: ObjectiveConfig, s: Stats) -> tuple[Tensor | None, float]:
    """Per-token weight a_t (None = 1) and normalizer Z of SPEC section 5."""
    agg = cfg.aggregation
    if agg == "token_mean":
        return None, float(s.num_tokens)
    if agg == "seq_mean_token_mean":
        return s.tok(1.0 / s.lengths), float(s.num_responses)
    if agg == "seq_mean":
        return None, float(s.num_responses)
    if agg == "token_sum_norm":
        return None, float(cfg.norm_constant)
    raise ValueError(f"objective.aggregation: unknown {agg!r}")


def _weighted(x: Tensor, a: Tensor | None) -> Tensor:
    return x if a is None else x * a


def k3(log_ref: Tensor, logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || ref) per token: exp(ref - logp) - (ref - logp) - 1."""
    d = log_ref - logp
    return torch.exp(d) - d - 1


def policy_loss(cfg: ObjectiveConfig, batch: TokenBatch, validate: bool = True) -> LossOutput:
    """Loss, detached coefficients and metrics of `cfg.name` on `batch` (SPEC section 8)."""
    if cfg.aggregation is None or cfg.eps_clip_low is None:
        cfg = cfg.resolve()
    if validate:
        batch.validate(need_sis=cfg.sis.enabled, need_init=cfg.kl_init_coef > 0)
    s = Stats(cfg, batch)
    terms = get_objective(cfg.name)(s)
    a, z = aggregation(cfg, s)
    coef = _weighted(terms.coef, a)
    if terms.sequence_level:
        value = -terms.value.sum() / z
    else:
        value = -_weighted(terms.value, a).sum() / z
    if cfg.kl_init_coef > 0:
        init = batch.logp_init.detach()
        value = value + cfg.kl_init_coef * _weighted(k3(init, s.logp), a).sum() / z
        # d k3 / d logp = 1 - exp(init - logp): folded into the score coefficient (SPEC section 6).
        coef = coef - cfg.kl_init_coef * _weighted(1 - torch.exp(init - s.logp), a)
    coef = coef.detach()
    score = -(coef * batch.logp).sum() / z
    loss = score + (value.detach() - score.detach())
    if cfg.entropy_coef != 0 and batch.entropy is not None:
        loss = loss - cfg.entropy_coef * _weighted(batch.entropy, a).sum() / z
    metrics = collect_metrics(s, terms, coef, loss.detach())
    return LossOutput(loss=loss, coef=coef, normalizer=z, metrics=metrics)
