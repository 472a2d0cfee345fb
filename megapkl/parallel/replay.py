"""R3: replay the rollout engine's MoE routing in the trainer's forward passes.

The rollout engine (SGLang) reports, per token, the experts it routed to in every MoE layer:
rows = tokens, [num_moe_layers, top_k]. Stacked over a batch aligned with the trainer's input ids
that is `routed[b, s, L, k]` (packed THD batches: b = 1). Replaying those choices makes the
trainer's log-probs follow the same experts as the sampler did; megatron-core 0.16's router
then gathers the probabilities at the replayed indices from its *current* scores, so the router
still receives gradients.

megatron's `RouterReplay` keeps a process-wide list of every router ever built and static
setters acting on all of them (a reference model or a second policy copy would be hit too, and
the list length would not match). Here each model's own routers are addressed directly, in
layer order, through their `router.router_replay` instances.

Which rows a rank's router sees (what `local_replay_indices` slices):
- PP: only the MoE layers of this rank's chunk(s) (global layer numbers from the model);
- CP: the load-balanced halves of the sequence: chunks r and 2*cp-1-r of 2*cp (megatron's
  `get_batch_on_this_cp_rank` layout);
- TP with sequence parallelism: the TP rank's contiguous part of that local sequence;
- then megatron's router flattens [s, b] sequence-major: row = s_local * b + batch_row;
- EP: nothing: the router runs on its rank's tokens before they are dispatched to experts.

With activation recomputation the recomputed forward during backward must replay the same
micro-batch: set the action to "replay_backward" for backward passes (megatron's FIFO of
targets); without recomputation "replay" suffices.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from megapkl.parallel.chunks import model_chunks

_ACTIONS = ("record", "replay", "replay_backward")




def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """(global layer index, router) of every MoE layer this rank holds, in layer order."""
    routers = []
    for chunk in model_chunks(model):
        for layer in chunk.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                routers.append((layer.layer_number - 1, router))
    return sorted(routers, key=lambda item: item[0])


def _replays(model: Any) -> list[Any]:
    routers = moe_routers(model)
    if not routers:
        raise ValueError("routing replay: the model has no MoE layers on this rank")
    replays = [r.router_replay for _, r in routers]
    if any(r is None for r in replays):
        raise ValueError("routing replay is off in this model: build it with "
                         "ModelOptions(routing_replay=True)")
    return replays


def set_action(model: Any, action: Optional[str]) -> None:
    """"record" | "replay" | "replay_backward" | None (route normally) for all routers."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if action is not None and action not in _ACTIONS:
        raise ValueError(f"routing replay action must be one of {_ACTIONS} or None, "
                         f"got {action!r}")
    value = None if action is None else {
        "record": RouterReplayAction.RECORD,
        "replay": RouterReplayAction.REPLAY_FORWARD,
        "replay_backward": RouterReplayAction.REPLAY_BACKWARD,
    }[action]
    for replay in _replays(model):
        if value is None:
            replay.clear_router_replay_action()
        else:
            replay.set_router_replay_action(value)


def clear(model: Any) -> None:
    """Forget recorded and queued indices (call at the start of every optimizer step)."""
    for replay in _replays(model):
        replay.clear_indices()


def push_replay(model: Any, per_layer: Sequence[torch.Tensor]) -> None:
    """Queue one micro-batch's indices: one [rows, top_k] tensor per local MoE layer."""
    replays = _replays(model)
    if len(per_layer) != len(replays):
        raise ValueError(f"routing replay: got indices for {len(per_layer)} MoE layers, this rank "
                         f"holds {len(replays)}")
    for replay, indices in zip(replays, per_layer):
        replay.set_target_indices(indices.to(torch.int64))


def recorded(model: Any) -> list[torch.Tensor]:
    """The indices the last "record" forward chose: one [rows, top_k] tensor per local layer."""
    out = []
    for (layer, _), replay in zip(moe_routers(model), _replays(model)):
        indices = replay.get_recorded_indices()
        if indices is None:
            raise ValueError(f"routing replay: nothing recorded for layer {layer}; run a forward "
                             "with set_action(model, 'record') first")
        out.append(indices)
    return out


