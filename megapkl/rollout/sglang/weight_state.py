"""The one owner of what the servers of a fleet hold: the fleet's current weights and version, and
per server (`Worker.held`) the version it took last and whether its GPU memory is released. Every
change of it is made here, under the fleet's lock; the weight sync is a stateless push it drives
(weights.py), and the fleet (fleet.py) asks it the questions of `WeightOwner`.

Colocated servers (rollout.sglang.colocate, launched by megapkl) share the trainer's GPUs and take
turns with it: a server holds its memory only while the trainer has handed it over, between
`hold` (before a generation or a push) and `release` (after the generation, and whenever the
trainer takes the GPU back: `SGLangEngine.idle`). Three rules follow from SGLang's code:

- SGLang sizes its KV cache from the GPU memory free when it starts (`mem_fraction_static` of
  it), so a colocated server is restarted or resynced only inside that window (`may_recover`),
  and `release` waits for a restart under way and releases the restarted server too: the trainer
  never trains beside a server that holds memory.
- A release or resume is kept per server, exactly as the server answered: one that failed stays
  as it was, and nothing is asked of the others because of it. SGLang's resume of memory that is
  not released raises in its scheduler (`offload_tags.remove`), which ends the server; so does
  a generation over released memory. A server whose release or resume failed holds memory in an
  unknown state: it is declared dead (killed, restarted in the next window).
- SGLang asserts an idle scheduler on a release (and its assertion ends the server): before each
  release the server is made idle (`WeightSync.make_idle`: an aborting pause, then a flush, which
  SGLang performs only under the same idle test), then generation is let continue.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from torch import Tensor

from megapkl.parallel.threads import rank_executor
from megapkl.rollout.engine import WeightUpdateError
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.fleet import Fleet, Held, Worker
from megapkl.rollout.sglang.weights import Target, WeightSync, free_cached_memory, pin_version
from megapkl.rollout.version_store import StoredVersion

_CALL_ERRORS = (http.ServerError, http.ServerUnreachable)


class WeightState:
    """Owner of the fleet's weights; binds itself to `fleet` (its `WeightOwner`).

    Args:
        fleet: the servers; its lock is this state's lock.
        sync: the push (mode, buckets, pause mode, transform).
        colocate: the servers release their GPU memory to the trainer between generations.
        export_dir, hf_config: where a stored version is pinned (with the config.json a disk
            load reads); None: stored versions are held as they are.
        free_memory: run before any resume (the trainer's cached blocks handed back first).
    """

    def __init__(self, fleet: Fleet, sync: WeightSync, *, colocate: bool = False,
                 export_dir: Optional[Path] = None, hf_config: Optional[dict] = None,
                 free_memory: Callable[[], None] = free_cached_memory) -> None:
        self.fleet, self.sync, self.colocate = fleet, sync, colocate
        self.export_dir, self.hf_config, self.free_memory = export_dir, hf_config, free_memory
        self.lock = fleet.lock
        self.version: Optional[int] = None  # what every ready server holds
        self.weights: Any = None  # the same, for the servers that come back (list or pinned)
        self.window = False  # colocated: the trainer's GPU memory is handed over
        fleet.bind(self)

    # ------------------------------------------------------------------ the fleet's questions
    def asleep(self, w: Worker) -> bool:
        return w.held.released

    def restarted(self, w: Worker) -> None:
        with self.lock:
            w.held = Held()

    def may_recover(self) -> bool:
        return not self.colocate or self.window

    def resync(self, workers: list[Worker]) -> None:
        """Push the current weights to `workers` (a released one resumed first); raises when
        there is nothing to push or a worker could not take them."""
        with self.lock:
            if self.weights is None or self.version is None:
                raise WeightUpdateError("no weights to resync yet")
            self._resume([w for w in workers if w.held.released])
            lost = [w.url for w in workers if w.state == "dead"]
            if lost:
                raise WeightUpdateError(f"{', '.join(lost)} failed to take its memory back")
            self.sync.push([target(w) for w in workers], self.weights, self.version)
            for w in workers:
                w.held.version = self.version

    # ------------------------------------------------------------------ the engine's calls
    def push(self, named_tensors: Iterable[tuple[str, Tensor]] | StoredVersion,
             version: int) -> None:
        """Every server that can take weights now (ready ones, and stale ones that answer) gets
        `named_tensors` at `version` and is admitted; dead ones get them when they come back.
        If every target dies during the sync, the weights are still the fleet's: the restarted
        servers are resynced with them. Colocated: the targets' memory comes back first; a push
        that fails hands it to the trainer again when it took it. The window opens before the
        wait for a target: servers that died while the trainer trained are restarted in it."""
        opened = False
        try:
            if self.colocate:
                with self.lock:
                    opened, self.window = not self.window, True
                self.fleet.wake()
            with self.fleet.weight_targets() as targets:
                weights = named_tensors
                if isinstance(named_tensors, StoredVersion):  # under the lock: pinning lets the
                    # held version's file go, which a resync (also under it) may be reading
                    weights = pin_version(named_tensors, self.export_dir, self.hf_config)
                self._push(targets, weights, version)
        except BaseException:
            if opened:
                self.release()
            raise

    def _push(self, targets: list[Worker], weights: Any, version: int) -> None:
        while targets:
            self._resume([w for w in targets if w.held.released])
            targets = [w for w in targets if w.state != "dead"]
            if not targets:
                break
            try:
                self.sync.push([target(w) for w in targets], weights, version)
                break
            except WeightUpdateError as exc:
                dead = exc.unreachable
                if dead is None or self.fleet.by_url(dead) not in targets:
                    raise
                # A server died during the sync: it gets these weights when it is back;
                # the others get them now (again, from the start: all or nothing per server).
                self.fleet.report_failure(dead, exc)
                w = self.fleet.by_url(dead)
                if w.state == "ready":  # answers again, but missed this version
                    self.fleet.retire(w, "stale", f"missed the sync to version {version}")
                targets = [w for w in targets if w.url != dead and w.state != "dead"]
        for w in targets:
            w.held.version = version
        self.weights, self.version = weights, version
        self.fleet.admit(targets)

    def hold(self) -> None:
        """Colocated: the trainer's memory is handed over (a generation follows): the ready
        servers take theirs back, and restarts and resyncs may run (the heartbeat is woken)."""
        if not self.colocate or self.fleet.connections.closed:  # (closing: nothing to serve)
            return
        with self.lock:
            self.window = True
            self._resume([w for w in self.fleet.ready() if w.held.released])
        self.fleet.wake()

    def release(self) -> None:
        """Colocated: the trainer takes its GPU back. No restart or resync starts from now on; one
        under way ends first (its deadline bounds it); then every live server that holds its
        memory, ready or waiting for weights, is made idle and releases it."""
        if not self.colocate:
            return
        with self.lock:
            self.window = False
        if self.fleet.connections.closed:
            return  # the engine is closing: its close stops the servers
        self.fleet.wait_recoveries()
        with self.lock:
            holding = [w for w in self.fleet.workers if not w.held.released
                       and w.state != "dead" and (w.process is None or w.process.alive())]
            with ExitStack() as probes:  # not while a heartbeat's /health_generate runs
                for w in holding:
                    probes.enter_context(w.probe)
                failed = self._each(holding, self._release_one)
            for w in holding:
                if w.url in failed:
                    self.fleet.declare_dead(w, f"its memory could not be released: "
                                               f"{failed[w.url]}")
                else:
                    w.held.released = True

    # ------------------------------------------------------------------ per server
    def _release_one(self, w: Worker) -> None:
        t = self.fleet.health.timeout_s
        self.sync.make_idle(w.url, timeout_s=t)
        try:
            self.sync.call(w.url, "release_memory_occupation")
        finally:
            self.sync.call(w.url, "continue_generation", timeout_s=t)

    def _resume(self, workers: list[Worker]) -> None:
        """Under the lock: `workers` (released ones) take their memory back, the trainer's cached
        blocks freed first. Kept per server as it answered; one that failed is declared dead."""
        if not workers:
            return
        self.free_memory()
        failed = self._each(workers, lambda w: self.sync.call(w.url, "resume_memory_occupation"))
        for w in workers:
            if w.url in failed:
                self.fleet.declare_dead(w, f"its memory could not be resumed: {failed[w.url]}")
            else:
                w.held.released = False

    @staticmethod
    def _each(workers: list[Worker], fn: Callable[[Worker], Any]) -> dict[str, BaseException]:
        """`fn(w)` for every worker at once; url -> what its call raised (calls' errors only)."""
        failed: dict[str, BaseException] = {}

        def one(w: Worker) -> None:
            try:
                fn(w)
            except _CALL_ERRORS as exc:
                failed[w.url] = exc
        if len(workers) == 1:
            one(workers[0])
        elif workers:
            with rank_executor(len(workers), "megapkl-memory") as pool:
                for f in [pool.submit(one, w) for w in workers]:
                    f.result()
        return failed


def target(w: Worker) -> Target:
    return Target(w.url, w.tp, w.restarts)
