"""How an engine writes pushed weights into its parameters, checked first: the engine's shape, a
floating-point tensor, no NaN or Inf.

Two ways (`EmbeddedEngine.update_weights`):
- staged, the default: every tensor of a call is checked whole before any is written, so a bad
  push leaves the previous weights untouched. The check reads every byte once before the copy
  reads it again.
- streamed: each tensor is checked and written a few MiB at a time, the piece still in cache
  when it is copied, so the bytes are read once (megapkl serve's loads, where the bytes are the
  request's own and a push is several calls anyway). A bad value found after a piece was
  written leaves the weights torn; the engine then refuses to generate until every parameter
  has been written again.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

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


def write_streamed(name: str, tensor: Tensor, param: nn.Parameter) -> None:
    """`tensor` checked and written into `param` piece by piece. WeightUpdateError when nothing
    was written, TornWrite when a bad piece came after good ones. Off the CPU (where a check is a
    device sync) the tensor is checked whole, then written."""
    check_meta(name, tensor, param)
    src = tensor.detach()
    if param.device.type != "cpu" or src.device != param.device or not param.is_contiguous():
        value = _finite_value(name, src, param, copy=False)
        with torch.no_grad():
            param.copy_(value)
        return
    flat, dst = src.reshape(-1), param.data.view(-1)
    step = max(1, PIECE_BYTES // max(src.element_size(), dst.element_size()))
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step].to(dst.dtype)  # checked as the engine will hold it
        if not finite(piece):
            error = TornWrite if start else WeightUpdateError
            raise error(f"weight '{name}': contains NaN or Inf")
        dst[start:start + step].copy_(piece)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the block (a streamed write): the pieces are bound by memory, not
    compute, and a team of threads waits for its slowest member, which a process on the same
    cores (the pusher reading the next bucket) keeps waiting for a time slice. Measured on a
    2-core host beside the tensor sync's reads: a 512 MiB bucket in 50-60 ms on one thread, 71-82
    on two."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
