"""Train-inference mismatch: how far the rollout engine's log-probs are from the trainer's at the
same policy version (FP8 rollouts, kernels, KV-cache dtype, MoE routing).

Measured only where the trainer holds the exact version that generated a sample (update 0 after a
refresh, on-policy steps, version-u samples of a stale batch): with delta = log pi_trainer(y_t) -
log mu_behavior(y_t) per action token (y_t drawn from mu),
    mismatch/k3_kl          mean of exp(delta) - 1 - delta, the k3 estimate of KL(mu || pi)
    mismatch/abs_log_ratio_mean, mismatch/abs_log_ratio_max   of |delta|
    mismatch/frac_gt_0.1    fraction of tokens with |delta| > 0.1
    mismatch/tokens         tokens measured (global)
and, for MoE when the engine returned its routing (model.routing_replay), over the positions
whose forward predicts an action token of those responses (the same rows as the log-probs above;
every position P-1 .. P+R-2 of a single-turn response, P prompt and R response tokens):
    mismatch/routing_disagree  fraction of tokens whose SET of top-k experts (order ignored)
                            differs from the trainer's own choice in at least one MoE layer
    mismatch/routing_disagree_layer{l}  the same fraction for MoE layer l alone (0-based)
    mismatch/routing_tokens tokens compared (global)
The trainer's own choice is what its routers pick from their current scores, recorded even while
R3 replays the engine's experts (`megapkl.models.routing_probe`). Routing counts are summed over
every rank that holds distinct tokens (DP, CP, TP under sequence parallelism; layers spread over
PP stages are merged per token first), so the value does not depend on the layout.
`mismatch_parts` / `routing_parts` are the pure per-rank parts (sums and maxima, mergeable over
ranks), and `finalize` turns merged parts into the metrics.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

THRESHOLD = 0.1
_FIELDS = ("tokens", "k3_sum", "abs_sum", "over")


def mismatch_parts(logp_behav: Sequence[Tensor], logp_trainer: Sequence[Tensor]
                   ) -> tuple[Tensor, Tensor]:
    """(sums [4] float64 in _FIELDS order, max |delta| [1]) over responses. Each pair of log-prob
    tensors is one response's [T]."""
    sums = torch.zeros(len(_FIELDS), dtype=torch.float64)
    top = torch.zeros(1, dtype=torch.float64)
    for i, (b, t) in enumerate(zip(logp_behav, logp_trainer, strict=True)):
        if b.shape != t.shape:
            raise ValueError(f"response {i}: behavior log-probs {list(b.shape)} vs trainer "
                             f"{list(t.shape)}")
        d = t.detach().double() - b.detach().double()
        a = d.abs()
        sums[0] += d.numel()
        sums[1] += (torch.expm1(d) - d).sum()
        sums[2] += a.sum()
        sums[3] += (a > THRESHOLD).sum()
        if a.numel():
            top[0] = torch.maximum(top[0], a.max())
    return sums, top


def layer_differs(engine: Sequence[Tensor], own: Sequence[Tensor]) -> Tensor:
    """[rows, layers] bool: per layer, the set of top-k experts differs (order ignored). `engine`
    and `own` hold one [rows, k] tensor per layer."""
    cols = []
    for i, (e, o) in enumerate(zip(engine, own, strict=True)):
        if e.shape != o.shape:
            raise ValueError(f"MoE layer {i}: engine routing {list(e.shape)} vs trainer "
                             f"{list(o.shape)}")
        cols.append((e.sort(dim=-1).values != o.sort(dim=-1).values).any(dim=-1))
    return torch.stack(cols, dim=1) if cols else torch.zeros(0, 0, dtype=torch.bool)


def token_layer_differs(e_b: Tensor, e_t: Tensor) -> Tensor:
    """[rows, layers] bool for per-token [rows, layers, k] routings (`layer_differs`)."""
    if e_b.shape != e_t.shape:
        raise ValueError(f"routed experts {list(e_b.shape)} vs {list(e_t.shape)}")
    return layer_differs(e_b.unbind(1), e_t.unbind(1))


def routing_differs(e_b: Tensor, e_t: Tensor) -> Tensor:
    """[rows] bool for per-token [rows, layers, k] routings: the expert set differs in a layer."""
    return token_layer_differs(e_b, e_t).any(dim=1)


def routing_parts(differs: Tensor, counted: Tensor) -> Tensor:
    """[2 + layers] float64: (tokens, tokens differing in any layer, per-layer differing tokens)
    over the rows where `counted` ([rows] bool) is set; `differs` [rows, layers] over ALL the
    model's MoE layers (merged over pipeline stages)."""
    d = differs[counted]
    head = torch.tensor([float(d.shape[0]), float(d.any(dim=1).sum())], dtype=torch.float64)
    return torch.cat([head, d.sum(dim=0).to(torch.float64)])


