"""SIGTERM / SIGINT on a local run: finish the current update, checkpoint, exit cleanly.

The handler only records the signal; the run context asks at each update boundary, in the one
collective that also carries a Slurm preemption (`RunContext.stop_requested`), so every rank
saves the same checkpoint and stops together. A second signal does not wait for the update to
finish: it raises KeyboardInterrupt, and the run context closes what the run holds (its engines,
logs and lock) without a checkpoint. Under Slurm (a launcher context) submitit owns SIGTERM and
the preemption path checkpoints and requeues instead; these handlers are not installed there.
"""
from __future__ import annotations

import signal
from typing import Any, Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: Optional[int] = None


def _record(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _received
    if _received is not None:  # the second one: stop now
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: stopping without a "
                                "checkpoint")
    _received = signum


def install() -> Callable[[], None]:
    """Record SIGTERM/SIGINT from now on; returns the function that puts the old handlers back."""
    global _received
    _received = None
    old: dict[int, Any] = {sig: signal.signal(sig, _record) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return restore


def received() -> int:
    """The signal number recorded on this rank (0: none). Local: the run context agrees on it."""
    return int(_received or 0)


def name(signum: int) -> str:
    return signal.Signals(signum).name


def forward_to_children() -> None:
    """In the parent of forked ranks: pass SIGTERM/SIGINT on to the ranks and keep waiting for
    them to checkpoint (instead of dying and orphaning them)."""
    import multiprocessing
    import os

    def forward(signum, frame) -> None:  # noqa: ARG001
        for child in multiprocessing.active_children():
            if child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