# ------------------------------------------------------------------ layouts


def cp_slice(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a sequence dim: chunks r and 2*cp-1-r of 2*cp (load balanced)."""
    if cp_size == 1:
        return x
    if x.shape[dim] % (2 * cp_size):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2*cp={2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def local_replay_indices(routed: torch.Tensor, moe_layers: Sequence[int], *, tp_rank: int = 0,
                         tp_size: int = 1, sequence_parallel: bool = False, cp_rank: int = 0,
                         cp_size: int = 1) -> list[torch.Tensor]:
    """Per local MoE layer, the [rows, top_k] indices this rank's router must replay.

    `routed`: [b, s, num_moe_layers, top_k] aligned with the input ids (global sequence).
    `moe_layers`: ordinals (among all MoE layers) of the MoE layers this rank holds.
    """
    if routed.dim() != 4:
        raise ValueError(f"routed experts must be [batch, seq, moe_layers, top_k], "
                         f"got shape {list(routed.shape)}")
    x = cp_slice(routed, cp_rank, cp_size, dim=1)
    if sequence_parallel and tp_size > 1:
        if x.shape[1] % tp_size:
            raise ValueError(f"local sequence {x.shape[1]} not divisible by TP {tp_size} (SP)")
        x = x.chunk(tp_size, dim=1)[tp_rank]
    x = x.transpose(0, 1)  # [s_local, b, L, k]: megatron's sequence-major token order
    rows = x.reshape(-1, x.shape[2], x.shape[3])
    return [rows[:, layer].contiguous().to(torch.int64) for layer in moe_layers]


def to_token_layout(per_layer: Sequence[torch.Tensor], batch: int) -> torch.Tensor:
    """Inverse of the flattening: local [rows, k] per layer -> [b, s_local, L_local, k]."""
    stacked = torch.stack(list(per_layer), dim=1)  # [rows, L, k]
    s_local = stacked.shape[0] // batch
    return stacked.reshape(s_local, batch, *stacked.shape[1:]).transpose(0, 1).contiguous()


def moe_layer_ordinals(model: Any) -> list[int]:
    """Ordinals (among the model's MoE layers) of this rank's MoE layers. Every Qwen3-MoE layer
    is an MoE layer, so the ordinal is the global layer index."""
    return [layer for layer, _ in moe_routers(model)]


# ------------------------------------------------------------------ context managers


@contextlib.contextmanager
def replaying(model: Any, routed: torch.Tensor, *, groups: Any = None,
              sequence_parallel: Optional[bool] = None) -> Iterator[None]:
    """Forward passes inside replay `routed` ([b, s, L, k], global sequence) on this rank.

    One micro-batch; the layout (TP/SP/CP/PP) comes from `groups` (a ParallelGroups; default
    single process) and the model's config.
    """
    chunk = model_chunks(model)[0]
    if sequence_parallel is None:
        sequence_parallel = bool(chunk.config.sequence_parallel)
    tp_rank, tp_size, cp_rank, cp_size = 0, 1, 0, 1
    if groups is not None:
        tp_rank, tp_size = groups.tp_rank, groups.tp_size
        cp_rank, cp_size = groups.cp_rank, groups.cp_size
    indices = local_replay_indices(routed, moe_layer_ordinals(model), tp_rank=tp_rank,
                                   tp_size=tp_size, sequence_parallel=sequence_parallel,
                                   cp_rank=cp_rank, cp_size=cp_size)
    clear(model)
    push_replay(model, indices)
    set_action(model, "replay")
    try:
        yield
    finally:
        set_action(model, None)
        clear(model)


@contextlib.contextmanager
def recording(model: Any) -> Iterator[list]:
    """Forward passes inside record their routing; the yielded list is filled on exit with one
    [rows, k] tensor per local MoE layer (see `to_token_layout`)."""
    out: list = []
    clear(model)
    set_action(model, "record")
    try:
        yield out
        out.extend(recorded(model))
    finally:
        set_action(model, None)
        clear(model)