def finalize(sums: Tensor, top: Tensor, route: Optional[Tensor] = None) -> dict[str, float]:
    """Metrics from (possibly all-reduced) parts; {} when no token was measured. The routing
    metrics are absent when `route` is None (no engine routing) or counted no token."""
    n = float(sums[0])
    if n == 0:
        return {}
    out = {"mismatch/k3_kl": float(sums[1]) / n, "mismatch/abs_log_ratio_mean": float(sums[2]) / n,
           "mismatch/abs_log_ratio_max": float(top[0]), "mismatch/frac_gt_0.1": float(sums[3]) / n,
           "mismatch/tokens": n}
    if route is not None and float(route[0]) > 0:
        rn = float(route[0])
        out["mismatch/routing_disagree"] = float(route[1]) / rn
        out["mismatch/routing_tokens"] = rn
        for layer, count in enumerate(route[2:].tolist()):
            out[f"mismatch/routing_disagree_layer{layer}"] = count / rn
    return out


def mismatch_metrics(logp_behav, logp_trainer, experts_behav=None, experts_trainer=None
                     ) -> dict[str, float]:
    """The metrics of one process's responses (see the module docstring); experts, when given,
    are one [rows, layers, k] tensor (or None) per response, every row counted."""
    diffs = [token_layer_differs(b, t) for b, t in
             zip(experts_behav or [], experts_trainer or [], strict=True)
             if b is not None and t is not None]
    route = None
    if diffs:
        d = torch.cat(diffs)
        route = routing_parts(d, torch.ones(d.shape[0], dtype=torch.bool))
    return finalize(*mismatch_parts(logp_behav, logp_trainer), route)


# ------------------------------------------------------------------ the trainer's rows


def fresh_tokens(mb, fresh_uids: Tensor) -> Tensor:
    """[b, S] bool: the position holds an action token of a response in `fresh_uids` (this
    rank's CP-local positions)."""
    mask = mb.loss_mask.bool()
    if mb.is_thd:
        response = mb.segment
    else:
        response = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    uid = mb.uid.index_select(0, response.clamp(min=0).flatten()).view_as(mask)
    return mask & (response >= 0) & torch.isin(uid, fresh_uids.to(uid.device))


def counted_rows(mb, fresh_uids: Tensor, *, tp_rank: int = 0, tp_size: int = 1,
                 sequence_parallel: bool = False) -> Tensor:
    """[rows] bool in megatron's router row order (this rank's CP/SP-local positions,
    sequence-major): the position predicts an action token of a response in `fresh_uids`."""
    keep = fresh_tokens(mb, fresh_uids)
    if sequence_parallel and tp_size > 1:
        keep = keep.chunk(tp_size, dim=1)[tp_rank]
    return keep.transpose(0, 1).reshape(-1)


