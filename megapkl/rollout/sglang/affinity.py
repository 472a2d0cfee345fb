"""Which CPUs a launched SGLang server runs on.

A server inherits the CPU affinity of the process that starts it. Cluster profiles bind each
trainer task to its own cores (`srun --cpu-bind=cores`), so without a choice here every server of
a replica would run its scheduler, tokenizer and detokenizer on the leader rank's few cores,
beside that rank's OMP threads. SGLang rebinds only when SGLANG_SET_CPU_AFFINITY is set (off by
default), and then to `physical cores / (TP per node)` starting at `gpu_id` times that share
(`sglang/srt/utils/common.py`, `set_gpu_proc_affinity`): for a TP=1 server that is every core of
the node. megapkl instead gives each server the share of the node's CPUs that belongs to its GPUs:
the job's CPUs on this node split evenly over the node's GPUs, GPUs base..base+tp-1 getting their
slices. A colocated server shares those cores with the trainer rank on the same GPU, and the two
take turns (the server generates while the trainer waits, and the other way round).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's list format) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def job_cpus() -> list[int]:
    """The CPUs this job may use on this node: its cgroup's cpuset (where Slurm confines a job),
    else every CPU of the machine. Not this process's affinity, which a task binding narrows to
    the rank's own cores."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        rel = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        text = Path("/sys/fs/cgroup", rel.lstrip("/"), "cpuset.cpus.effective").read_text()
        cpus = parse_cpu_list(text)
        if cpus:
            return cpus
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    return list(range(os.cpu_count() or 1))


def server_cpus(base_gpu: Optional[int], tp: int, gpus_per_node: Optional[int],
                cpus: Optional[list[int]] = None) -> Optional[list[int]]:
    """The CPUs of a server on GPUs base_gpu..base_gpu+tp-1, or None (inherit the launcher's):
    no GPU placement (a CPU stand-in), the node's GPU count unknown, or fewer CPUs than GPUs."""
    if base_gpu is None or not gpus_per_node:
        return None
    cpus = job_cpus() if cpus is None else cpus
    share = len(cpus) // gpus_per_node
    if share == 0:
        return None
    first = (base_gpu % gpus_per_node) * share
    return cpus[first:first + max(1, tp) * share]
