"""The policy loss as a megatron-core `forward_step` for `get_forward_backward_func()` schedules.

Per-token-loss semantics (`calculate_per_token_loss=True` in the model config) and why the
gradient equals the single-process `policy_loss` on the whole optimizer minibatch:

megatron-core 0.16.1 does, for a 3-tuple `(output, num_tokens, report)` from our loss function:
1. `forward_step_calc_loss`: with calculate_per_token_loss it does NOT divide `output` by
   num_tokens or by the number of micro-batches; it sums the returned `num_tokens` over the
   micro-batches of this rank (`total_num_tokens`).
2. `backward_step`: backpropagates `output` (times `grad_scale_func`, the optimizer's loss scale,
   which the optimizer divides out again), so each micro-batch's parameter gradients accumulate.
3. `finalize_model_grads(model, total_num_tokens)`: DDP all-reduces gradients over the DP x CP
   group as a plain SUM (with calculate_per_token_loss DDP uses gradient_scaling_factor = 1);
   `total_num_tokens` is broadcast from the last pipeline stage over the PP group, SUMmed over
   the DP x CP group, and every gradient is multiplied by 1 / that sum.

So the final gradient is (sum over DP x CP ranks and micro-batches of d output) / N, with N the
sum of the returned `num_tokens` over the same set. We return num_tokens = the shard's local
action-token count (each token is held by one CP rank of one DP rank in one micro-batch: N is the
minibatch's action-token count, `MinibatchStats.num_tokens`, computed before the schedule) and
output = N * loss_shard, where loss_shard is this shard's part of the global loss: `policy_loss`
with a `LossContext` carrying the global normalizer, complete per-response sums and group
statistics, so that sum over shards of loss_shard = the single-process loss. Then the gradient is
sum_shards d loss_shard = d loss. Tensor-parallel ranks hold identical loss_shard values (the
vocab-parallel log-probs are complete on every TP rank), as megatron's own vocab-parallel
cross-entropy does; the TP layers' backward handles the rest. Context-parallel ranks each hold
their own tokens' part, and the CP attention's backward carries every rank's key/value gradients
to the rank that owns them. The pipeline stages only relay activations.

Any aggregation works (token_mean, seq_mean, ...): the factor N is what megatron divides by, not
the objective's normalizer Z. MoE auxiliary losses are left to megatron: we neither return nor
rescale them (with calculate_per_token_loss megatron scales them by 1 and divides by N too).

Pre-pass (`run_prepass`): TETPO / GEPO group statistics, M2PO's global mask and Clip-Cov's
minibatch means depend on other responses' current log-probs; a forward-only schedule over all
micro-batches gathers every response's complete sums and every token's Delta^2 (M2PO) or
(log pi, A) (Clip-Cov), then the training pass uses them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from megapkl.config.objective import ObjectiveConfig
from megapkl.objectives.context import LossContext, ResponseTable
from megapkl.objectives.metrics import MetricParts
from megapkl.parallel import reductions as R
from megapkl.parallel.batching import (MicroBatch, action_labels, action_rows, action_topk_ids,
                                       action_values, response_lengths, thd_packed_seq_params,
                                       token_batch)
from megapkl.parallel.groups import ParallelGroups
from megapkl.parallel.shard_loss import shard_policy_loss, shard_prepass
from megapkl.parallel.vocab import token_logprobs_entropy_topk


@dataclass
class MinibatchStats:
    """Detached statistics of the whole optimizer minibatch that every shard's loss needs."""

    num_tokens: float                         # action tokens, all DP x CP ranks and micro-batches
    num_responses: float
    response_table: Optional[ResponseTable] = None   # TETPO / GEPO (pre-pass)
    m2_values: Optional[Tensor] = None               # M2PO (pre-pass)
    token_means: Optional[Tensor] = None             # Clip-Cov (pre-pass)


@dataclass
class PolicyLossSpec:
    """What the loss function of one optimizer step needs besides the micro-batch."""

    cfg: ObjectiveConfig
    groups: ParallelGroups
    stats: MinibatchStats
    temperature: float = 1.0
    step: int = 0                              # optimizer step (SIS draws)
    chunk_tokens: Optional[int] = None         # vocab-parallel chunking (None: automatic)
    record: Optional[str] = None               # micro-batch field for the pass's detached log-probs


@dataclass
class ShardReport:
    """What one micro-batch shard's loss reports (megatron's `loss_reduced` slot)."""

    loss: Tensor                               # this shard's part of the global loss (detached)
    num_tokens: int
    parts: MetricParts = field(default_factory=MetricParts)
    coef: Optional[Tensor] = None              # [N] per-token coefficients, local tokens
    uid: Optional[Tensor] = None               # [N] response uid of each local token
    positions: Optional[Tensor] = None         # [N] 1-based action positions


