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

`size_retriever` gives `megapkl plan` the same figures for a run: the index's host memory (from its
manifest and files when it is built, else Search-R1's flat E5 index of wiki-18), where it runs, and,
when the profile's step has GPUs, the float16 shard of a flat index on each of them, which are GPUs
the trainer also holds.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

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
        # imported here: megapkl.launch stays free of torch, which rollout.sglang imports
        from megapkl.rollout.sglang.http import is_loopback

        if len(nodes) > 1 and is_loopback(host):
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


def step_launcher() -> Optional[Callable[[list[str], str], tuple[list[str], str]]]:
    """In a task of a submitted job whose profile places the retriever: its launcher; else None
    (the run starts the retriever on its own host)."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    from megapkl.rollout.sglang.launch import slurm_nodes

    return srun_launcher(RetrieverPlacement(**json.loads(raw)), slurm_nodes())


# ---- sizing (`megapkl plan`)

WIKI18_ROWS, E5_DIM = 21_015_324, 768  # Search-R1's corpus and e5-base-v2's dimension
ENCODER_BYTES = 0.44e9  # e5-base-v2 in float32 (110M parameters), on the host when no GPU
GB, GIB = 1e9, 2.0 ** 30


@dataclass
class RetrieverSizing:
    """What the run's own retriever (env.search.index) holds and where it runs, for the plan."""

    index: str
    backend: str  # 'bm25', 'flat', 'hnsw'
    rows: int
    host_bytes: float  # resident in host memory while served
    said: str  # how the figures were obtained
    where: str  # where it runs
    mem_bytes: Optional[float] = None  # the step's memory (profile retriever.mem); None: unknown
    gpus: int = 0  # GPUs the flat index is sharded over (profile retriever.gpus)
    gpu_gib: float = 0.0  # its float16 shard on each of them
    gpu_load_gib: Optional[float] = None  # the busiest trainer GPU of that node with the shard
    gpu_mem_gib: Optional[float] = None
    gpu_note: str = ""

    @property
    def fits(self) -> bool:
        host = self.mem_bytes is None or self.host_bytes <= self.mem_bytes
        gpu = self.gpu_load_gib is None or self.gpu_mem_gib is None or \
            self.gpu_load_gib <= self.gpu_mem_gib
        return host and gpu

    def lines(self) -> list[str]:
        out = [f"retriever (env.search.index {self.index}): {self.backend}, {self.rows:,} "
               f"passages ({self.said})", f"  where        {self.where}"]
        host = f"  host memory  {self.host_bytes / GIB:.1f} GiB ({self.host_bytes / GB:.1f} GB)"
        if self.backend == "bm25":
            host += " (the index is memory-mapped: pages stay cached as they are read)"
        if self.mem_bytes is not None:
            verdict = "fits" if self.host_bytes <= self.mem_bytes else "DOES NOT FIT"
            host += f" of the step's {self.mem_bytes / GIB:.0f} GiB (retriever.mem) -> {verdict}"
        out.append(host)
        if self.gpus:
            line = (f"  GPUs         the flat index in float16 sharded over {self.gpus} GPU(s) "
                    f"(a faiss-gpu build): {self.gpu_gib:.2f} GiB on each")
            if self.gpu_load_gib is not None:
                ok = "fits" if self.gpu_mem_gib is None or self.gpu_load_gib <= self.gpu_mem_gib \
                    else "DOES NOT FIT"
                line += (f", beside the trainer's {self.gpu_load_gib - self.gpu_gib:.2f} GiB on "
                         f"those GPUs = {self.gpu_load_gib:.2f} -> {ok}")
            out.append(line)
        elif self.gpu_note:
            out.append(f"  GPUs         {self.gpu_note}")
        return out


