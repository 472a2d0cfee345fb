"""This rank's rollout engine as a slot that one user holds at a time.

The trainer builds the slot (with the engine, on a rank that runs one) and hands it to the rollout
stage and the evaluator; the slot is the only way to reach the engine. The batches' units of work
(on the main thread, or generated ahead on the producer's thread) and an evaluation take turns on
it: a unit holds the slot for its generation (`with slot.unit() as engine:`), and an evaluation
borrows it (`with slot.borrowed(version) as engine:`), which loads `version` from the policy
versions and afterwards gives the engine back the version the rollouts left it at, so the rollout
schedule, and a resumed run, see the same engine state as without the evaluation.

The slot also knows the version a checkpoint records as the engine's: the one the schedule left
it at (`held`: what one synchronous engine would hold after the last unit a batch used, the same
on every engine of the replica, however generation ahead or several engines shared the work),
or after a failed batch or evaluation the one it held before (`failed_with`), so that a resume
loads the right weights.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator, Optional

from megapkl.train.agree import agreed
from megapkl.train.policy_versions import PolicyVersions
from megapkl.train.timers import Timers


class EngineSlot:
    def __init__(self, engine: Any, versions: PolicyVersions, *, group: Any = None,
                 shared: bool = False, ahead: bool = False, releases_memory: bool = False,
                 timers: Optional[Timers] = None) -> None:
        """`engine`: None on a rank without one. `group`: the replica's ranks; `shared`: several
        engines generate the replica's groups; `ahead`: units are generated ahead of training;
        `releases_memory`: colocated servers hand their GPU memory to the trainer between
        generations."""
        self.engine, self.versions, self.group = engine, versions, group  # engine: read only
        self.shared, self.ahead, self.releases_memory = shared, ahead, releases_memory
        self.timers = timers or Timers()
        self._lock = threading.Lock()  # one unit of work, or one evaluation, at a time
        self._held: Optional[int] = None
        self._failed, self._before = False, None

    @property
    def has_engine(self) -> bool:
        """Does this rank run an engine?"""
        return self.engine is not None

    @property
    def held(self) -> Optional[int]:
        """The engine's version as the rollout schedule left it (generation ahead aside)."""
        if self.engine is None:
            return None
        return self._held if self.ahead or self.shared else self.engine.version

    def use(self, version: int, timers: Optional[Timers] = None) -> None:
        """Give the engine `version` from the store (nothing if it holds it): a reference to
        the stored file, which the engine reads, never a copy of the weights."""
        if self.engine.version == version:
            return
        with (timers or self.timers)("sync"):
            self.engine.update_weights(self.versions.get(version), version)

    def count_loads(self, versions: Iterable[int]) -> int:
        """A unit took `versions`: the loads one synchronous engine makes for it from the version
        the previous unit left (in `load_order`), the last of which it now holds."""
        order = load_order(versions, self._held)
        loads = sum(a != b for a, b in zip([self._held, *order], order))
        self._held = order[-1]
        return loads

    def make_room(self) -> None:
        """Collective over the replica: colocated SGLang servers take their GPU memory back for a
        generation, so every rank of the replica (any of them may share a GPU with a server)
        hands its cached blocks back first and meets the others before an engine resumes them."""
        if self.releases_memory:
            from megapkl.rollout.sglang.weights import free_cached_memory

            free_cached_memory(self.group)

    @contextlib.contextmanager
    def unit(self) -> Iterator[Any]:
        """The engine for one unit of work, held against other units and evaluations."""
        with self._lock:
            yield self.engine

    @contextlib.contextmanager
    def borrowed(self, version: int) -> Iterator[Any]:
        """The engine at `version`, held against the units of work for the block; afterwards it
        is back at its previous version. Whatever fails in the block or in the way back is
        recorded (`failed_with` the version the rollouts were using) and raised."""
        with self._lock:
            previous, held = self.engine.version, self.held
            try:
                self.use(version)
                yield self.engine
                if previous is not None and previous != version and self.versions.has(previous):
                    self.use(previous)  # back to the rollouts'
                self.engine.idle()  # the way back pushed with no generation after it
            except BaseException:
                self.failed_with(held)
                raise

    def failed_with(self, version: Optional[int]) -> None:
        """After a failure: checkpoints taken from now on record `version` (the one the engine
        held before the failed batch or evaluation) as the engine's, if the store still has it
        (the loop forgets versions the schedule no longer needs at the start of an update); else a
        resume loads what the next batch needs, as the uninterrupted run did."""
        self._failed = True
        self._before = version if self.versions.has(version) else None

    def recorded(self) -> Optional[int]:
        """The engine's version as a checkpoint records it."""
        return self._before if self._failed else self.held

    def load(self, version: Optional[int]) -> None:
        """Collective: the engines load the checkpoint's `version` (a failure is agreed)."""
        if version is not None:
            def load() -> None:  # the trainer trains next: colocated servers hand memory back
                if self.engine is not None:
                    self.use(version)
                    self.engine.idle()
            agreed(load, what=f"loading policy version {version} into the engines")
            self._held = version

    def keep_answers(self) -> None:
        """After a failed batch: the engine keeps what it answered since the batch began, for the
        resumed run (an SGLang engine's answered-groups store)."""
        if self.engine is not None:
            self.engine.keep_answers()

    def interrupt(self) -> None:
        """The engine's calls in flight fail at once (it is about to be closed)."""
        interrupt = getattr(self.engine, "interrupt", None)
        if interrupt is not None:
            interrupt()

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def load_order(versions: Iterable[int], held: Optional[int]) -> list[int]:
    """The versions of a unit in the order an engine takes them: the one it holds first (a refill
    round starts without a reload), then ascending."""
    return sorted(set(versions), key=lambda v: (v != held, v))
