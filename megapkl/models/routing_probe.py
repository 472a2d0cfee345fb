"""The trainer's own MoE routing: the experts each router would pick, recorded during a forward.

Used for the train-inference routing mismatch (`megapkl.train.mismatch`): compare the rollout
engine's routed experts with what the trainer's routers choose for the same tokens.

megatron-core's top-k router hands every top-k selection to `router.router_replay.get_replay_topk`
with its default selection function (`topk_routing_with_score_function`, non-fused path). For the
duration of `own_routing`, each router's `router_replay` is wrapped in a probe that first runs
that default selection on the router's own scores (so it is the router's choice even while R3
replays the engine's experts) and records the indices, then defers to the real replay object (or
returns the default choice when there is none or it has no action). The forward's outputs are
unchanged: with replay on they still follow the replayed experts.

Recorded rows are megatron's router rows: this rank's (CP/SP-local) tokens, sequence-major
(`megapkl.parallel.replay` describes the layout); one [rows, top_k] tensor per forward call.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from megapkl.parallel.replay import moe_routers


class _Probe:
    """Stands in for one router's `router_replay` during `own_routing`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner          # the router's RouterReplay, or None (routing replay off)
        self.chosen: list[torch.Tensor] = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
        self.chosen.append(indices.detach().to(torch.int32))  # a minibatch's worth: keep it small
        if self.inner is None or self.inner.router_replay_action is None:
            return probs, indices
        return self.inner.get_replay_topk(scores, topk, num_groups, group_topk,
                                          default_compute_topk)

    def __getattr__(self, name: str) -> Any:
        # set_target_indices, set_router_replay_action, ... reach the real replay object
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(f"routing replay is off in this model (no {name!r}): build it "
                                 "with ModelOptions(routing_replay=True)")
        return getattr(inner, name)


def _check_router(layer: int, router: Any) -> None:
    cfg = router.config
    if getattr(router, "routing_type", None) == "sinkhorn" or cfg.moe_router_fusion:
        raise ValueError(f"MoE layer {layer}: the trainer's own routing is only observable on "
                         "megatron's non-fused top-k router (moe_router_fusion off, no sinkhorn)")


@contextlib.contextmanager
def own_routing(model: Any) -> Iterator[list]:
    """Forward passes inside record each router's own top-k choice. The yielded list is filled on
    exit with, per forward call (micro-batch, in order), one [rows, top_k] int32 tensor per local
    MoE layer in layer order (`megapkl.parallel.replay.moe_routers`). Empty for a dense model."""
    routers = moe_routers(model)
    for layer, router in routers:
        _check_router(layer, router)
    probes = [_Probe(router.router_replay) for _, router in routers]
    out: list = []
    for (_, router), probe in zip(routers, probes):
        router.router_replay = probe
    try:
        yield out
        calls = {len(p.chosen) for p in probes}
        if len(calls) > 1:
            raise RuntimeError(f"own_routing: MoE layers ran different numbers of forwards {calls}")
        for i in range(calls.pop() if calls else 0):
            out.append([p.chosen[i] for p in probes])
    finally:
        for (_, router), probe in zip(routers, probes):
            router.router_replay = probe.inner
