"""Cross-rank reductions of detached statistics for the objectives (docs/spec.md section 7).

The objective math (`megapkl.objectives`) sees only local tokens and asks a `LossContext` for what
spans further. This module fills that context from explicit process groups:

- context parallel (a response's tokens split across the CP group): per-response sums by an
  all-reduce, and the future-KL credit by an all-gather of the per-token costs of the micro-batch,
  after which each rank evaluates the exact window sums of its own tokens;
- data parallel and micro-batches: the minibatch token/response counts (normalizer Z), the table of
  every response's sequence statistics for group objectives (TETPO, GEPO), and every token's M2
  for M2PO's global mask, gathered once before the training pass;
- metrics: sums, counts, maxima and minima all-reduced so that each token and response counts once.

Only detached tensors cross ranks; gradients flow through the local log-probs alone. Tensors made
here for a collective are allocated on the group's device (`group_device`: the GPU under NCCL) and
results come back on the device of the inputs.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megapkl.config.objective import ObjectiveConfig
from megapkl.objectives.context import LossContext, ResponseTable
from megapkl.objectives.credit import future_kl_credit
from megapkl.objectives.metrics import MetricParts
from megapkl.parallel.groups import group_device


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_gather_varlen(t: Tensor, group) -> list[Tensor]:
    """All-gather tensors whose first dimension differs per rank (pads to the longest, then trims)."""
    if _size(group) == 1:
        return [t]
    dev = group_device(group)
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(_size(group))]
    dist.all_gather(sizes, n, group=group)
    counts = [int(s) for s in torch.stack(sizes).cpu()]   # one device sync
    padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=dev)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded, group=group)
    return [o[:c].to(t.device) for o, c in zip(out, counts)]


def all_reduce_sum(t: Tensor, group) -> Tensor:
    """Sum of `t` over `group` (a new tensor on t's device; `t` itself is left unchanged)."""
    if _size(group) > 1:
        r = t.to(group_device(group), copy=True)
        dist.all_reduce(r, op=dist.ReduceOp.SUM, group=group)
        t = r.to(t.device)
    return t


def all_reduce_max(t: Tensor, group) -> Tensor:
    """Elementwise maximum of `t` over `group` (a new tensor on t's device)."""
    if _size(group) > 1:
        r = t.to(group_device(group), copy=True)
        dist.all_reduce(r, op=dist.ReduceOp.MAX, group=group)
        t = r.to(t.device)
    return t


# ----------------------------------------------------------------------------- context parallel

def cp_complete_sums(cp_group) -> Optional[Callable[[Tensor], Tensor]]:
    """Local partial per-response sums [M, k] -> complete sums (every CP rank holds all M responses)."""
    if _size(cp_group) == 1:
        return None
    return lambda partial: all_reduce_sum(partial.to(torch.float64), cp_group).to(partial.dtype)


def cp_credit(cfg: ObjectiveConfig, cp_group, response_index: Tensor, positions: Tensor,
              lengths: Tensor) -> Optional[Callable[[Tensor], Tensor]]:
    """Future-KL credit of the local tokens computed over complete responses.

    All-gathers the local log-ratios l with their (response, position) within the CP group, places
    them at their position in the full packed micro-batch and evaluates eq. 5 there (one float64
    prefix sum), then reads back the local tokens. Exact across chunk boundaries for any H.
    """
    if _size(cp_group) == 1:
        return None
    dev = response_index.device
    lengths = lengths.to(device=dev, dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    local_flat = starts.index_select(0, response_index) + positions.to(torch.int64) - 1
    flats = all_gather_varlen(local_flat, cp_group)
    total = int(lengths.sum())
    full_ridx = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
    full_pos = torch.arange(1, total + 1, device=dev) - starts.index_select(0, full_ridx)

    def credit(l: Tensor) -> Tensor:
        values = all_gather_varlen(l.detach().to(torch.float64), cp_group)
        full = torch.zeros(total, dtype=torch.float64, device=dev)
        for flat, v in zip(flats, values):
            full[flat] = v
        c = future_kl_credit(full, full_ridx, full_pos, lengths, cfg.beta, cfg.horizon,
                             cfg.cost_clip, cfg.tail)
        return c.index_select(0, local_flat).to(l.dtype)

    return credit


def cp_owned(positions: Tensor, response_index: Tensor, num_responses: int) -> Tensor:
    """[M] bool: this rank holds the response's first action token, so it counts the response once."""
    owned = torch.zeros(num_responses, dtype=torch.bool, device=positions.device)
    owned[response_index[positions == 1]] = True
    return owned


# ------------------------------------------------------------- data parallel and micro-batches

def minibatch_counts(num_tokens: int, num_responses: int, dp_group) -> tuple[float, float]:
    """Action tokens and responses of the whole optimizer minibatch (this rank's micro-batches summed
    by the caller; each token/response counted on one DP rank and one CP rank)."""
    t = all_reduce_sum(torch.tensor([float(num_tokens), float(num_responses)], dtype=torch.float64,
                                    device=group_device(dp_group)), dp_group)
    return float(t[0]), float(t[1])


def gather_response_table(tables: Sequence[ResponseTable], dp_group) -> ResponseTable:
    """Concatenate this rank's micro-batch tables and all-gather them over the DP group.

    Each table must hold complete sums (CP-reduced); gather over the pure data-parallel group so a
    response appears once.
    """
    cols = ("uid", "group", "delta_sum", "logp_sum", "behav_sum")
    local = {c: torch.cat([getattr(t, c).detach() for t in tables]) for c in cols}
    packed = torch.stack([local[c].to(torch.float64) for c in cols[2:]], dim=1)
    ids = torch.stack([local["uid"].to(torch.int64), local["group"].to(torch.int64)], dim=1)
    ids_all = torch.cat(all_gather_varlen(ids, dp_group))
    vals_all = torch.cat(all_gather_varlen(packed, dp_group))
    return ResponseTable(uid=ids_all[:, 0], group=ids_all[:, 1], delta_sum=vals_all[:, 0],
                         logp_sum=vals_all[:, 1], behav_sum=vals_all[:, 2])


def gather_token_values(values: Sequence[Tensor], dp_cp_group) -> Tensor:
    """Every token's value (e.g. M2PO's Delta^2) over micro-batches and the DP x CP group."""
    local = torch.cat([v.detach().to(torch.float64) for v in values])
    return torch.cat(all_gather_varlen(local, dp_cp_group))


def reduce_metric_parts(parts: MetricParts, group) -> MetricParts:
    """All-reduce metric parts over `group` (the DP x CP group: each token counted on one rank)."""
    if _size(group) == 1:
        return parts
    out = MetricParts(values=dict(parts.values))
    keys = sorted(parts.sums)
    vec = torch.tensor([parts.sums[k] for k in keys] + [parts.counts[k] for k in keys]
                       + [parts.totals[k] for k in sorted(parts.totals)], dtype=torch.float64,
                       device=group_device(group))
    vec = all_reduce_sum(vec, group)
    n = len(keys)
    vec = vec.cpu()
    out.sums = dict(zip(keys, vec[:n].tolist()))
    out.counts = dict(zip(keys, vec[n:2 * n].tolist()))
    out.totals = dict(zip(sorted(parts.totals), vec[2 * n:].tolist()))
    for src, dst, op in ((parts.maxes, out.maxes, dist.ReduceOp.MAX), (parts.mins, out.mins, dist.ReduceOp.MIN)):
        ks = sorted(src)
        if ks:
            t = torch.tensor([src[k] for k in ks], dtype=torch.float64, device=group_device(group))
            dist.all_reduce(t, op=op, group=group)
            dst.update(zip(ks, t.cpu().tolist()))
    for k in sorted(parts.samples):  # quantile samples: every shard's values, once each
        out.samples[k] = torch.cat(all_gather_varlen(parts.samples[k].to(torch.float64), group))
    return out


def shard_context(cfg: ObjectiveConfig, *, response_index: Tensor, positions: Tensor,
                  response_lengths: Tensor, cp_group, num_tokens: float, num_responses: float,
                  response_table: Optional[ResponseTable] = None,
                  m2_values: Optional[Tensor] = None,
                  token_means: Optional[Tensor] = None) -> LossContext:
    """The `LossContext` of one micro-batch shard on this rank."""
    m = response_lengths.numel()
    cp = _size(cp_group) > 1
    return LossContext(
        num_tokens=num_tokens, num_responses=num_responses,
        response_lengths=response_lengths.to(torch.int64),
        complete_sums=cp_complete_sums(cp_group),
        credit=cp_credit(cfg, cp_group, response_index, positions, response_lengths) if cp and cfg.uses_credit else None,
        response_table=response_table, m2_values=m2_values, token_means=token_means,
        owns_response=cp_owned(positions, response_index, m) if cp else None,
    )


def prepass_statistics(cfg: ObjectiveConfig, batch, ctx: LossContext) -> tuple[ResponseTable, Tensor]:
    """Forward-only pre-pass products of one micro-batch shard: its responses' complete sequence
    sums (a `ResponseTable`) and its tokens' Delta^2 (for M2PO). `batch.logp` is the current
    policy's log-prob under no_grad."""
    from megapkl.objectives.stats import Stats  # local: keeps the module import light

    s = Stats(cfg, batch, ctx)
    table, _ = s.response_table()
    if cfg.name == "clip_cov":  # Clip-Cov: (log pi, A) of every token, for the minibatch means
        return table, torch.stack([s.logp, s.adv], 1).to(torch.float64)
    return table, s.delta.to(torch.float64) ** 2


def needs_prepass(cfg: ObjectiveConfig) -> bool:
    """Objectives whose coefficients depend on other responses' current log-probs."""
    return cfg.name in ("tetpo", "gepo", "m2po", "clip_cov")
