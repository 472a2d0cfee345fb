"""Generation ahead of training (rollout.async_batches), on a replica leader.

The rollout stage names the units of work the coming batches will ask for -- (batch, draw round,
[(dataset index, group slot, policy version)]) -- as soon as it can know them (after a batch's
last draw, the prompt iterator says which prompts the next batches draw). A thread works through
them in order, each as soon as every version it names is published, while the trainer trains; the
stage takes a unit's result when its batch comes. A unit is a pure function of its key (seeded
sampling at exactly the named versions), so a result taken from here is the one the synchronous run
computes; a key nobody asked for (the forecast was wrong: a batch drew refill rounds) is dropped,
and the stage generates what it needs itself.

The engine does one unit at a time (the stage's engine lock, which an evaluation holds too): the
weights a unit loads are pushed between generations, never during one, so no request mixes versions.
A failed unit (an exception escaping the work too) stops the thread; its error reaches the trainer
when that batch is taken. The run stops the thread on every exit (RunContext), before the engine
closes.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Iterable, Optional

from megapkl.parallel.threads import start_thread

Key = Hashable
STOP_BOUND_S = 10.0  # how long `stop` waits for the thread once its unit was interrupted


class Producer:
    """`work(key)` -> result (`failed(result)` says whether it failed; an exception escaping
    `work` becomes `on_error(exc)`, a failed result); `versions(key)`: the policy versions the unit
    needs, which must be `published` before it starts. The producer keeps its own set of published
    versions (the main thread tells it), so the thread never reads the stage's state."""

    def __init__(self, work: Callable[[Key], Any], versions: Callable[[Key], Iterable[int]],
                 failed: Callable[[Any], bool], on_error: Callable[[BaseException], Any],
                 published: Iterable[int] = ()) -> None:
        self._work, self._versions, self._failed_result = work, versions, failed
        self._on_error = on_error
        self._cond = threading.Condition()
        self._published: set[int] = set(published)
        self._plan: list[Key] = []        # wanted and not started, in order
        self._busy: Optional[Key] = None  # in progress
        self._done: dict[Key, Any] = {}   # finished, not yet taken
        self._stopped = self._failed = False
        self._alive = True                # the thread has not ended
        self._thread = start_thread(self._loop, name="megapkl-rollout-producer")

    def plan(self, keys: Iterable[Key]) -> None:
        """The units the coming batches will ask for, in order (replaces the previous plan)."""
        keys = list(keys)
        with self._cond:
            self._plan = [k for k in keys if k not in self._done and k != self._busy]
            wanted = set(keys)
            self._done = {k: r for k, r in self._done.items() if k in wanted}
            self._cond.notify_all()

    def published(self, version: int) -> None:
        """`version` is in the store: a waiting unit may start."""
        with self._cond:
            self._published.add(version)
            self._cond.notify_all()

    def withdrawn(self, keep: Callable[[int], bool]) -> None:
        """Versions no longer in the store: those for which `keep(version)` is false."""
        with self._cond:
            self._published = {v for v in self._published if keep(v)}

    def _ready(self, key: Key) -> bool:  # under self._cond
        return all(v in self._published for v in self._versions(key))

    def take(self, key: Key) -> Optional[Any]:
        """The result of `key` (waiting, while the thread runs, for a unit in progress or next and
        startable), or None when it was not planned or cannot start: the caller generates it.
        Forgets what the plan held before `key`."""
        with self._cond:
            if key in self._plan:
                del self._plan[: self._plan.index(key)]
            while key not in self._done and not self._stopped and self._alive and (
                    self._busy == key or (self._plan[:1] == [key] and not self._failed
                                          and self._ready(key))):
                self._cond.wait()
            if key in self._done:
                return self._done.pop(key)
            self._plan.clear()
            return None

    def stop(self, interrupt: Optional[Callable[[], None]] = None,
             bound_s: float = STOP_BOUND_S) -> bool:
        """No more units. A unit in progress is cut short by `interrupt()` (the engine fails its
        calls in flight at once: it is about to be closed), then the thread is joined for at most
        `bound_s`: True when it has ended. A thread still inside something nothing interrupts is
        left behind (a daemon), and the run goes on to its end."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            busy = self._busy is not None
        if self._thread is threading.current_thread():
            return False
        if busy and interrupt is not None:
            interrupt()
        self._thread.join(timeout=bound_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopped and not (
                            self._plan and not self._failed and self._ready(self._plan[0])):
                        self._cond.wait()
                    if self._stopped:
                        return
                    key = self._busy = self._plan.pop(0)
                try:
                    result = self._work(key)
                except BaseException as exc:  # noqa: BLE001 - the unit's failed result
                    result = self._on_error(exc)
                with self._cond:
                    self._done[key] = result
                    self._failed = self._failed or self._failed_result(result)
                    self._busy = None
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._busy, self._alive = None, False
                self._cond.notify_all()