# ----------------------------------------------------------------------------- statistics

def count_minibatch(micro_batches: Sequence[MicroBatch], groups: ParallelGroups) -> MinibatchStats:
    """Action tokens and responses of the optimizer minibatch, from this rank's CP-sharded
    micro-batches (each token counted by the CP rank holding it, each response by CP rank 0)."""
    tokens = sum(mb.num_action_tokens for mb in micro_batches)
    responses = sum(mb.num_responses for mb in micro_batches) if groups.cp_rank == 0 else 0
    n_tok, n_resp = R.minibatch_counts(tokens, responses, groups.dp_cp)
    return MinibatchStats(num_tokens=n_tok, num_responses=n_resp)


def prepass_required(cfg: ObjectiveConfig, groups: ParallelGroups, num_micro: int) -> bool:
    """Group/global statistics are needed, and the minibatch is split across shards."""
    return R.needs_prepass(cfg) and (groups.dp_cp_size > 1 or num_micro > 1)


# ----------------------------------------------------------------------------- per-shard pieces

def action_logprobs(mb: MicroBatch, logits: Tensor, groups: ParallelGroups, temperature: float,
                    *, need_entropy: bool = False, need_topk: bool = False,
                    chunk_tokens: Optional[int] = None):
    """Vocab-parallel log-prob (and entropy, top-K log-probs) of the local action tokens.

    logits [b, s_local, V / tp] (GPTModel's output). Only the action rows are passed on, so
    prompt and padding positions cost nothing beyond the model itself.
    """
    rows = action_values(mb, logits)
    return token_logprobs_entropy_topk(
        rows, action_labels(mb), groups.tp, temperature,
        topk_ids=action_topk_ids(mb) if need_topk else None, need_entropy=need_entropy,
        chunk_tokens=chunk_tokens)


def shard_context(spec: PolicyLossSpec, mb: MicroBatch, batch) -> LossContext:
    s = spec.stats
    return R.shard_context(spec.cfg, response_index=batch.response_index, positions=batch.positions,
                           response_lengths=response_lengths(mb), cp_group=spec.groups.cp,
                           num_tokens=s.num_tokens, num_responses=s.num_responses,
                           response_table=s.response_table, m2_values=s.m2_values,
                           token_means=s.token_means)


def policy_loss_func(spec: PolicyLossSpec, mb: MicroBatch, logits: Tensor):
    """megatron loss function: (N * loss_shard, local token count, ShardReport). See module doc."""
    cfg = spec.cfg
    lp = action_logprobs(mb, logits, spec.groups, spec.temperature,
                         need_entropy=cfg.entropy_coef != 0, need_topk=cfg.needs_topk,
                         chunk_tokens=spec.chunk_tokens)
    if spec.record:  # the live weights' log-probs, as fill_logprobs writes them, without a pass
        write_field(mb, spec.record, lp.logp.detach())
    batch = token_batch(mb, lp.logp, topk_logp=lp.topk_logp, entropy=lp.entropy, step=spec.step)
    out = shard_policy_loss(cfg, batch, shard_context(spec, mb, batch))
    n = batch.num_tokens
    report = ShardReport(loss=out.loss.detach(), num_tokens=n, parts=out.parts, coef=out.coef,
                         uid=mb.uid.index_select(0, batch.response_index), positions=batch.positions)
    return out.loss * spec.stats.num_tokens, _count(n, logits), report


def _count(n: int, like: Tensor) -> Tensor:
    """A token count for megatron's accumulator (an int tensor on the logits' device)."""
    return torch.tensor(n, dtype=torch.int, device=like.device)


def _forward(model, mb: MicroBatch, groups: Optional[ParallelGroups] = None) -> Tensor:
    # One response per row starting at position 0: RoPE positions come from the sequence itself
    # (megatron slices them per CP rank), causal masking from the attention module.
    # A THD-packed row (pack_thd) also passes megatron's PackedSeqParams: RoPE restarts per
    # packed sequence and the (CP-capable) core attention is block-diagonal causal.
    kwargs = {}
    if mb.is_thd:
        kwargs["packed_seq_params"] = thd_packed_seq_params(mb, groups.cp if groups is not None else None)
    if mb.routed is None:
        return model(mb.tokens, mb.position_ids, attention_mask=None, **kwargs)
    from megapkl.parallel.replay import replaying  # R3: the rollout's experts, this micro-batch

    with replaying(model, mb.routed, groups=groups):
        return model(mb.tokens, mb.position_ids, attention_mask=None, **kwargs)


