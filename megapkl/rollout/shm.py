"""Shared memory that survives the job's own signals.

CPU tensors travel to a server by file name (torch's 'file_system' sharing strategy). torch then
keeps a helper process, `torch_shm_manager`, which this process tells about every segment it
frees. A Slurm preemption, `scancel` or Ctrl-C signals every process of the step or the terminal's
process group, that helper included: it dies at once, and the next shared segment this process
frees writes to its closed socket, where torch aborts the whole process (`std::system_error:
Broken pipe`), before the preemption's checkpoint. Here the helper is started with those signals
blocked (a forked child keeps its thread's signal mask across exec), so it outlives them and ends
as torch designed it: when its last client has gone.
"""
from __future__ import annotations

import signal
import threading

import torch

# What a preemption, a cancel or a terminal sends; SIGKILL still ends the helper.
JOB_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}

_lock = threading.Lock()
_started = False


def ensure_manager() -> None:
    """Start torch's shared-memory manager for this process, deaf to JOB_SIGNALS (once)."""
    global _started
    if _started:
        return
    import torch.multiprocessing as tmp

    with _lock:
        if _started:
            return
        previous_strategy = tmp.get_sharing_strategy()
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            tmp.set_sharing_strategy("file_system")
            torch.UntypedStorage._new_shared(1)  # the first file-system segment forks the manager
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            tmp.set_sharing_strategy(previous_strategy)
        _started = True
