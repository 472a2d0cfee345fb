"""The policy versions the rollout schedule still needs, as files of a `VersionStore`.

Version `u` is written once, by global rank 0, from the learner's collective export (every rank
takes part in the export; block FP8 under rollout.fp8, decided here only), and every engine loads
it from the disk path: stale protocols (controlled staleness, uniform stale) generate from exact
old weights without holding them in host memory. The set of versions (`kept`) is the same on
every rank. The generation-ahead thread is told what is published and withdrawn (`watch`), so it
never reads this object's state. A checkpoint references the files (hard links), never a copy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch.distributed as dist

from megapkl.rollout.engine import RolloutError
from megapkl.rollout.version_store import VersionStore
from megapkl.train.agree import agree, agreed, feed
from megapkl.train.timers import Timers


class PolicyVersions:
    def __init__(self, store: VersionStore, *, fp8: bool, pool: int, reader: bool = True,
                 timers: Optional[Timers] = None) -> None:
        """`pool`: rollout.snapshot_pool; `reader`: an engine on this rank loads the files."""
        self.store, self.pool, self.reader = store, pool, reader
        self.timers = timers or Timers()
        self.kept: set[int] = set()
        self._watcher: Any = None  # the producer: published(v), withdrawn(keep)
        self.transform = None
        if fp8:  # every version is written (and pushed) already quantized, here only
            from megapkl.rollout.fp8 import FP8Transform

            self.transform = FP8Transform()

    @classmethod
    def of(cls, rollout: Any, run_dir: Path, *, reader: bool,
           timers: Optional[Timers] = None) -> "PolicyVersions":
        """The run's versions under `run_dir/policy_versions`, written by global rank 0, from the
        rollout section (fp8, snapshot_pool); `reader`: an engine on this rank loads them."""
        writer = not dist.is_initialized() or dist.get_rank() == 0
        return cls(VersionStore(Path(run_dir) / "policy_versions", writer=writer),
                   fp8=rollout.fp8, pool=rollout.snapshot_pool, reader=reader, timers=timers)

    def watch(self, watcher: Any) -> None:
        """`watcher.published(version)` / `watcher.withdrawn(keep)` from now on."""
        self._watcher = watcher

    def has(self, version: Optional[int]) -> bool:
        """Is the file of `version` in the store (an engine may load it)?"""
        return version is not None and version in self.store.versions()

    def get(self, version: int) -> Any:
        """The stored weights of `version`: a reference to its file, which an engine reads."""
        return self.store.get(version)

    def remember(self, version: int, export: Callable[[], Iterable]) -> None:
        """Write the weights of `version` into the store unless it holds them already (an
        evaluation wrote them). `export()`: the learner's collective export, consumed on every
        rank and written only by the store's writer. Collective; a failure to write is agreed
        over every rank."""
        if version in self.kept:
            return

        def write(stream) -> None:
            if self.store.writer and self.transform is not None:
                stream = self.transform(stream)
            self.store.save(version, stream)
        with self.timers("export"):
            error = feed(export(), write)
            agree(error, what="saving the policy version")
        self.kept.add(version)
        if self._watcher is not None:
            self._watcher.published(version)

    def drop(self, version: int) -> None:
        """`version` is not needed (an evaluation wrote it; no batch is generated from it)."""
        if version in self.kept:
            self.kept.discard(version)
            self._withdrawn()
            if self.store.writer:
                self.store.path(version).unlink(missing_ok=True)

    def forget_before(self, version: int) -> None:
        """Versions older than `version` are needed by no later batch or reference."""
        self.store.delete_before(version)
        self.kept = {v for v in self.kept if v >= version}
        self._withdrawn()
        if len(self.kept) > self.pool:
            raise RolloutError(f"rollout.snapshot_pool ({self.pool}): the schedule needs "
                               f"{len(self.kept)} policy versions at once; raise "
                               "rollout.snapshot_pool")

    def _withdrawn(self) -> None:
        if self._watcher is not None:
            kept = set(self.kept)
            self._watcher.withdrawn(lambda v: v in kept)

    # ------------------------------------------------------------------ checkpoint files

    def save_files(self, checkpoint: Path) -> None:
        """Hard links under `<checkpoint>/policy_versions`."""
        if self.store.writer:
            self.store.link_into(Path(checkpoint) / "policy_versions", self.store.versions())

    def load_files(self, checkpoint: Path) -> None:
        """Collective: the checkpoint's versions back into the store (agreed), by the ranks that
        write the store or read it."""
        src = Path(checkpoint) / "policy_versions"
        saved = VersionStore(src, writer=False).versions()

        def restore() -> None:
            if self.reader or self.store.writer:
                self.store.restore_from(src, saved)
        agreed(restore, what="restoring the checkpoint's policy versions")
        self.kept = set(saved)
