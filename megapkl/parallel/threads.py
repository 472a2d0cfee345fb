"""Threads of a trainer rank: torch's CPU thread count for a block of work, and the threads
megapkl starts, each on the rank's CUDA device.

CUDA's current device belongs to a thread, and a new thread starts on device 0 whatever the thread
that started it uses. A rank whose local rank is not 0 sets its device in its main thread
(`torch.cuda.set_device(LOCAL_RANK)`); work done on a thread of its own (generation ahead of
training, the fleet's heartbeat and its resyncs, the weight sync's workers) would otherwise
allocate on GPU 0, open a second NCCL communicator there, or synchronize GPU 0. So every thread
megapkl starts goes through `start_thread` or `rank_executor`, which set the device of the thread
that creates them first (tests/test_device_discipline.py checks that no other thread is started).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads (OpenMP and MKL) set to `threads` for the block, the count before
    it restored on the way out, on an exception too. A thread started inside the block begins
    with `threads` as well (torch reads the count when a thread runs its first operator)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def rank_device() -> Optional[int]:
    """This rank's CUDA device, as the calling thread knows it: its current device once CUDA is
    initialized here (the rank's main thread set it), else LOCAL_RANK's; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < torch.cuda.device_count():
        return int(local)
    return None


def _use(device: Optional[int]) -> None:
    if device is not None:
        torch.cuda.set_device(device)


def start_thread(target: Callable[..., Any], *, name: str, args: tuple = (),
                 daemon: bool = True) -> threading.Thread:
    """A started thread that runs `target(*args)` on the device of the thread that starts it."""
    device = rank_device()

    def run() -> None:
        _use(device)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


class RankExecutor(ThreadPoolExecutor):
    """A thread pool whose tasks run on the device of the thread that made the pool. Set per
    task, not by the pool's initializer: a failure there is then the task's own exception, with
    its message, where a failed initializer leaves only a BrokenThreadPool."""

    def __init__(self, max_workers: int, name: str = "") -> None:
        super().__init__(max_workers, thread_name_prefix=name)
        self._device = rank_device()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any):  # type: ignore[override]
        device = self._device

        def run() -> Any:
            _use(device)
            return fn(*args, **kwargs)
        return super().submit(run)


def rank_executor(max_workers: int, name: str = "") -> ThreadPoolExecutor:
    """A thread pool whose tasks run on the device of the thread that makes the pool."""
    return RankExecutor(max_workers, name)
