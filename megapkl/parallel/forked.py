"""Run a function on N forked gloo ranks and collect what each rank returns.

Used by the multi-process tests and the benchmarks. `import megatron.core` costs seconds per
process, so the parent imports it once and forks workers that inherit the loaded modules
(`mp.get_context("fork")`); each worker then opens its own gloo process group over TCP on
127.0.0.1. A worker exception is re-raised in the parent with the worker's traceback; a hang
is killed after `timeout` seconds.

    from megapkl.parallel.forked import run_forked

    def worker(rank, world_size, scale):        # runs in each forked process
        t = torch.full((2,), float(rank) * scale)
        dist.all_reduce(t)
        return t                                  # picklable; comes back to the parent

    results = run_forked(worker, 2, 3.0)        # [result of rank 0, result of rank 1]

Rules for worker functions: module-level or closures are both fine (fork, no pickling of the
function); return values are pickled back (tensors are fine, keep them small); do not rely on
state set in another worker. `install_compat=True` (default) applies
`megapkl.parallel.compat.install()` inside each worker (after the fork), so the parent stays
unpatched.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from typing import Any, Callable, List

from megapkl.errors import MegapklError

DEFAULT_TIMEOUT_S = 120.0


class WorkerError(MegapklError, RuntimeError):
    """A forked rank raised; the message carries its traceback."""


class WorkerTimeout(MegapklError, RuntimeError):
    """Some ranks did not finish within the timeout (they were killed)."""


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def preload_megatron() -> None:
    """Import megatron-core in this (parent) process so forked workers inherit it."""
    from megapkl.parallel import compat

    compat.preload()


def run_forked(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    threads: int = 1,
    install_compat: bool = True,
    init_distributed: bool = True,
    **kwargs: Any,
) -> List[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` forked ranks.

    Returns the per-rank return values in rank order. `threads` sets torch's intra-op threads
    in each worker (1 by default: GNU OpenMP is not fork-safe once the parent used it, and the
    ranks share the cores anyway). `init_distributed=False` skips the gloo group. The
    harness's own keyword names (timeout, threads, install_compat, init_distributed) cannot
    be passed through to `fn`.
    """
    if install_compat:
        preload_megatron()
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout, threads, install_compat,
                             init_distributed)
        except WorkerError as err:
            # free_port() cannot reserve the port: another process may take it first.
            if "address already in use" not in str(err).lower() or attempt + 1 == _PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


def _run_once(fn, world_size, args, kwargs, timeout, threads, install_compat,
              init_distributed) -> List[Any]:
    port = free_port()
    ctx = mp.get_context("fork")
    results: "mp.Queue[Any]" = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(fn, rank, world_size, port, results, timeout, threads, install_compat,
                  init_distributed, args, kwargs),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    with collected_before_fork():
        for proc in procs:
            proc.start()
    try:
        out = _collect(procs, results, world_size, timeout)
    except BaseException:
        _kill(procs)  # peers of a failed rank would only block in a collective
        raise
    _reap(procs)
    return out


@contextlib.contextmanager
def collected_before_fork():
    """Collect the parent's garbage, then freeze what is left, around a fork.

    A forked child inherits the parent's unreachable objects too (a process group, a store or a
    thread pool of an earlier run, kept alive by a reference cycle). If the child's collector
    finalizes them, their C++ destructors join threads and take locks that do not exist in the
    child: it aborts or hangs mid-statement. So the parent collects them where they were made,
    and what survives is frozen (`gc.freeze`): the child's collector never visits it.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _collect(procs: list, results: Any, world_size: int, timeout: float) -> List[Any]:
    deadline = time.monotonic() + timeout
    got: dict = {}
    while len(got) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue.Empty:
            _check_alive(procs, got, deadline, timeout)
            continue
        if not ok:
            _let_leave(procs, LEAVE_S)  # its peers may be leaving on their own (a told failure)
            raise WorkerError(f"rank {rank} of {world_size} failed:\n{payload}")
        got[rank] = pickle.loads(payload)
    return [got[r] for r in range(world_size)]


# After a rank failed: how long its peers get to leave on their own (closing what they started)
# before they are killed. A failure no agreement covers reaches them within seconds
# (megapkl.train.failure_notice); a peer still waiting then is stuck in a collective.
LEAVE_S = 15.0


def _let_leave(procs: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def _check_alive(procs: list, got: dict, deadline: float, timeout: float) -> None:
    for rank, proc in enumerate(procs):
        # A short grace period: a rank may exit just before its result reaches the queue.
        if rank not in got and proc.exitcode is not None and proc.exitcode != 0:
            raise WorkerError(f"rank {rank} died with exit code {proc.exitcode} before reporting")
    if time.monotonic() > deadline:
        missing = [r for r in range(len(procs)) if r not in got]
        raise WorkerTimeout(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")


def _reap(procs: list) -> None:
    deadline = time.monotonic() + 10.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill(procs)


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join()


def _worker_main(fn, rank, world_size, port, results, timeout, threads, install_compat,
                 init_distributed, args, kwargs) -> None:
    import torch
    import torch.distributed as dist

    # Every thread's stack on stderr just before the parent kills a rank that overran its
    # timeout: what a hang was waiting for, in the test's captured output.
    faulthandler.dump_traceback_later(max(1.0, timeout - 3.0), exit=False)
    try:
        torch.set_num_threads(threads)
        if install_compat:
            from megapkl.parallel import compat

            compat.install()
        if init_distributed:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        # Plain pickle, not the queue's ForkingPickler: once torch.multiprocessing is imported
        # (megatron does) tensors would travel as shared-memory handles that die with us.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
        from megapkl.parallel.groups import out_of_step

        if init_distributed and not out_of_step():  # out of step: the failure notice lingered
            # Rank 0 hosts the TCP store: nobody leaves while a peer may still need it.
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Flush the queue, then leave without the parent's atexit handlers (pytest's, etc.).
        results.close()
        results.join_thread()
        os._exit(0)
