"""Which GPUs the SGLang servers of a run use (arithmetic only: the launcher, `megapkl plan` and
`megapkl submit` share it, so what is checked is what runs).

Each data-parallel replica of the trainer has a fleet of `rollout.sglang.num_engines` servers of
`rollout.sglang.tp` GPUs each. The trainer runs one rank per GPU, block-distributed over the nodes
(rank r on node r // T, GPU r % T, with T trainer ranks per node: Slurm's and torchrun's default),
in megatron-core's order (tensor fastest, then context, data, pipeline). A server uses the GPUs
`--base-gpu-id` .. `--base-gpu-id + tp - 1` of what its node shows (SGLang places TP rank r on
`base_gpu_id + r`).

- colocated (`colocate: true`): the fleet of replica d runs on the node of its leader, on the GPUs
  replica d trains on there; each server takes `tp` consecutive ones. Fleets of different replicas
  never share a GPU and a GPU holds at most one server.
- dedicated (`colocate: false`): on every node the trainer's T ranks use GPUs 0 .. T-1 and the
  servers the rest; server k of the run (server i of replica d is k = d * num_engines + i) takes the
  k-th slot of `tp` consecutive free GPUs, nodes in allocation order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megapkl.errors import MegapklError


class PlacementError(MegapklError, ValueError):
    """The fleet does not fit the allocation; the one-line message names the keys to change."""


@dataclass(frozen=True)
class TrainerLayout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    per_node: int = 1  # trainer ranks (= GPUs) per node

    def replica_ranks(self, d: int) -> list[int]:
        return [t + self.tp * (c + self.cp * (d + self.dp * p))
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def leader(self, d: int) -> int:
        return self.tp * self.cp * d


@dataclass(frozen=True)
class Slot:
    """Where one server runs: `node` (an index into the allocation's nodes; None: the replica
    leader's own node) and the first of its GPUs there."""

    node: Optional[int]
    base_gpu: int


def _chunks(gpus: list[int], tp: int) -> list[int]:
    """First GPUs of the tp-wide groups of consecutive GPUs in `gpus` (sorted)."""
    bases, run = [], []
    for g in gpus + [None]:
        if run and (g is None or g != run[-1] + 1):
            bases += run[: len(run) - len(run) % tp: tp]
            run = []
        if g is not None:
            run.append(g)
    return bases


def colocated_gpus(lay: TrainerLayout, d: int) -> list[int]:
    """GPUs (node-local indices) replica `d` trains on, on its leader's node."""
    node = lay.leader(d) // lay.per_node
    return sorted(r % lay.per_node for r in lay.replica_ranks(d) if r // lay.per_node == node)


def fleet_slots(*, num_engines: int, tp: int, colocate: bool, lay: TrainerLayout, replica: int,
                nodes: int = 1, gpus_per_node: Optional[int] = None) -> list[Slot]:
    """The slots of replica `replica`'s servers; PlacementError when they do not fit."""
    if colocate:
        gpus = colocated_gpus(lay, replica)
        bases = _chunks(gpus, tp)
        if len(bases) < num_engines:
            raise PlacementError(
                f"rollout.sglang.num_engines x rollout.sglang.tp = {num_engines} x {tp}: a "
                f"colocated fleet runs on its own replica's GPUs, and data-parallel replica "
                f"{replica} trains on GPUs {gpus} of its leader's node, room for {len(bases)} "
                f"server(s) of {tp} GPU(s) (num_engines counts the servers of one replica)")
        return [Slot(None, b) for b in bases[:num_engines]]
    gpus = lay.per_node if gpus_per_node is None else gpus_per_node
    free = _chunks(list(range(lay.per_node, gpus)), tp)
    slots = [Slot(n, b) for n in range(nodes) for b in free]
    need = lay.dp * num_engines
    if len(slots) < need:
        raise PlacementError(
            f"rollout.sglang.num_engines x rollout.sglang.tp = {num_engines} x {tp} per "
            f"data-parallel replica, {lay.dp} replicas: {need} dedicated server(s), but "
            f"{nodes} node(s) x ({gpus} GPUs - {lay.per_node} trainer ranks) leave room for "
            f"{len(slots)} (slurm.nodes, slurm.gpus_per_node, parallel.data)")
    return slots[replica * num_engines:(replica + 1) * num_engines]


def check_fleets(*, num_engines: int, tp: int, colocate: bool, lay: TrainerLayout,
                 nodes: int = 1, gpus_per_node: Optional[int] = None) -> list[list[Slot]]:
    """Every replica's slots (PlacementError naming the keys when one does not fit)."""
    return [fleet_slots(num_engines=num_engines, tp=tp, colocate=colocate, lay=lay, replica=d,
                        nodes=nodes, gpus_per_node=gpus_per_node) for d in range(lay.dp)]
