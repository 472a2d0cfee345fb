"""A failure no agreement covers: one rank raised between collectives while its peers wait in one.

The sections of an update that run rank-local work are agreed (megapkl.train.agree); the work that
is itself made of collectives (the training step, a weight export, megatron's checkpoint writes)
cannot be: a rank that raises inside it leaves its peers in a collective it will never join. Such
a failure is told out of band, through the store every rank already shares (the one that started
torch.distributed):

- the failing rank publishes one record (its rank, the update, the error, the newest checkpoint)
  before it leaves, and waits a moment for the others to have read it (rank 0 may host the store);
- every rank runs a watcher thread that polls for the record and keeps it; with NCCL it then aborts
  this rank's communicators, so a collective waiting for the failed rank raises at once (gloo has no
  abort: its collective raises when the failed rank's process ends and its connections close).
  The abort runs only under an NCCL error handling mode that does not tear the process down
  (megapkl.parallel.groups: CleanUpOnly, which megapkl sets, or NoHandling): under TearDown or
  SkipCleanUp the watchdog would rethrow the aborted work's error in its own thread and end the
  process before its line; there the peers are ended by the watchdog at the (shortened) timeout;
- a rank whose run then raises (its own collective, broken) raises the published record instead:
  every rank stops with the same line, naming the rank and the error, within seconds.

Nothing is checkpointed on that path: the collective that broke cannot be finished (its partners
are gone) or restarted (megatron's groups, the DDP buffers and the distributed optimizer hold the
aborted communicators), and a failure inside the optimizer step leaves the weights half updated.
The line names the newest checkpoint, which is intact.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from megapkl.errors import MegapklError
from megapkl.parallel.dist_internals import abort_process_groups, default_store
from megapkl.parallel.groups import mark_out_of_step
from megapkl.parallel.threads import start_thread

KEY = "megapkl/failure"
POLL_S = 0.25     # the watcher's period: a peer knows within this of the record (one small store
                  # request per rank: light on the store's host at a thousand ranks too)
LINGER_S = 3.0    # the failing rank waits at most this for the others to have read the record


class FailedOutsideAgreement(MegapklError):
    """Raised on every rank, with the same line, when one rank failed outside an agreement."""


def raised_on_every_rank(exc: BaseException) -> bool:
    """An exception every rank raises alike: marked so by the agreement that raised it (or by the
    decision every rank takes from agreed data: a global loss, a requeue; megapkl.train.agree.
    every_rank). No notice is needed, and none may interrupt the collectives its path still
    runs. Anything else, whatever its type, was raised on this rank alone as far as anyone
    knows (a CheckpointError inside megatron's collective load, a second Ctrl-C on one rank):
    the others are told."""
    return bool(getattr(exc, "every_rank", False))


def may_abort() -> bool:
    """Can this process abort its NCCL groups without the watchdog ending it: an error handling
    mode that does not tear down (0 NoHandling, 2 CleanUpOnly; megapkl.parallel.groups)?"""
    from megapkl.parallel.groups import nccl_error_handling

    return nccl_error_handling() in (0, 2)


def broken_collective(exc: BaseException) -> bool:
    """`exc` came out of a collective whose partner left (gloo's closed connection, an aborted
    or failed NCCL communicator): another rank's failure, most likely, not this rank's."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("gloo", "Connection closed", "NCCL", "ProcessGroup"))


class FailureNotice:
    """The watcher and the record of one run, for this rank (held by the run context)."""

    def __init__(self, store: Any, rank: int, world: int, abort: bool) -> None:
        self.store, self.rank, self.world, self.abort = store, rank, world, abort
        self.record: Optional[dict] = None  # another rank's record, once seen
        self._stop = threading.Event()
        self._thread = start_thread(self._watch, name="megapkl-failure-watch")

    @classmethod
    def start(cls) -> Optional["FailureNotice"]:
        """The notice of this process's world (None alone or without torch.distributed)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        store = default_store()
        nccl = "nccl" in str(dist.get_backend())  # also "cpu:gloo,cuda:nccl"
        return cls(store, dist.get_rank(), dist.get_world_size(), abort=nccl and may_abort())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the watcher

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                record = self._read()
            except Exception:  # noqa: BLE001 - the store's host left: nothing more to learn
                return
            if record is None:
                continue
            if record["rank"] == self.rank:
                return
            self.record = record
            try:
                self.store.add(f"{KEY}/read", 1)
            except Exception:  # noqa: BLE001 - the failed rank may have left with the store
                pass
            if self.abort:  # NCCL: the collective waiting for the failed rank raises now
                abort_process_groups()
            return

    # ------------------------------------------------------------------ the run's exit

    def failed(self, exc: BaseException, update: int, checkpoint: Optional[str]
               ) -> BaseException:
        """What this rank raises for `exc`, raised after `update` finished updates, with
        `checkpoint` the newest complete one: another rank's published failure (this
        rank's error came from a broken collective), `exc` itself when every rank raises it
        alike, else this rank's own failure, published first."""
        # a collective that broke under this rank: the rank that caused it is publishing
        other = self._other(wait_s=LINGER_S if broken_collective(exc) else 0.0)
        if other is not None:
            return self._raise(other)
        if raised_on_every_rank(exc):
            return exc
        from megapkl.train.agree import one_line

        mine = {"rank": self.rank, "update": update, "checkpoint": checkpoint,
                "error": f"{type(exc).__name__}: {one_line(str(exc)) or type(exc).__name__}"}
        try:
            if self.store.add(f"{KEY}/claims", 1) == 1:  # the first failure is the one told
                self.store.set(KEY, json.dumps(mine))
                self._linger()
                return self._raise(mine)
        except Exception:  # noqa: BLE001 - no store: this rank's line alone
            return self._raise(mine)
        return self._raise(self._other(wait_s=LINGER_S) or mine)

    def _other(self, wait_s: float) -> Optional[dict]:
        """Another rank's record: the watcher's, or read now (waiting up to `wait_s` for it)."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.record is not None:
                return self.record
            try:
                record = self._read()
            except Exception:  # noqa: BLE001 - the store's host left
                return None
            if record is not None and record["rank"] != self.rank:
                return record
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S / 2)

    def _read(self) -> Optional[dict]:
        """The published record (any rank's), or None while there is none."""
        return json.loads(self.store.get(KEY)) if self.store.check([KEY]) else None

    def _linger(self) -> None:
        """Until every other rank's watcher has read the record (or LINGER_S): this process may
        host the store, which leaves with it."""
        deadline = time.monotonic() + LINGER_S
        try:
            while time.monotonic() < deadline and \
                    self.store.add(f"{KEY}/read", 0) < self.world - 1:
                time.sleep(POLL_S / 2)
        except Exception:  # noqa: BLE001 - the store's host left: nobody else can read it now
            pass

    def _raise(self, record: dict) -> FailedOutsideAgreement:
        mark_out_of_step()
        kept = record.get("checkpoint")
        saved = (f"the previous checkpoint {kept} is intact" if kept else
                 "no checkpoint was written before it")
        return FailedOutsideAgreement(
            f"rank {record['rank']} failed outside an agreement after {record['update']} "
            f"finished update(s): {record['error']}; every rank left its collectives, so the "
            f"updates after the newest checkpoint were not saved: {saved}")
