"""Which GPUs the SGLang servers of a run use (arithmetic only: the launcher, `megapkl plan` and
`megapkl submit` share it, so what is checked is what runs).

Each data-parallel replica of the trainer has a fleet of `rollout.sglang.num_engines` servers of
`rollout.sglang.tp` GPUs each. The trainer runs one rank per GPU, block-distributed over the nodes
(rank r on node r // T, GPU r % T, with T trainer ranks per node: Slurm's and torchrun's default),
in megatron-core's order (tensor fastest, then context, data, pipeline). A server uses the GPUs
`--base-gpu-id` .. `--base-gpu-id + tp - 1` of what its node shows (SGLang places TP rank r on
`base_gpu_id + r`).

- colocated (`colocate: true`): the `num_engines` servers of replica d are spread evenly over the
  nodes replica d trains on (earlier nodes take the remainder; `every_node: false` puts them all
  on its leader's node), each on the GPUs replica d trains on there, `tp` consecutive ones per
  server. The servers of one node form a fleet of their own, launched, probed and refreshed by the
  replica's first rank on that node (its *owner*): the weights never leave the host. Fleets of
  different replicas never share a GPU and a GPU holds at most one server.
- dedicated (`colocate: false`): on every node the trainer's T ranks use GPUs 0 .. T-1 and the
  servers the rest; server k of the run (server i of replica d is k = d * num_engines + i) takes the
  k-th slot of `tp` consecutive free GPUs, nodes in allocation order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megapkl.config.layout import Layout
from megapkl.errors import MegapklError


class PlacementError(MegapklError, ValueError):
    """The fleet does not fit the allocation; the one-line message names the keys to change."""


def ranks_per_node() -> int:
    """Trainer ranks on this node, as the launcher (torchrun, Slurm) says."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def check_nodes(hosts: list[str], per_node: int, gpus: bool = True) -> None:
    """The placement's nodes (global rank r on node r // per_node) against the hosts the ranks
    run on (`hosts[r]`): the ranks of one node must share a host (a fleet's weights go through
    that host's shared memory), and with servers on GPUs two nodes must not (their fleets would
    take the same GPUs). PlacementError naming the ranks otherwise (e.g. ranks laid out round
    robin over the nodes, or LOCAL_WORLD_SIZE smaller than the ranks on a host)."""
    nodes: dict[int, set[str]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(rank // per_node, set()).add(host)
    for node, on in sorted(nodes.items()):
        if len(on) > 1:
            raise PlacementError(
                f"trainer ranks {node * per_node}-{node * per_node + per_node - 1} are placed on "
                f"one node ({per_node} ranks per node, LOCAL_WORLD_SIZE) but run on hosts "
                f"{sorted(on)}: start the ranks block by block (Slurm's and torchrun's default), "
                "or set rollout.sglang.colocate false")
    seen: dict[str, int] = {}
    for node, on in sorted(nodes.items()):
        host = next(iter(on))
        if gpus and host in seen:
            raise PlacementError(
                f"nodes {seen[host]} and {node} of the placement ({per_node} ranks per node, "
                f"LOCAL_WORLD_SIZE) are both host {host}: their colocated servers would take "
                "the same GPUs; LOCAL_WORLD_SIZE must count every trainer rank on a host")
        seen.setdefault(host, node)


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


def colocated_gpus(lay: Layout, d: int, node: Optional[int] = None) -> list[int]:
    """GPUs (node-local indices) replica `d` trains on, on `node` (default: its leader's)."""
    node = lay.node_of(lay.leader(d)) if node is None else node
    return sorted(r % lay.per_node for r in lay.replica_ranks(d) if lay.node_of(r) == node)


def spread(count: int, bins: int) -> list[int]:
    """`count` split over `bins` as evenly as it goes, the first bins taking the remainder."""
    return [count // bins + (i < count % bins) for i in range(bins)]


@dataclass(frozen=True)
class NodeFleet:
    """The colocated servers of one replica on one node: `node` (an index into the allocation's
    nodes), `owner` (the global trainer rank that launches, probes and refreshes them), how many
    and their slots (node None: the owner's own node; none for servers placed on no GPU)."""

    node: int
    owner: int
    servers: int
    slots: tuple[Slot, ...]


def colocated_fleets(*, num_engines: int, tp: int, lay: Layout, replica: int,
                     every_node: bool = True, gpus: bool = True) -> list[NodeFleet]:
    """Replica `replica`'s colocated fleets, one per node that holds servers, in node order;
    PlacementError when a node's share does not fit the GPUs the replica trains on there.
    `gpus` false: servers that take no GPU (a CPU stand-in), spread the same way, unplaced."""
    leader_node = lay.node_of(lay.leader(replica))
    nodes = lay.replica_nodes(replica) if every_node else [leader_node]
    fleets = []
    for node, count in zip(nodes, spread(num_engines, len(nodes))):
        if not count:
            continue
        if not gpus:
            fleets.append(NodeFleet(node, lay.first_rank_on(replica, node), count, ()))
            continue
        on_node = colocated_gpus(lay, replica, node)
        bases = _chunks(on_node, tp)
        if len(bases) < count:
            where = (f"its {len(nodes)} nodes (rollout.sglang.every_node), {count} on node "
                     f"{node}" if len(nodes) > 1 else "its leader's node")
            raise PlacementError(
                f"rollout.sglang.num_engines x rollout.sglang.tp = {num_engines} x {tp}: a "
                f"colocated fleet runs on its own replica's GPUs, spread over {where}, and "
                f"data-parallel replica {replica} trains on GPUs {on_node} there, room for "
                f"{len(bases)} server(s) of {tp} GPU(s) (num_engines counts the servers of one "
                "replica)")
        fleets.append(NodeFleet(node, lay.first_rank_on(replica, node), count,
                                tuple(Slot(None, b) for b in bases[:count])))
    return fleets


def fleet_slots(*, num_engines: int, tp: int, colocate: bool, lay: Layout, replica: int,
                nodes: int = 1, gpus_per_node: Optional[int] = None, every_node: bool = True,
                owner: Optional[int] = None) -> list[Slot]:
    """The slots of the servers global rank `owner` launches for replica `replica` (colocated:
    its node's fleet, [] if it owns none; default: the replica leader's), or of all of the
    replica's dedicated servers; PlacementError when they do not fit."""
    if colocate:
        owner = lay.leader(replica) if owner is None else owner
        for fleet in colocated_fleets(num_engines=num_engines, tp=tp, lay=lay, replica=replica,
                                      every_node=every_node):
            if fleet.owner == owner:
                return list(fleet.slots)
        return []
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


def check_fleets(*, num_engines: int, tp: int, colocate: bool, lay: Layout,
                 nodes: int = 1, gpus_per_node: Optional[int] = None,
                 every_node: bool = True) -> list[list[Slot]]:
    """Every replica's slots, with the node each server runs on (PlacementError naming the keys
    when one does not fit)."""
    if colocate:
        return [[Slot(f.node, s.base_gpu) for f in colocated_fleets(
                    num_engines=num_engines, tp=tp, lay=lay, replica=d, every_node=every_node)
                 for s in f.slots] for d in range(lay.dp)]
    return [fleet_slots(num_engines=num_engines, tp=tp, colocate=False, lay=lay, replica=d,
                        nodes=nodes, gpus_per_node=gpus_per_node) for d in range(lay.dp)]


def fleet_owners(*, num_engines: int, tp: int, colocate: bool, lay: Layout,
                 replica: int, every_node: bool = True, gpus: bool = True
                 ) -> list[tuple[int, int]]:
    """(owner's global rank, its servers) for each fleet of replica `replica`: the colocated
    fleets' owners in node order; the leader alone for dedicated servers."""
    if not colocate:
        return [(lay.leader(replica), num_engines)]
    return [(f.owner, f.servers) for f in colocated_fleets(
        num_engines=num_engines, tp=tp, lay=lay, replica=replica, every_node=every_node,
        gpus=gpus)]


def releases_memory(sg: Any) -> bool:
    """Does megapkl hand the servers' GPU memory to the trainer between generations? Only for
    colocated servers it launched itself (servers named by `urls` are left alone). Such servers
    start with SGLang's memory saver, and `megapkl plan` counts their memory as free while
    training."""
    return bool(sg.colocate and not sg.urls)


def engine_owners(rollout: Any, lay: Layout) -> list[list[tuple[int, int]]]:
    """For each data-parallel replica of the trainer layout `lay`, the global ranks that run one of
    its engines and the servers each has, in node order: colocated SGLang fleets megapkl launches
    are their nodes' (`fleet_owners`); any other engine is the replica leader's alone. A stand-in
    `server_command` takes no GPU: its servers are spread the same way, with no GPU to fit."""
    sg = rollout.sglang
    if rollout.engine != "sglang" or not releases_memory(sg):  # not colocated servers we launch
        return [[(lay.leader(d), 1)] for d in range(lay.dp)]
    return [fleet_owners(num_engines=sg.num_engines, tp=sg.tp, colocate=True, lay=lay,
                         replica=d, every_node=sg.every_node, gpus=not sg.server_command)
            for d in range(lay.dp)]