def field_parts(micro_batches, field: str, fresh_uids: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """`mismatch_parts` of this rank's fresh action tokens, from the micro-batches' per-token
    fields: the learner's log-probs in `field` against the engine's `logp_behav`. `fresh_uids`
    None: every response is fresh (on-policy), every action token counts."""
    sums = torch.zeros(len(_FIELDS), dtype=torch.float64)
    top = torch.zeros(1, dtype=torch.float64)
    for mb in micro_batches:
        if field not in mb.fields:
            continue
        keep = mb.loss_mask.bool() if fresh_uids is None else fresh_tokens(mb, fresh_uids)
        if not bool(keep.any()):
            continue
        d = (mb.fields[field][keep].double() - mb.fields["logp_behav"][keep].double()).cpu()
        a = d.abs()
        sums += torch.stack([torch.tensor(float(d.numel()), dtype=torch.float64),
                             (torch.expm1(d) - d).sum(), a.sum(), (a > THRESHOLD).sum().double()])
        top[0] = torch.maximum(top[0], a.max())
    return sums, top


def rank_routing_rows(micro_batches, own: list, layers: Sequence[int], num_layers: int,
                      fresh_uids: Tensor, groups, sequence_parallel: bool) -> tuple[Tensor, Tensor]:
    """(differs [rows, num_layers] float64 with this rank's MoE `layers` filled, counted [rows]
    bool) over the micro-batches carrying engine routing (`mb.routed`); `own` is what
    `Learner.own_routing` recorded for the same micro-batches (one entry per micro-batch)."""
    from megapkl.parallel.replay import local_replay_indices

    if len(own) != len(micro_batches):
        raise ValueError(f"trainer routing recorded for {len(own)} micro-batches, "
                         f"expected {len(micro_batches)}")
    if not layers:  # a pipeline stage without MoE layers recorded nothing
        own = [[] for _ in micro_batches]
    diffs, keep = [], []
    for mb, mine in zip(micro_batches, own):
        if mb.routed is None:
            continue
        rows = counted_rows(mb, fresh_uids, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                            sequence_parallel=sequence_parallel)
        d = torch.zeros(rows.numel(), num_layers, dtype=torch.float64, device=rows.device)
        if layers:
            engine = local_replay_indices(mb.routed, layers, tp_rank=groups.tp_rank,
                                          tp_size=groups.tp_size,
                                          sequence_parallel=sequence_parallel,
                                          cp_rank=groups.cp_rank, cp_size=groups.cp_size)
            d[:, list(layers)] = layer_differs(engine, mine).to(torch.float64)
        diffs.append(d)
        keep.append(rows)
    if not diffs:
        return (torch.zeros(0, num_layers, dtype=torch.float64),
                torch.zeros(0, dtype=torch.bool))
    return torch.cat(diffs), torch.cat(keep)


def global_routing_parts(differs: Tensor, counted: Tensor, groups, sequence_parallel: bool
                         ) -> Tensor:
    """`routing_parts` summed over every rank holding distinct tokens. Per token, the layers of
    all pipeline stages are merged first (each stage fills its own layers: a sum over PP); then
    one pipeline stage, and one TP rank unless sequence parallelism splits the tokens over TP,
    contributes its counts to a sum over the world (DP, CP and EP ranks hold distinct tokens)."""
    import torch.distributed as dist

    if groups.pp_size > 1:
        differs = differs.to(groups.device)
        dist.all_reduce(differs, group=groups.pp)
    parts = routing_parts(differs.cpu() > 0, counted.cpu())
    if groups.world_size == 1:
        return parts
    owner = groups.pp_rank == 0 and (groups.tp_rank == 0 or sequence_parallel)
    parts = (parts if owner else torch.zeros_like(parts)).to(groups.device)
    dist.all_reduce(parts, group=groups.world)
    return parts.cpu()


def exact_version_metrics(learner, minibatch, micro_batches, version: int, *,
                          field: Optional[str] = None, own: Optional[list] = None
                          ) -> dict[str, float]:
    """Before the optimizer update: the samples of `minibatch` generated by `version` (the
    learner's own) measured against the learner's log-probs of the same tokens. `field`: a
    micro-batch field that already holds the live weights' log-probs (the reference forward of
    this update, or the batch's per_batch reference at its first minibatch); `own`: the routing
    recorded in that forward. Otherwise one forward pass here, taken by every data-parallel rank
    when any rank holds such a sample (expert parallelism spans them); when those samples carry the
    engine's routed experts (MoE, model.routing_replay) and no routing was recorded, the forward is
    taken in any case. Collective over the world; {} when no rank has such a sample."""
    import torch.distributed as dist

    groups = learner.groups
    fresh = [s for s in minibatch if _all_of(s, version)]
    routed = any(s.routed_experts is not None for s in fresh)
    flags = torch.tensor([float(bool(fresh)), float(routed)], device=groups.device)
    if groups.dp_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups.dp)
    measure, routed = bool(flags[0].item()), bool(flags[1].item())
    if not measure:
        return {}
    if field is None or (routed and own is None):
        with learner.own_routing() as own:
            learner.fill_logprobs(micro_batches, "logp_live")
        field = field or "logp_live"
    uids = None if len(fresh) == len(minibatch) else \
        torch.tensor([s.uid for s in fresh], dtype=torch.int64, device=groups.device)
    sums, top = field_parts(micro_batches, field, uids)
    owner = groups.is_last_pp_stage and groups.tp_rank == 0  # TP ranks hold the same values
    if not owner:
        sums, top = torch.zeros_like(sums), torch.zeros_like(top)
    if groups.world_size > 1:
        sums, top = sums.to(groups.device), top.to(groups.device)
        dist.all_reduce(sums, group=groups.world)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=groups.world)
    route = _routing(learner, micro_batches, own, fresh) if routed else None
    return finalize(sums.cpu(), top.cpu(), route)


def _routing(learner, micro_batches, own: list, fresh: list) -> Tensor:
    """The global routing parts of this update's fresh samples (collective over the world)."""
    from megapkl.parallel.replay import moe_layer_ordinals

    sp = bool(learner.parallel.sequence_parallel) and learner.groups.tp_size > 1
    uids = torch.tensor([s.uid for s in fresh if s.routed_experts is not None], dtype=torch.int64)
    differs, counted = rank_routing_rows(micro_batches, own, moe_layer_ordinals(learner.model),
                                         learner.spec.num_layers, uids, learner.groups, sp)
    return global_routing_parts(differs, counted, learner.groups, sp)


def _all_of(sample, version: int) -> bool:
    """Was every action token of `sample` generated by `version`? (A multi-turn trajectory may
    span a weight push; only a response wholly of the learner's version is measured.)"""
    return sample.version == version and (
        sample.versions is None or bool((sample.versions == version).all()))