def mem_bytes(mem: str) -> Optional[float]:
    """A Slurm memory size ('72G', '500000M', a bare number of MB) in bytes; '0' (all of the
    node): None."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    mem = mem.strip().upper()
    value = float(mem[:-1]) * units[mem[-1]] if mem[-1] in units else float(mem) * 2 ** 20
    return value or None


def index_figures(index: Path) -> tuple[str, int, float, float, str]:
    """(backend, rows, host bytes, bytes of the vectors a GPU would hold in float32, how
    obtained) of an index directory; Search-R1's flat E5 index of wiki-18 when it is not built."""
    manifest = index / "manifest.json"
    if not manifest.is_file():
        vectors = WIKI18_ROWS * E5_DIM * 4.0
        return ("flat", WIKI18_ROWS, vectors + 8.0 * WIKI18_ROWS + ENCODER_BYTES, vectors,
                "not built here: sized as Search-R1's flat E5 index of wiki-18, "
                f"{WIKI18_ROWS:,} x {E5_DIM} float32")
    m = json.loads(manifest.read_text())
    rows, offsets = int(m["rows"]), 8.0 * int(m["rows"])
    if m["backend"] == "bm25":
        disk = sum(f.stat().st_size for f in (index / "bm25").rglob("*") if f.is_file())
        return "bm25", rows, disk + offsets, 0.0, "its manifest; the bm25 files' size on disk"
    faiss_file = Path(m.get("faiss_index") or index / "faiss.index")
    size = float(faiss_file.stat().st_size)
    kind = m.get("faiss", "flat")
    if kind == "prebuilt":  # a flat index is its vectors; anything larger has a graph
        kind = "flat" if size < rows * E5_DIM * 4.0 * 1.01 else "hnsw"
    return (kind, rows, size + offsets + ENCODER_BYTES, size if kind == "flat" else 0.0,
            f"its manifest; {faiss_file.name} is {size / GB:.1f} GB")


def size_retriever(env: Any, placement: Optional[RetrieverPlacement], *, cwd: Path,
                   nodes: Optional[int], train_gib: Optional[float] = None,
                   gpu_mem_gib: Optional[float] = None) -> Optional[RetrieverSizing]:
    """The plan's figures of the retriever a run serves itself (env.search.index), None without
    one. `placement`: the cluster profile's `retriever:` (None: it runs beside rank 0);
    `train_gib`: the most loaded trainer GPU, which a GPU shard is added to."""
    if env.type != "search" or env.search.index is None:
        return None
    index = Path(env.search.index)
    backend, rows, host, vectors, said = index_figures(index if index.is_absolute()
                                                      else cwd / index)
    if placement is None:
        where = ("beside rank 0, on the allocation's first node (the profile places no "
                 "`retriever:` step): the node's memory holds it")
        note = "" if backend != "flat" or _gpu_off(env.search.serve_args) else (
            "a faiss-gpu build shards the flat index over every GPU rank 0's task sees; "
            "env.search.serve_args [--gpu, \"off\"] keeps it on the CPU, a profile "
            "`retriever:` step with GPUs places it")
        return RetrieverSizing(env.search.index, backend, rows, host, said, where, gpu_note=note)
    node = placement.node % nodes if nodes else placement.node
    where = (f"its own Slurm step on node {node} of the allocation (profile retriever: node "
             f"{placement.node}, {placement.cpus} CPUs, {placement.gpus} GPU(s), mem "
             f"{placement.mem})")
    sizing = RetrieverSizing(env.search.index, backend, rows, host, said, where,
                             mem_bytes=mem_bytes(placement.mem))
    if placement.gpus and backend == "flat" and not _gpu_off(env.search.serve_args):
        sizing.gpus, sizing.gpu_gib = placement.gpus, vectors / 2 / placement.gpus / GIB
        sizing.gpu_mem_gib = gpu_mem_gib
        if train_gib is not None:  # the step's GPUs are GPUs the trainer holds on that node
            sizing.gpu_load_gib = train_gib + sizing.gpu_gib
    return sizing


def _gpu_off(args: list[str]) -> bool:
    """Do `megapkl retriever serve`'s extra arguments keep the index off the GPUs?"""
    pairs = zip(args, args[1:] + [""])
    return "--gpu=off" in args or any(a == "--gpu" and b == "off" for a, b in pairs)