def make_forward_step(loss_func: Callable, groups: Optional[ParallelGroups] = None) -> Callable:
    """forward_step(data_iterator, model) for megatron schedules; `loss_func(mb, output)`.
    `groups` locates this rank's slice of a micro-batch's replayed MoE routing (R3)."""
    def forward_step(data_iterator: Iterator[MicroBatch], model):
        mb = next(data_iterator)
        return _forward(model, mb, groups), functools.partial(loss_func, mb)
    return forward_step


# ----------------------------------------------------------------------------- schedules

def run_schedule(model, micro_batches: Sequence[MicroBatch], forward_step: Callable,
                 forward_only: bool, groups: ParallelGroups) -> list:
    """megatron's forward-backward schedule over `micro_batches` (CP shards of this rank), with
    the explicit process groups of `groups` (its `pg_collection`; pipeline size from it too)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp, pgc = groups.pp_size, groups.pg_collection
    kwargs = {} if pgc is None else {"pg_collection": pgc}
    shapes = {(mb.tokens.shape[0], mb.seq_length) for mb in micro_batches}
    if len(shapes) > 1 and pp > 1:
        raise ValueError(f"pipeline parallelism needs one [b, S] for every micro-batch, got {shapes}"
                         " (make_micro_batches(..., same_shape=True))")
    b, s = max(shapes)
    models = model if isinstance(model, list) else [model]
    vp = len(models) if len(models) > 1 else None
    if pgc is not None and pp > 1:   # pipeline schedules take the p2p channel with the groups
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.utils import get_model_config

        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pgc.pp,
                                                     config=get_model_config(models[0]))
    return get_forward_backward_func(pp_size=pp, vp_size=vp)(
        forward_step_func=forward_step, data_iterator=iter(micro_batches),
        model=models, num_microbatches=len(micro_batches),
        seq_length=s, micro_batch_size=b, forward_only=forward_only, **kwargs)



def forward_backward(spec: PolicyLossSpec, model, micro_batches: Sequence[MicroBatch]) -> list[ShardReport]:
    """One training pass: the schedule with our loss; gradients land in the DDP buffers and are
    finalized (reduced and divided by N) by the config's `finalize_model_grads_func`.

    Returns this rank's per-micro-batch reports (empty on non-last pipeline stages).
    """
    _check_per_token_config(model)
    return run_schedule(model, micro_batches,
                        make_forward_step(functools.partial(policy_loss_func, spec), spec.groups),
                        forward_only=False, groups=spec.groups)


def _check_per_token_config(model) -> None:
    from megatron.core.utils import get_model_config

    cfg = get_model_config(model[0] if isinstance(model, list) else model)
    if not cfg.calculate_per_token_loss:
        raise ValueError("policy loss needs calculate_per_token_loss=True in the model config: "
                         "without it megatron divides each micro-batch loss by its own token count "
                         "and the number of micro-batches, which is not the objective's normalizer")


def run_prepass(cfg: ObjectiveConfig, groups: ParallelGroups, model,
                micro_batches: Sequence[MicroBatch], stats: MinibatchStats,
                temperature: float = 1.0, step: int = 0) -> MinibatchStats:
    """Forward-only pass (no grad) filling `stats.response_table` / `m2_values` when needed.

    On the last pipeline stage the table holds every response of the minibatch (complete CP
    sums, gathered over the DP group) and m2_values every token's Delta^2 (DP x CP group).
    Other stages get `stats` back unchanged: they compute no loss.
    """
    spec = PolicyLossSpec(cfg=cfg, groups=groups, stats=stats, temperature=temperature, step=step)

    def loss_func(mb: MicroBatch, logits: Tensor):
        lp = action_logprobs(mb, logits, groups, temperature, need_topk=cfg.needs_topk)
        batch = token_batch(mb, lp.logp, topk_logp=lp.topk_logp, step=step)
        ctx = shard_context(spec, mb, batch)
        ctx.response_table, ctx.m2_values, ctx.token_means = None, None, None
        table, m2 = shard_prepass(cfg, batch, ctx)
        return logits.new_zeros(()), _count(0, logits), (table, m2)

    with torch.no_grad():
        store = run_schedule(model, micro_batches, make_forward_step(loss_func, groups),
                             forward_only=True, groups=groups)
    if not store:
        return stats
    return gather_prepass(cfg, groups, store, stats)


def gather_prepass(cfg: ObjectiveConfig, groups: ParallelGroups,
                   products: Sequence[tuple[ResponseTable, Tensor]], stats: MinibatchStats) -> MinibatchStats:
    """Combine this rank's per-micro-batch pre-pass products into minibatch statistics; only
    what the objective reads crosses ranks (the table for TETPO/GEPO, Delta^2 for M2PO)."""
    table = m2 = means = None
    if cfg.name in ("tetpo", "gepo"):
        table = R.gather_response_table([t for t, _ in products], groups.dp)
    if cfg.name == "m2po":
        m2 = R.gather_token_values([m for _, m in products], groups.dp_cp)
    if cfg.name == "clip_cov":
        means = R.gather_token_values([m for _, m in products], groups.dp_cp).mean(0)
    return MinibatchStats(num_tokens=stats.num_tokens, num_responses=stats.num_responses,
                          response_table=table, m2_values=m2, token_means=means)


def forward_logprobs(groups: ParallelGroups, model, micro_batches: Sequence[MicroBatch],
                     temperature: float = 1.0) -> dict[int, Tensor]:
    """Log-probs of every action token under `model` (no grad), e.g. to recompute the proximal or
    behavior log-probs: {uid: [T_m]} for the responses of this rank's micro-batches, complete
    (gathered over the CP group) on the last pipeline stage, {} elsewhere."""
    def loss_func(mb: MicroBatch, logits: Tensor):
        lp = action_logprobs(mb, logits, groups, temperature).logp
        rows = action_rows(mb)
        keyed = torch.stack([mb.uid.index_select(0, rows).to(torch.float64),
                             mb.action_pos[mb.loss_mask].to(torch.float64), lp.to(torch.float64)], 1)
        return logits.new_zeros(()), _count(0, logits), keyed

    with torch.no_grad():
        store = run_schedule(model, micro_batches, make_forward_step(loss_func, groups),
                             forward_only=True, groups=groups)
    if not store:
        return {}
    rows = torch.cat(R.all_gather_varlen(torch.cat(store), groups.cp))
    out = {}
    for uid in rows[:, 0].unique().tolist():
        mine = rows[rows[:, 0] == uid]
        mine = mine[torch.argsort(mine[:, 1])]
        out[int(uid)] = mine[:, 2].to(device="cpu", dtype=torch.float32)
    return out


def write_field(mb: MicroBatch, name: str, logp: Tensor) -> None:
    """The local action tokens' log-probs `logp` into the micro-batch's per-token field `name`."""
    buf = mb.fields.get(name)
    if buf is None:
        buf = mb.fields[name] = torch.zeros(mb.loss_mask.shape, dtype=torch.float32,
                                            device=logp.device)
    buf[mb.loss_mask] = logp.to(buf.dtype)


def fill_logprobs(groups: ParallelGroups, model, micro_batches: Sequence[MicroBatch], name: str,
                  temperature: float = 1.0) -> None:
    """Log-probs of every local action token under `model` (no grad) written into each
    micro-batch's per-token field `name` (e.g. "logp_prox"), in place: the proximal / initial
    log-probs for the same shards the training pass then uses. Only the last pipeline stage
    computes (and needs) them."""
    def loss_func(mb: MicroBatch, logits: Tensor):
        write_field(mb, name, action_logprobs(mb, logits, groups, temperature).logp)
        return logits.new_zeros(()), _count(0, logits), None

    with torch.no_grad():
        run_schedule(model, micro_batches, make_forward_step(loss_func, groups), forward_only=True,
                     groups=groups)


# ----------------------------------------------------------------------------- reports

def reduce_reports(reports: Sequence[ShardReport], groups: ParallelGroups) -> dict[str, float]:
    """Metrics of the whole minibatch (micro-batches merged, all-reduced over DP x CP); call on
    the last pipeline stage. 'loss' is the global loss value."""
    parts = MetricParts()
    for r in reports:
        parts = parts.merge(r.parts)
    return R.reduce_metric_parts(parts, groups.dp_cp).finalize()


def verify_token_count(reports: Sequence[ShardReport], stats: MinibatchStats,
                       groups: ParallelGroups) -> None:
    """Raise if megatron's divisor (sum of returned token counts) differs from stats.num_tokens,
    which would scale every gradient wrongly; cheap (one all-reduce), for tests and debugging."""
    n = R.all_reduce_sum(torch.tensor([float(sum(r.num_tokens for r in reports))], dtype=torch.float64,
                                      device=groups.device), groups.dp_cp)
    if float(n) != stats.num_tokens:
        raise AssertionError(f"megatron divides by {float(n)} tokens, the loss assumed {stats.num_tokens}")

