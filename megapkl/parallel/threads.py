"""torch's CPU thread count for a block of work, the caller's restored after it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

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
