"""The shared memory of the tensor weight sync: buckets laid out in segments that travel to a
server on the same host by file name, and the payload SGLang's `/update_weights_from_tensor` reads.

A push lays bucket k out in slot k % 2 of its `SharedBuffers`, two segments kept from one push to
the next; `serialize_named_tensors` is the one-off form (a fresh segment per call).
"""
from __future__ import annotations

import io
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from megapkl.rollout.shm import ensure_manager

NamedTensors = list[tuple[str, Tensor]]
_SHARING = threading.Lock()


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """torch's 'file_system' sharing for the block: CPU storages are pickled by shared-memory file
    name, which an unrelated process can open (unlike a passed descriptor). The strategy is
    process-global: the lock keeps the pusher's two threads from restoring it under each other."""
    import torch.multiprocessing as tmp

    with _SHARING:
        ensure_manager()  # torch's shared-memory helper, started so a job signal cannot kill it
        previous = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            tmp.set_sharing_strategy(previous)


class SharedBuffers:
    """Two shared-memory segments the tensor sync lays its buckets out in, slot k % 2 for bucket
    k, kept from push to push (at most two buckets held between pushes). A fresh segment's pages
    are allocated when first written (tmpfs: allocate, zero, map: ~6x a memory copy of the bytes
    on a 2-core host), then mapped anew and freed by the server: with fresh segments that was
    most of a push. A kept one is rewritten at the speed of a copy, and a server that kept its
    mapping (megapkl serve) reads it without faulting. One segment per bucket, not per tensor:
    each costs a round trip to torch's shared-memory manager on both sides. A slot too small for
    its bucket, or whose name left /dev/shm (a dying server's shared-memory manager unlinks the
    names it opened; a restarted one could not open them), is replaced; without /dev/shm every
    bucket is fresh."""

    SLOTS, ALIGN = 2, 64  # each tensor starts on a cache line, and so on its element size
    SHM_DIR = Path("/dev/shm")

    def __init__(self) -> None:
        self._slots: list[Optional[torch.UntypedStorage]] = [None] * self.SLOTS
        self.reuse = self.SHM_DIR.is_dir()

    def views(self, k: int, layout: Sequence[tuple[torch.dtype, Sequence[int]]]) -> list[Tensor]:
        """Uninitialized contiguous tensors of `layout` (dtype, shape) side by side in slot k."""
        sizes = [-(-torch.Size(shape).numel() * dtype.itemsize // self.ALIGN) * self.ALIGN
                 for dtype, shape in layout]
        storage = self._slot(k % self.SLOTS, sum(sizes))
        out, offset = [], 0
        for (dtype, shape), size in zip(layout, sizes):
            out.append(_view(storage, offset, dtype, shape))
            offset += size
        return out

    def file_views(self, k: int, layout: Sequence[tuple[torch.dtype, Sequence[int]]],
                   offsets: Sequence[int]) -> Optional[tuple[Tensor, list[Tensor]]]:
        """Tensors of `layout` that lie back to back in a file from byte offsets[0], laid out in
        slot k the same way, each at its file offset modulo ALIGN: (the span's bytes, to be read
        in one call, and the tensors), or None when an offset is not a multiple of its element
        size. The kernel copies a read at about 1.7x the speed when source and destination agree
        modulo 64 bytes (measured: 256 MiB in 19 ms against 32)."""
        if any(off % dtype.itemsize for (dtype, _), off in zip(layout, offsets)):
            return None
        phase, (last_dtype, last_shape) = offsets[0] % self.ALIGN, layout[-1]
        span = offsets[-1] - offsets[0] + torch.Size(last_shape).numel() * last_dtype.itemsize
        storage = self._slot(k % self.SLOTS, phase + span)
        return (_view(storage, phase, torch.uint8, (span,)),
                [_view(storage, phase + off - offsets[0], dtype, shape)
                 for (dtype, shape), off in zip(layout, offsets)])

    def _slot(self, i: int, nbytes: int) -> torch.UntypedStorage:
        kept = self._slots[i]
        if kept is not None and self.reuse and kept.nbytes() >= nbytes and self._path(kept).exists():
            return kept
        kept = None
        self._let_go(i)  # gone before the new one comes (the peak)
        with file_system_sharing():
            self._slots[i] = torch.UntypedStorage._new_shared(max(nbytes, 1))
        return self._slots[i]

    def release(self) -> None:
        """Let every segment go now (a failed push, whose servers may still read one; the end)."""
        for i in range(self.SLOTS):
            self._let_go(i)

    def _let_go(self, i: int) -> None:
        """Slot i's name is unlinked now, not by the close of its last holder: a server that
        never decoded its payload still counts as one, and the name would stay in /dev/shm. Its
        count is raised so that no close tries the unlink again (torch aborts on a failed one)."""
        kept, self._slots[i] = self._slots[i], None
        if kept is not None and self.reuse:
            self._path(kept).unlink(missing_ok=True)
            kept._shared_incref()

    def _path(self, storage: torch.UntypedStorage) -> Path:
        return self.SHM_DIR / storage._share_filename_cpu_()[1].decode().lstrip("/")


def _view(storage: torch.UntypedStorage, byte_offset: int, dtype: torch.dtype,
          shape: Sequence[int]) -> Tensor:
    """A contiguous `dtype` tensor of `shape` at `byte_offset` (a multiple of the element size)
    of `storage`."""
    return torch.empty(0, dtype=dtype).set_(storage, byte_offset // dtype.itemsize, tuple(shape))


def place(buffers: SharedBuffers, k: int, bucket: NamedTensors,
          there: Optional[torch.UntypedStorage] = None) -> NamedTensors:
    """The bucket with each CPU tensor copied into slot k, but those already in `there` (a stored
    version read into its slot) go as they are, and GPU ones by CUDA IPC handle."""
    out = list(bucket)
    cpu = [i for i, (_, t) in enumerate(out) if t.device.type == "cpu" and not (
        there is not None and t.untyped_storage().data_ptr() == there.data_ptr())]
    if cpu:
        for i, v in zip(cpu, buffers.views(k, [(out[i][1].dtype, out[i][1].shape) for i in cpu])):
            out[i] = (out[i][0], v.copy_(out[i][1].detach()))
    return out


def pickle_payload(named_tensors: NamedTensors) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)`: base64 of a torch
    ForkingPickler pickle. Each pickled tensor counts one holder of its segment more until a
    server decodes it, so each decoding TP rank gets a pickle of its own: shared ones would drive
    the count down and unlink a kept segment early."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buf).dump([(n, t.detach()) for n, t in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named_tensors: NamedTensors) -> tuple[str, list[Tensor]]:
    """A payload of `named_tensors` in a fresh segment, and the shared tensors, which must stay
    alive until the server has read them (the segment goes with its last holder)."""
    placed = place(SharedBuffers(), 0, list(named_tensors))
    return pickle_payload(placed), [t for _, t in placed]
