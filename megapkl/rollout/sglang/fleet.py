"""The servers behind an SGLangEngine: their states, the heartbeat, restarts and re-admission.

A worker is `ready` (gets requests), `dead` (failed its heartbeat, crashed, or its URL is answered
by a process that is not the server we admitted: killed and, when we launched it, restarted) or
`stale` (answers, but does not hold the current weights: after a restart, or when it reports
another weight version). Only ready workers get requests; a dead or stale worker is re-admitted
after it has received the current weights (`resync`), and is taken out of / put back into the
router's worker list alongside.

The heartbeat, every `interval_s`, checks each ready worker; `max_failures` misses in a row make
it dead, and any request failure triggers an immediate check of that worker. What a check asks
depends on where the server's memory is, because SGLang answers `/health` and `/health_generate`
with one handler that runs a one-token generation (unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
is false, and it defaults to true):
- holding its memory: `/health_generate`, a real generation, so a hung scheduler fails it even
  when the HTTP server still answers;
- released to the trainer (colocated, `asleep`): the process is alive and `/model_info` answers;
  that route reads the tokenizer manager's fields only and never reaches the scheduler, so
  nothing runs over unmapped weights and KV cache (a generation there would kill the server).
While a weight push holds the fleet lock (an `update_weights_from_disk` can block the scheduler
for minutes, and SGLang's health route then answers 503 after HEALTH_CHECK_TIMEOUT) the heartbeat
skips its probes, and a failed probe that overlapped a push is not counted.
A probe holds its worker's `probe` lock, and the engine holds it to release the memory, so a
release never meets a running health generation (SGLang asserts it is idle).

What each server holds (its weight version, whether its memory is released) is not the fleet's:
it belongs to the fleet's weight owner (weight_state.py), bound once by `bind`, which the fleet
asks which probe a server can take (`asleep`), tells of a restart (`restarted`), asks to resync
a stale server (`resync`), and asks whether a server may be restarted or resynced now
(`may_recover`: a colocated server only while the trainer has handed its GPU memory over, since
SGLang sizes its memory pools from the memory free at its start).

Identity: a worker's `/server_info` `startup_time` (SGLang's tokenizer manager start) is recorded
when it is admitted. A server answering under the URL that started before we launched our process
there, or whose startup time changed, is another process (another job's server on a reused port):
it is never synced, admitted or sent requests.

What the fleet asks of others it takes when made: `stopping` (the run is stopping) as a
constructor argument, and its weight owner once, by `bind`, when the engine that drives it is
made; a fleet used before that raises.

Closing is bounded: `stop_heartbeat` stops the beat, cuts every open connection (a probe or a
resync blocked on a hung server) and interrupts a restart's wait, then joins with a bound.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol
from urllib.parse import quote, urlsplit

from megapkl.parallel.threads import rank_executor, start_thread
from megapkl.rollout.engine import RolloutEngineError
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.launch import (ServerLaunchError, ServerProcess, ServerSpec,
                                           holds_port, wait_healthy)
from megapkl.rollout.sglang.protocol import parse_version, ProtocolError


class EnginesUnavailable(RolloutEngineError):
    """No server could serve for longer than rollout.sglang.no_engine_timeout_s."""


@dataclass
class HealthSettings:
    first_wait_s: float = 0.0
    interval_s: float = 10.0
    timeout_s: float = 30.0
    max_failures: int = 2
    deadline_s: float = 600.0  # a (re)started server must be healthy within this
    no_engine_timeout_s: float = 600.0
    max_restarts: int = 3


@dataclass
class Held:
    """What one server holds, as it last answered (changed by the fleet's weight owner alone)."""

    version: Optional[int] = None  # the weights it took last (None: none since it started)
    released: bool = False  # its GPU memory is handed to the trainer (colocated)


@dataclass
class Worker:
    url: str
    tp: int = 1
    spec: Optional[ServerSpec] = None  # set when megapkl launched it (and may restart it)
    process: Optional[ServerProcess] = None
    state: str = "stale"
    failures: int = 0
    restarts: int = 0
    last_error: str = ""
    identity: Optional[float] = None  # the admitted server's /server_info startup_time
    launched_at: Optional[float] = None  # when we (re)started its process (time.time())
    held: Held = field(default_factory=Held)  # weight_state.py's, per server
    probe: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def log_path(self) -> Optional[Path]:
        return self.spec.log_path if self.spec is not None else None

    def describe(self) -> str:
        log = f", log {self.log_path}" if self.log_path else ""
        err = f": {self.last_error}" if self.last_error else ""
        return f"{self.url} ({self.state}{log}){err}"


class WeightOwner(Protocol):
    """What the fleet asks of the owner of its servers' weights (weight_state.py)."""

    version: Optional[int]  # the version every ready server holds (None: none pushed yet)

    def asleep(self, w: Worker) -> bool: ...  # its memory is handed to the trainer
    def restarted(self, w: Worker) -> None: ...  # a fresh server: nothing released, no weights
    def resync(self, workers: list[Worker]) -> None: ...  # push the current weights to these
    def may_recover(self) -> bool: ...  # restarts and resyncs may run now


@dataclass
class Fleet:
    workers: list[Worker]
    health: HealthSettings = field(default_factory=HealthSettings)
    router_url: Optional[str] = None
    router: Optional[ServerProcess] = None  # the router process, when megapkl launched it
    stopping: Callable[[], bool] = lambda: False  # the run is stopping (EngineContext.stopping)
    # the servers run --enable-deterministic-inference: they draw from sampling_seed alone
    deterministic: bool = False
    connections: http.Connections = field(default_factory=http.Connections)

    def __post_init__(self) -> None:
        self.lock = threading.RLock()  # held by syncs, re-admissions and state changes
        self._owner: Optional[WeightOwner] = None
        self._rr = 0
        self._pushes = 0  # bumped when a weight push takes the lock and when it leaves it
        self._stop = threading.Event()
        self._wake = threading.Event()  # a beat now (the owner allows recoveries again)
        self._thread: Optional[threading.Thread] = None
        self._recovering = 0  # restarts and resyncs under way (`wait_recoveries`)
        self._recovered = threading.Condition(self.lock)
        # Restarted servers are started by a thread of the fleet's that ends after they are
        # stopped: Linux sends a server its parent-death signal (launch.py) when the *thread*
        # that started it ends, so one started by the heartbeat would be SIGKILLed, its process
        # group left behind, the moment the heartbeat stops.
        self._launcher: Optional[ThreadPoolExecutor] = None
        self.events: list[tuple[float, str, str]] = []  # (time, url, what) for logs and tests

    def bind(self, owner: WeightOwner) -> None:
        """Take the owner of the servers' weights (once: one engine per fleet)."""
        if self._owner is not None:
            raise RolloutEngineError("the SGLang fleet is bound to an engine already; build a "
                                     "fleet per engine")
        self._owner = owner

    @property
    def owner(self) -> WeightOwner:
        if self._owner is None:
            raise RolloutEngineError("the SGLang fleet is used before an engine bound its weight "
                                     "owner (SGLangEngine(fleet, ...) binds it)")
        return self._owner

    @property
    def version(self) -> Optional[int]:
        """The version every ready server holds (the owner's; None before the first push)."""
        return self._owner.version if self._owner is not None else None

    # ------------------------------------------------------------------ states
    def ready(self) -> list[Worker]:
        return [w for w in self.workers if w.state == "ready"]

    def _event(self, w: Worker, what: str) -> None:
        self.events.append((time.time(), w.url, what))

    def by_url(self, url: str) -> Optional[Worker]:
        return next((w for w in self.workers if w.url == url), None)

    def admit(self, workers: list[Worker]) -> None:
        """Mark freshly synced workers ready and put them (back) behind the router."""
        with self.lock:
            for w in workers:
                w.state, w.failures, w.last_error = "ready", 0, ""
                self._router_call("add_worker", w)
                self._event(w, "ready")

    def retire(self, w: Worker, state: str, reason: str) -> None:
        """Stop giving `w` requests: out of the router, its open requests cut."""
        with self.lock:
            if w.state == state:
                return
            w.state, w.last_error = state, reason
            self._event(w, f"{state}: {reason}")
            self._router_call("remove_worker", w)
        self.connections.cut(w.url)

    def _router_call(self, op: str, w: Worker) -> None:
        """sglang-router's worker API: POST /workers {url}; DELETE /workers/{id} (id from GET).
        The router runs both as jobs of its own, and its add probes the server's /health, which
        on SGLang is a generation: one that lands while a colocated server has released its
        memory ends that server. So a worker the router lists already is not added again (each
        push admits its targets), and the call returns once the router lists the worker (add)
        or no longer does (remove), its job and probe over."""
        if self.router_url is None:
            return
        t = self.health.timeout_s
        try:
            listed = self._router_workers()
            if (w.url in listed) == (op == "add_worker"):
                return
            if op == "add_worker":
                http.request(self.router_url, "/workers", {"url": w.url}, method="POST", timeout=t)
            else:
                http.request(self.router_url, f"/workers/{quote(listed[w.url], safe='')}",
                             method="DELETE", timeout=t)
            deadline = time.monotonic() + t
            while (w.url in self._router_workers()) != (op == "add_worker"):
                if time.monotonic() > deadline:
                    self._event(w, f"router {op}: not done after {t:.0f} s")
                    return
                time.sleep(0.01)
        except (http.ServerError, http.ServerUnreachable) as exc:
            self._event(w, f"router {op} failed: {exc}")

    def _router_workers(self) -> dict[str, str]:
        """url -> id of the workers the router lists."""
        listing = http.request(self.router_url, "/workers", method="GET",
                               timeout=self.health.timeout_s)
        return {e["url"]: str(e.get("id") or e.get("worker_id") or e["url"])
                for e in (listing or {}).get("workers", []) if e.get("url")}

    # ------------------------------------------------------------------ request targets
    def pick(self, direct: bool = False) -> str:
        """A base URL for the next /generate (the router's, or a ready worker round robin;
        `direct`: a worker even when there is a router); waits up to no_engine_timeout_s for one,
        then EnginesUnavailable."""
        t0 = time.monotonic()
        while True:
            ready = self.ready()
            if ready:
                if self.router_url is not None and not direct:
                    return self.router_url
                self._rr += 1
                return ready[self._rr % len(ready)].url
            self._give_up_after(t0)
            time.sleep(min(0.2, self.health.interval_s))

    @contextmanager
    def weight_targets(self) -> Iterator[list[Worker]]:
        """Under the fleet lock: the workers that can take weights now (ready ones, and stale ones
        that answer). Like a request, waits up to no_engine_timeout_s for one (a server still
        starting, or slow to answer on a busy machine), then EnginesUnavailable."""
        t0 = time.monotonic()
        while True:
            with self.lock:
                targets = [w for w in self.workers
                           if w.state == "ready" or (w.state == "stale" and self._alive(w))]
                if targets:
                    self._pushes += 1
                    try:
                        yield targets
                    finally:
                        self._pushes += 1
                    return
            self._give_up_after(t0)
            time.sleep(min(0.2, self.health.interval_s))

    def _give_up_after(self, t0: float) -> None:
        """No server for longer than no_engine_timeout_s, or the run is stopping: a stop signal
        or a Slurm preemption reaches the servers launched in the job too, and the trainer must
        reach its checkpoint rather than wait for them."""
        if self.stopping() or self.connections.closed:
            raise self.unavailable(stopping=True)
        if time.monotonic() - t0 > self.health.no_engine_timeout_s:
            raise self.unavailable()

    def unavailable(self, stopping: bool = False) -> EnginesUnavailable:
        lines = "\n  ".join(w.describe() for w in self.workers)
        why = ("no SGLang engine could serve and the run is stopping (a stop signal, a "
               "preemption or the engine's close)" if stopping else f"no SGLang engine could serve for "
               f"{self.health.no_engine_timeout_s:.0f} s (rollout.sglang.no_engine_timeout_s)")
        return EnginesUnavailable(f"{why}; engines:\n  {lines}")

    def report_failure(self, url: str, exc: BaseException) -> None:
        """A request to `url` failed: check that worker now (the router: all of them). Not once
        the connections are closed (the engine is closing: its requests were cut)."""
        if self.connections.closed:
            return
        targets = self.workers if url == self.router_url else [self.by_url(url)]
        for w in targets:
            if w is None or w.state != "ready":
                continue
            pushes = self._pushes
            if not self._alive(w) and not self._in_push(pushes):
                w.failures = self.health.max_failures
                self.declare_dead(w, f"request failed: {exc}")

    def report_stale(self, url: str, version: int) -> None:
        w = self.by_url(url)
        if w is not None:
            self.retire(w, "stale", f"answered with weight version {version}, "
                                    f"current is {self.version}")

    # ------------------------------------------------------------------ heartbeat
    def _alive(self, w: Worker) -> bool:
        """Process alive and a probe answered: a one-token generation while the server holds its
        memory; while released, `/model_info`, which SGLang serves from the tokenizer manager
        alone (SGLang's `/health` generates too, see the module docstring)."""
        if w.process is not None and not w.process.alive():
            return False
        with w.probe:
            route = "model_info" if self.owner.asleep(w) else "health_generate"
            try:
                http.request(w.url, route, timeout=self.health.timeout_s,
                             connections=self.connections)
                return True
            except (http.ServerUnreachable, http.ServerError):
                return False

    def _in_push(self, pushes_before: int) -> bool:
        """A weight push ran during a probe begun at `pushes_before`, or runs now: a scheduler
        blocked in a load answers SGLang's health route with 503, which says nothing about it."""
        if self._pushes != pushes_before:
            return True
        if not self.lock.acquire(blocking=False):
            return True
        self.lock.release()
        return False

    def foreign(self, w: Worker) -> Optional[str]:
        """Why the server answering at `w.url` is not the one we admitted (or launched), or None.
        Read from `/server_info` `startup_time`; a server that does not report one (or does not
        answer) is judged by the liveness probes instead."""
        try:
            info = http.request(w.url, "server_info", timeout=self.health.timeout_s)
        except (http.ServerUnreachable, http.ServerError):
            return None
        started = info.get("startup_time") if isinstance(info, dict) else None
        if not isinstance(started, (int, float)) or isinstance(started, bool):
            return None
        if w.launched_at is not None and started < w.launched_at - 1.0:
            return (f"another process answers at {w.url}: it started at {started:.0f}, before "
                    f"megapkl launched engine{w.spec.index if w.spec else ''} there "
                    f"({w.launched_at:.0f}); the port is taken")
        if w.identity is not None and started != w.identity:
            return (f"another server answers at {w.url} (startup_time {started} != {w.identity} "
                    f"when admitted); it is not synced or sent requests")
        w.identity = started
        return None

    def server_version(self, w: Worker) -> Optional[int]:
        try:
            info = http.request(w.url, "model_info", timeout=self.health.timeout_s)
            return parse_version(info) if isinstance(info, dict) else None
        except (http.ServerUnreachable, http.ServerError, ProtocolError):
            return None

    def beat(self) -> None:
        """One heartbeat over every worker (the loop calls it every interval_s)."""
        for w in list(self.workers):
            if self._stop.is_set():
                return
            if w.state == "ready":
                self._check_ready(w)
            if w.state in ("dead", "stale"):
                self._recover(w)

    def _check_ready(self, w: Worker) -> None:
        pushes = self._pushes
        if self._in_push(pushes):
            return  # a push holds the fleet lock: its own errors say what failed
        if self._alive(w):
            w.failures = 0
            why = self.foreign(w)
            if why is not None:
                self.declare_dead(w, why)
                return
            v = self.server_version(w)
            if self._in_push(pushes):
                return  # the version read and the fleet's may straddle a push: next beat
            if self.version is not None and v is not None and v != self.version:
                self.retire(w, "stale", f"reports weight version {v}, current is "
                                        f"{self.version} (restarted?)")
        elif not self._in_push(pushes):
            w.failures += 1
            if w.failures >= self.health.max_failures:
                self.declare_dead(w, f"{w.failures} failed health checks")

    def declare_dead(self, w: Worker, reason: str) -> None:
        """Stop giving `w` requests and, when we launched it, kill it (even when hung: SIGKILL
        works on SIGSTOP); the heartbeat restarts it when recoveries are allowed."""
        self.retire(w, "dead", reason)
        if w.process is not None:
            w.process.stop(grace_s=1.0)


    def _recover(self, w: Worker) -> None:
        """Restart a dead worker we launched; re-admit a worker once it holds the current weights.
        Only while the owner allows it (a colocated server: while the trainer's memory is handed
        over), counted in `_recovering` for `wait_recoveries`."""
        if self.stopping() or self._stop.is_set():  # (a beat still running when the fleet closes)
            return
        with self.lock:
            if not self.owner.may_recover():
                return
            self._recovering += 1
        try:
            self._recover_now(w)
        finally:
            with self.lock:
                self._recovering -= 1
                self._recovered.notify_all()

    def wait_recoveries(self) -> None:
        """Until no restart or resync is under way (the owner stopped allowing new ones first).
        Bounded by the restart's own deadline; the heartbeat's stop interrupts it."""
        with self._recovered:
            self._recovered.wait_for(lambda: self._recovering == 0 or self._stop.is_set())

    def _recover_now(self, w: Worker) -> None:
        if w.state == "stale" and w.process is not None and not w.process.alive():
            # ours, gone while it waited for weights (e.g. killed by its resync's resume)
            self.declare_dead(w, f"exited with code {w.process.popen.returncode} while stale")
        if w.state == "dead":
            if w.spec is not None:
                if w.restarts >= self.health.max_restarts or self.stopping() or \
                        self._stop.is_set():  # (a beat still running when the fleet closes)
                    return
                w.restarts += 1
                self._event(w, f"restart {w.restarts}")
                self.owner.restarted(w)  # a fresh server: nothing released, no weights
                w.launched_at, w.identity = time.time(), None
                w.process = self._start(w.spec)
                try:
                    wait_healthy(w.process, w.url, first_wait_s=self.health.first_wait_s,
                                 interval_s=min(self.health.interval_s, 1.0),
                                 timeout_s=self.health.timeout_s,
                                 deadline_s=self.health.deadline_s,
                                 what=f"engine{w.spec.index}", stop=self._stop.is_set)
                except ServerLaunchError as exc:
                    w.last_error = str(exc).splitlines()[0]
                    w.process.stop(grace_s=1.0)
                    return
                if self._lost_port(w):
                    return
            elif not self._alive(w):
                return
            elif (why := self.foreign(w)) is not None:
                w.last_error = why  # not ours to restart: a foreign process there stays dead
                return
            w.state = "stale"
            self._event(w, "stale: back, waiting for weights")
        if w.state == "stale" and not self._stop.is_set() and self._alive(w):
            why = self.foreign(w)
            if why is not None:
                self.declare_dead(w, why)
                return
            with self.lock:
                if self.version is None or w.state != "stale":
                    return  # (an engine-wide push may have admitted it meanwhile)
                try:
                    self.owner.resync([w])
                except Exception as exc:  # noqa: BLE001 - stays stale, retried next beat
                    w.last_error = f"resync failed: {exc}"
                    self._event(w, w.last_error)
                    return
                self.admit([w])

    def _lost_port(self, w: Worker) -> bool:
        """The restarted server's URL is answered by another process of this host (one that
        took the port while ours was dead): ours is stopped, and it stays dead, retried by
        the next beat."""
        parts = urlsplit(w.url)
        if not http.is_loopback(parts.hostname or "") or \
                holds_port(w.process, parts.port or 80) is not False:
            return False
        w.last_error = f"another process listens on {w.url}: the restarted server lost its port"
        self._event(w, w.last_error)
        w.process.stop(grace_s=1.0)
        return True

    def _start(self, spec: ServerSpec) -> ServerProcess:
        if self._launcher is None:
            self._launcher = rank_executor(1, "sglang-launcher")
        return self._launcher.submit(lambda: spec.process().start()).result()

    def start_heartbeat(self) -> None:
        _ = self.owner  # raises on an unbound fleet, whose every beat would fail
        if self._thread is None:
            self._thread = start_thread(self._loop, name="sglang-heartbeat")

    def wake(self) -> None:
        """A beat now rather than at the next interval (the owner allows recoveries again)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.health.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive one bad beat
                self.events.append((time.time(), "-", f"heartbeat error: {exc}"))

    def stop_heartbeat(self, bound_s: float = 10.0) -> None:
        """On the way out (the engine's close): no new beat (and so no resync or restart) starts
        once this returns. Every open connection is cut and every later request through them
        fails at once (a beat blocked on a hung server is released), a restart's wait is
        interrupted, and the thread is joined for at most `bound_s` (a daemon: one still inside
        a call nothing can interrupt is left behind, and says so in the fleet's events)."""
        self._stop.set()
        self._wake.set()
        self.connections.close()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=bound_s)
        if thread.is_alive():
            self.events.append((time.time(), "-", f"heartbeat still busy {bound_s:.0f} s after "
                                                  "its stop: left behind"))
        with self._recovered:
            self._recovered.notify_all()

    def close(self) -> None:
        """The heartbeat stopped, the servers and the router megapkl launched stopped."""
        self.stop_heartbeat()
        for w in self.workers:
            if w.process is not None:
                w.process.stop()
        if self.router is not None:
            self.router.stop()
        if self._launcher is not None:  # the restarted servers' parent thread, after them
            self._launcher.shutdown(wait=True)
