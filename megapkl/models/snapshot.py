"""Frozen copies of the policy's weights (proximal reference, rollout snapshots, the initial model).

A snapshot is this rank's shard of every parameter, copied out of the live model (nothing is
gathered: each rank snapshots and restores its own shard, so snapshots work at any TP/PP/EP
layout). Snapshots can live on CPU (default; the GPU keeps only the live weights) or on the
model's device (faster swaps when memory allows). `swapped_in(key)` puts a snapshot's weights
into the live model for forward passes and restores the live weights afterwards, even if the
body raises:

    store = SnapshotStore(model)              # model: GPTModel, DDP wrapper or chunk list
    store.save("prox")                        # at a reference refresh
    with torch.no_grad(), store.swapped_in("prox"):
        logp_prox = forward(...)              # the frozen policy's log-probs
    # live weights are back; optimizer state untouched

The swap copies in place (`param.data.copy_`), so the parameter objects, DDP buffers and the
optimizer's references stay the same. It is meant for forward passes only: gradients computed
inside would belong to the snapshot's weights.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from megapkl.parallel.chunks import model_chunks




class SnapshotStore:
    """Named snapshots of one model's parameters (this rank's shards)."""

    def __init__(self, model: Any, device: Optional[str | torch.device] = "cpu",
                 dtype: Optional[torch.dtype] = None) -> None:
        """`device`: where snapshots live ("cpu", or None for the parameters' own device).
        `dtype`: store in this dtype (e.g. bf16 to halve CPU memory of fp32 weights)."""
        self._params = {f"{i}.{name}": p for i, chunk in enumerate(model_chunks(model))
                        for name, p in chunk.named_parameters()}
        self._device = None if device is None else torch.device(device)
        self._dtype = dtype
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self._meta: dict[str, Any] = {}
        self._swapped: Optional[str] = None

    # ---------------------------------------------------------------- bookkeeping

    def keys(self) -> list[str]:
        return list(self._snapshots)

    def __contains__(self, key: str) -> bool:
        return key in self._snapshots

    def meta(self, key: str) -> Any:
        """What was passed as `meta` to `save` (e.g. the policy version)."""
        self._require(key)
        return self._meta[key]

    def nbytes(self, key: Optional[str] = None) -> int:
        """Bytes held by one snapshot, or by all of them."""
        keys = [key] if key is not None else self.keys()
        return sum(t.numel() * t.element_size() for k in keys for t in self._snapshots[k].values())

    def drop(self, key: str) -> None:
        self._require(key)
        if self._swapped == key:
            raise RuntimeError(f"snapshot {key!r} is swapped in; leave swapped_in() first")
        del self._snapshots[key]
        del self._meta[key]

    def _require(self, key: str) -> None:
        if key not in self._snapshots:
            raise KeyError(f"no snapshot {key!r}; have {self.keys()}")

    # ---------------------------------------------------------------- copies

    def _copy_params(self, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
        """Copies of the live parameters on the store's device (pinned when off-GPU)."""
        out = {}
        with torch.no_grad():
            for name, p in self._params.items():
                device = self._device or p.device
                dst = torch.empty(p.shape, dtype=dtype or p.dtype, device=device,
                                  pin_memory=device.type == "cpu" and p.is_cuda)
                dst.copy_(p.detach(), non_blocking=True)
                out[name] = dst
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # non-blocking device->host copies must land first
        return out

    def _copy_in(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self._params.items():
                p.data.copy_(tensors[name], non_blocking=True)

    def save(self, key: str, meta: Any = None) -> None:
        """Snapshot the live weights under `key` (replacing an older one of that name)."""
        if self._swapped is not None:
            raise RuntimeError(f"snapshot {self._swapped!r} is swapped in: the live weights are "
                               "not in the model right now")
        old = self._snapshots.pop(key, None)
        if old is not None and self._dtype is None and self._device is not None:
            # Reuse the buffers: no new (pinned) allocation per refresh.
            with torch.no_grad():
                for name, p in self._params.items():
                    old[name].copy_(p.detach(), non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._snapshots[key] = old
        else:
            self._snapshots[key] = self._copy_params(self._dtype)
        self._meta[key] = meta

    def state_dict(self) -> dict[str, Any]:
        """Every snapshot (this rank's shards) and its meta, for a trainer checkpoint."""
        if self._swapped is not None:
            raise RuntimeError(f"snapshot {self._swapped!r} is swapped in")
        return {"snapshots": self._snapshots, "meta": self._meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, tensors in state["snapshots"].items():
            missing = set(self._params) - set(tensors)
            if missing:
                raise ValueError(f"snapshot {key!r} lacks parameters {sorted(missing)[:3]}: it was "
                                 "saved for another model or parallel layout")
        self._snapshots = dict(state["snapshots"])
        self._meta = dict(state["meta"])

    def load(self, key: str) -> None:
        """Overwrite the live weights with snapshot `key` for good (e.g. a rollback)."""
        self._require(key)
        if self._swapped is not None:
            raise RuntimeError("cannot load a snapshot while another one is swapped in")
        self._copy_in(self._snapshots[key])

    @contextlib.contextmanager
    def swapped_in(self, key: str) -> Iterator[None]:
        """Within the block the model computes with snapshot `key`'s weights."""
        self._require(key)
        if self._swapped is not None:
            raise RuntimeError(f"snapshot {self._swapped!r} is already swapped in")
        live = self._copy_params(None)  # exact dtype: restored bit for bit
        self._copy_in(self._snapshots[key])
        self._swapped = key
        try:
            yield
        finally:
            self._copy_in(live)
            self._swapped = None
