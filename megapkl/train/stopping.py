"""SIGTERM / SIGINT on a local run: finish the current update, checkpoint, exit cleanly.

The handler only records the signal; the loop asks `requested()` at each update boundary, which
agrees across ranks (a signal may reach only some of them), so every rank saves the same
checkpoint and stops together. Under Slurm (a launcher context) submitit owns SIGTERM and the
preemption path checkpoints and requeues instead; these handlers are not installed there.
"""
from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

_received: Optional[int] = None


def _record(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _received
    _received = signum


def install() -> None:
    global _received
    _received = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _record)


def requested() -> Optional[str]:
    """Collective: the name of a stop signal any rank received, else None."""
    flag = torch.tensor([_received or 0], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return signal.Signals(int(flag.item())).name if int(flag.item()) else None


def forward_to_children() -> None:
    """In the parent of forked ranks: pass SIGTERM/SIGINT on to the ranks and keep waiting for
    them to checkpoint (instead of dying and orphaning them)."""
    import multiprocessing
    import os

    def forward(signum, frame) -> None:  # noqa: ARG001
        for child in multiprocessing.active_children():
            if child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
