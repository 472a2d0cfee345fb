"""How an engine writes pushed weights into its parameters, checked first: the engine's shape, a
floating-point tensor, no NaN or Inf.

Two ways (`EmbeddedEngine.update_weights`):
- staged, the default: every tensor of a call is checked whole before any is written, so a bad
  push leaves the previous weights untouched. The check reads every byte once before the copy
  reads it again.
- streamed: each tensor is checked and written a few MiB at a time, the piece still in cache
  when it is copied, so the bytes are read once (megapkl serve's loads, where the bytes are the
  request's own and a push is several calls anyway), the pieces shared among the engine's
  threads (`StreamedWrite`). A bad value found after a piece was written leaves the weights
  torn; the engine then refuses to generate until every parameter has been written again.
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from megapkl.parallel.threads import start_thread, torch_threads
from megapkl.rollout.engine import WeightUpdateError

# Bytes checked and copied at a time: a piece stays in the caches between its check and its copy
# (measured on a 2-core host, one thread: 4 MiB pieces load a 512 MiB bucket in 0.72x the time of
# a whole check followed by a whole copy; 256 KiB pieces pay more per call than they save).
PIECE_BYTES = 4 << 20


class TornWrite(WeightUpdateError):
    """A streamed write failed after it had written part of the engine's weights."""


def check_meta(name: str, tensor: Tensor, param: nn.Parameter) -> None:
    """The checks that need no pass over the bytes: a tensor, the parameter's shape, floating
    point."""
    if not isinstance(tensor, Tensor):
        raise WeightUpdateError(f"weight '{name}': expected a torch.Tensor, got "
                                f"{type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(param.shape):
        raise WeightUpdateError(f"weight '{name}': shape {list(tensor.shape)} does not match the "
                                f"engine's {list(param.shape)}")
    if not tensor.is_floating_point():
        raise WeightUpdateError(f"weight '{name}': expected a floating-point tensor, got "
                                f"{tensor.dtype}")


def finite(value: Tensor) -> bool:
    """No NaN or Inf in `value`. A sum carries both through; a finite sum says so in one
    vectorized read, and only a non-finite one (a NaN, an Inf, or finite values whose sum
    overflows) is looked at again with min and max, which propagate NaN and show +-Inf.
    (`isfinite().all()` writes a mask first: ~20x slower on CPU.)"""
    if not value.numel() or bool(torch.isfinite(value.sum())):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(value))).all())


def staged_value(name: str, tensor: Tensor, param: nn.Parameter, copy: bool = True) -> Tensor:
    """`tensor` checked whole, on the parameter's device and dtype (a copy unless `copy` is False
    and nothing needs converting), ready to be written."""
    check_meta(name, tensor, param)
    return _finite_value(name, tensor.detach(), param, copy)


def _finite_value(name: str, tensor: Tensor, param: nn.Parameter, copy: bool) -> Tensor:
    value = tensor.to(device=param.device, dtype=param.dtype, copy=copy)
    if not finite(value):
        raise WeightUpdateError(f"weight '{name}': contains NaN or Inf")
    return value


def streamed_jobs(named: Iterable[tuple[str, Tensor, nn.Parameter]]
                  ) -> Iterator[Callable[[], None]]:
    """The work of a streamed write, a piece at a time: each tensor's metadata is checked when its
    first piece is asked for, then each piece is a job that checks and writes it. Off the CPU
    (where a check is a device sync) a tensor is one job: checked whole, then written."""
    for name, tensor, param in named:
        check_meta(name, tensor, param)
        src = tensor.detach()
        if param.device.type != "cpu" or src.device != param.device or not param.is_contiguous():
            yield partial(_write_whole, name, src, param)
            continue
        flat, dst = src.reshape(-1), param.data.view(-1)
        step = max(1, PIECE_BYTES // max(src.element_size(), dst.element_size()))
        for start in range(0, flat.numel(), step):
            yield partial(_write_piece, name, flat[start:start + step], dst[start:start + step])


def _write_whole(name: str, src: Tensor, param: nn.Parameter) -> None:
    value = _finite_value(name, src, param, copy=False)
    with torch.no_grad():
        param.copy_(value)


def _write_piece(name: str, src: Tensor, dst: Tensor) -> None:
    piece = src.to(dst.dtype)  # checked as the engine will hold it
    if not finite(piece):
        raise WeightUpdateError(f"weight '{name}': contains NaN or Inf")
    dst.copy_(piece)


# At most this many threads write one call's pieces: they are bound by memory bandwidth, which a
# few threads fill, and each helper is a thread started per call (2 measured, on a 2-core host).
MAX_WRITE_THREADS = 8


def write_threads(device: torch.device) -> int:
    """Threads for a streamed write to an engine on `device`: torch's own thread count on the CPU
    (at most MAX_WRITE_THREADS), one elsewhere (each job is then a whole tensor on the device)."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), MAX_WRITE_THREADS))


class StreamedWrite:
    """Runs a streamed write's jobs on `threads` threads (this one and threads - 1 helpers, each
    with torch on one thread, all joined before `run` returns), each taking the next job when it
    is free: a thread that another process keeps off its core holds nobody up, unlike an OpenMP
    team, which waits for its slowest member. Measured on a 2-core host: a 512 MiB bucket in 34 ms
    on two threads against 47 on one when the host is otherwise idle, and no slower on two than
    on one while another process reads (the pusher reading the next bucket).

    The first job runs alone, so a bad first piece has written nothing. Any failure after a piece
    was written leaves the weights torn: a bad value then raises TornWrite, anything else (an
    interrupt) is raised as it is; `written` counts the jobs done."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.written = 0
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._stopped = False

    def run(self, jobs: Iterator[Callable[[], None]]) -> None:
        # torch on one thread in each thread (helpers started inside the block begin with one):
        # the pieces are bound by memory, not compute, and an OpenMP team waits for its slowest
        # member, which a process on the same cores (the pusher reading the next bucket) keeps
        # waiting for a time slice. Measured on a 2-core host beside the tensor sync's reads: a
        # 512 MiB bucket in 50-60 ms on one torch thread, 71-82 on two.
        with torch_threads(1):
            if self._work(jobs, limit=1):
                helpers: list[threading.Thread] = []
                try:
                    for _ in range(self.threads - 1):
                        helpers.append(start_thread(self._work, name="megapkl-weight-write",
                                                    args=(jobs,)))
                    self._work(jobs)
                finally:
                    self._stopped = True  # helpers finish the job in hand, then stop
                    for t in helpers:
                        t.join()
        error = self._error
        if error is None:
            return
        if self.written and type(error) is WeightUpdateError:
            raise TornWrite(str(error)) from None
        raise error

    def _work(self, jobs: Iterator[Callable[[], None]], limit: int = -1) -> bool:
        """Jobs until none is left, one fails or `limit` are done: True when more may follow."""
        while limit:
            with self._lock:
                if self._error is not None or self._stopped:
                    return False
                try:
                    job = next(jobs, None)
                except BaseException as exc:
                    self._error = exc
                    return False
            if job is None:
                return False
            try:
                job()
            except BaseException as exc:
                with self._lock:
                    if self._error is None:  # the first failure is the one raised
                        self._error = exc
                return False
            with self._lock:
                self.written += 1
            limit -= 1
        return True
