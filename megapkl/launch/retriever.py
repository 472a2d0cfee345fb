"""The search agent's retriever as its own step of a Slurm job, where the cluster profile puts it.

A profile's `retriever:` section names the node of the allocation (by position: 0 the first,
-1 the last), its GPUs, cores and memory. `megapkl submit` hands it to the tasks
(MEGAPKL_RETRIEVER_STEP); in the task, `LaunchContext.retriever_launcher()` gives the run's
managed retriever (`megapkl.envs.retriever_service.ManagedRetriever`, which rank 0 starts and
stops) a launcher that runs `megapkl retriever serve` as

    srun --overlap --nodes=1 --ntasks=1 --nodelist=NODE --mem=MEM --cpus-per-task=C [--gpus=G] ...

on that node, reached by its name. Memory: a flat E5 index of wiki-18 is 21,015,324 x 768
float32 = 64.6 GB, held in memory while served (on a GPU too: FAISS copies it from host memory),
plus the query encoder and the corpus' row offsets (0.2 GB): the default asks for 72 GB. A BM25
index of wiki-18 is served memory-mapped and needs far less; an HNSW64 index about 75 GB.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from megapkl.config.typed import rng

ENV = "MEGAPKL_RETRIEVER_STEP"


@dataclass
class RetrieverPlacement:
    """Where and with what the retriever's step runs (a cluster profile's `retriever:`)."""

    node: int = -1  # the allocation's node by position: 0 the first, -1 the last
    gpus: int = field(default=0, metadata=rng(0))  # a flat E5 index searches on GPU when given one
    cpus: int = field(default=8, metadata=rng(1))  # cores of the step (BM25 / HNSW search threads)
    # memory of the step: 72G holds a flat E5 index of wiki-18 (64.6 GB) with room to spare
    mem: str = "72G"

    def check(self, err) -> None:
        import re

        if not re.match(r"^\d+[KMGT]?$", self.mem):
            err(f"expected a Slurm memory size such as '72G', got '{self.mem}'", "mem")


def to_env(placement: Optional[RetrieverPlacement]) -> dict[str, str]:
    """What `megapkl submit` exports to the tasks for the placement (nothing without one)."""
    return {} if placement is None else {ENV: json.dumps(asdict(placement))}


def srun_launcher(placement: RetrieverPlacement, nodes: list[str]
                  ) -> Callable[[list[str], str], tuple[list[str], str]]:
    """(command, bind host) -> (the srun step running it on the placement's node, that node)."""
    if not nodes:
        raise ValueError("the retriever's step needs a Slurm allocation (SLURM_JOB_NODELIST)")
    if not -len(nodes) <= placement.node < len(nodes):
        raise ValueError(f"retriever.node {placement.node}: the allocation has {len(nodes)} "
                         f"node(s) ({', '.join(nodes)})")
    node = nodes[placement.node]

    def launch(cmd: list[str], host: str) -> tuple[list[str], str]:
        if len(nodes) > 1 and _loopback(host):
            raise ValueError(f"env.search.host {host}: the retriever's step runs on {node} of "
                             f"{len(nodes)} nodes, whose other nodes cannot reach loopback: set "
                             "env.search.host to an address they reach (e.g. 0.0.0.0)")
        step = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                f"--mem={placement.mem}", f"--cpus-per-task={placement.cpus}"]
        if placement.gpus:
            step.append(f"--gpus={placement.gpus}")
        # one node: the trainer is on it; several: a wildcard bind is reached by the node's name
        reach = node if len(nodes) > 1 and host in ("0.0.0.0", "::", "") else host
        return step + list(cmd), reach

    return launch


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def step_launcher() -> Optional[Callable[[list[str], str], tuple[list[str], str]]]:
    """In a task of a submitted job whose profile places the retriever: its launcher; else None
    (the run starts the retriever on its own host)."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    from megapkl.rollout.sglang.launch import slurm_nodes

    return srun_launcher(RetrieverPlacement(**json.loads(raw)), slurm_nodes())
