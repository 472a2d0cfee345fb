"""Real processes for the SGLang-protocol tests: `megapkl serve` workers and the real sglang-router.

    from sglang_fixtures import ServeCluster, start_worker, free_port   # plain helpers
    def test_x(serve_cluster):            # fixture: 2 tiny-qwen3 workers + round-robin router
        serve_cluster.router_url, serve_cluster.worker_urls
    def test_y(make_serve_cluster):       # factory: your own model / options, torn down after
        cluster = make_serve_cluster(num_workers=2, model_config="tiny-qwen3-moe",
                                     worker_args=["--enable-return-routed-experts"])

Every process starts in its own session and is killed as a process group (SIGTERM, then SIGKILL)
when the cluster closes, also when a test fails or the start itself fails, so nothing outlives
the test. Logs go to files under the test's tmp_path (`cluster.logs`), and a failure to become
healthy raises with the tail of the log.

Import this module from a test file in tests/rollout (that directory is on sys.path through its
conftest) and bring the fixtures into the test module by name:
`from sglang_fixtures import make_serve_cluster, serve_cluster  # noqa: F401`.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
START_TIMEOUT = float(os.environ.get("MEGAPKL_SERVE_START_TIMEOUT", "240"))  # loaded CI cores


class Owner:
    """The weight owner of a fleet under test alone (the engine binds its WeightState): the
    version every ready server should hold, which servers sleep, and the resyncs asked of it."""

    def __init__(self, version=None, asleep=lambda w: False, recover=True):
        self.version, self._asleep, self.recover = version, asleep, recover
        self.resynced: list = []

    def asleep(self, w) -> bool:
        return self._asleep(w)

    def restarted(self, w) -> None:
        pass

    def resync(self, workers) -> None:
        self.resynced.append(workers)

    def may_recover(self) -> bool:
        return self.recover


# A server under test binds its port seconds after the port was found free (after its model
# load). A port of the kernel's ephemeral range can be taken meanwhile by any outgoing connection
# of the other pytest worker (CI saw "Address already in use"), so test servers take ports below
# that range, from a band of their own per pytest-xdist worker, below the fleets' default
# base_port (30000; the product moves a fleet whose port is taken). Ports are handed out PORT_STEP
# apart: a port given as a fleet's base_port is followed by its engines' ports.
PORT_BAND, PORT_STEP, PORT_BANDS_START, PORT_BANDS_END = 2000, 20, 12000, 30000
# another process of the same worker (rare) starts elsewhere in the band
_offsets = itertools.count(os.getpid() % 10 * (PORT_BAND // 10), PORT_STEP)


def _band() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return PORT_BANDS_START + index % ((PORT_BANDS_END - PORT_BANDS_START) // PORT_BAND) * PORT_BAND


def free_port() -> int:
    """A loopback TCP port free right now, outside the ephemeral range, not handed out by this
    process in its last PORT_BAND // PORT_STEP calls (see PORT_BAND)."""
    from megapkl.rollout.sglang.launch import port_free

    band = _band()
    for _ in range(PORT_BAND // PORT_STEP):
        port = band + next(_offsets) % PORT_BAND
        if port_free(HOST, port):
            return port
    raise RuntimeError(f"no free port in {band}..{band + PORT_BAND - 1}")


def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds."""
        if self.popen.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _spawn(name: str, cmd: Sequence[str], log: Path, url: str) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    popen = subprocess.Popen(list(cmd), stdout=handle, stderr=subprocess.STDOUT, cwd=str(REPO),
                             env=env, start_new_session=True)
    handle.close()
    return Proc(name, popen, log, url)


def start_worker(log_dir: Path, *, model_config: str = "tiny-qwen3", port: Optional[int] = None,
                 seed: int = 0, args: Sequence[str] = (), name: str = "worker") -> Proc:
    """One `megapkl serve` process (not yet healthy: call wait_healthy)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "megapkl.cli", "serve", "--model-config", model_config,
           "--host", HOST, "--port", str(port), "--seed", str(seed), "--log-level", "warning",
           *args]
    return _spawn(name, cmd, Path(log_dir) / f"{name}-{port}.log", f"http://{HOST}:{port}")


def start_router(log_dir: Path, worker_urls: Sequence[str], *, port: Optional[int] = None,
                 policy: str = "round_robin", args: Sequence[str] = ()) -> Proc:
    """The real sglang-router (`python -m sglang_router.launch_router`) in front of workers."""
    port = port or free_port()
    # the router's metrics listener defaults to one fixed port: two routers at once (two test
    # sessions on a machine) would collide there, as megapkl's own launch avoids
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--policy", policy, "--host", HOST, "--port", str(port), "--log-level", "warn",
           "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
           "--worker-startup-timeout-secs", str(int(START_TIMEOUT)), *args]
    return _spawn("router", cmd, Path(log_dir) / f"router-{port}.log", f"http://{HOST}:{port}")


def wait_healthy(procs: Sequence[Proc], timeout: float = START_TIMEOUT,
                 path: str = "/health") -> None:
    """Poll `path` on every process until each answers 200; raise (with the log tail) when one
    exits or the time runs out."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before "
                                   f"becoming healthy; log {proc.log}:\n{proc.log_tail()}")
            try:
                status, _ = http("GET", proc.url + path, timeout=5.0)
            except (OSError, urllib.error.URLError):
                status = None
            if status == 200:
                pending.remove(proc)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} at {pending[0].url} not healthy after "
                               f"{timeout:.0f} s; log {pending[0].log}:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.3)


def router_workers(router_url: str) -> list[str]:
    """Worker URLs the router has registered (GET /workers of sglang-router 0.3.x)."""
    status, body = http("GET", router_url + "/workers", timeout=10.0)
    if status != 200:
        raise RuntimeError(f"router GET /workers answered {status}: {body}")
    items = body.get("workers", body) if isinstance(body, dict) else body
    return sorted(w["url"] if isinstance(w, dict) else str(w) for w in items)


def wait_router_ready(router: Proc, num_workers: int, timeout: float = START_TIMEOUT) -> None:
    """Until the router answers /health and lists `num_workers` healthy workers."""
    wait_healthy([router], timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(router_workers(router.url)) >= num_workers:
                return
        except (OSError, RuntimeError, urllib.error.URLError):
            pass
        if not router.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"router did not register {num_workers} workers; log "
                               f"{router.log}:\n{router.log_tail()}")
        time.sleep(0.3)


@dataclass
class ServeCluster:
    """Workers (`megapkl serve`) and, optionally, the router in front of them."""

    workers: list[Proc] = field(default_factory=list)
    router: Optional[Proc] = None

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def router_url(self) -> Optional[str]:
        return None if self.router is None else self.router.url

    @property
    def logs(self) -> list[Path]:
        return [p.log for p in self.processes]

    @property
    def processes(self) -> list[Proc]:
        return [*self.workers, *([self.router] if self.router else [])]

    def close(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def launch_cluster(log_dir: Path, *, num_workers: int = 2, model_config: str = "tiny-qwen3",
                   worker_args: Sequence[str] = (), seed: int = 0, router: bool = True,
                   policy: str = "round_robin", router_args: Sequence[str] = ()) -> ServeCluster:
    """Start workers (same model and seed: same weights), wait for them, then the router.
    On any failure everything started so far is stopped before the error propagates."""
    cluster = ServeCluster()
    try:
        for i in range(num_workers):
            cluster.workers.append(start_worker(log_dir, model_config=model_config, seed=seed,
                                                args=worker_args, name=f"worker{i}"))
        wait_healthy(cluster.workers)
        if router:
            cluster.router = start_router(log_dir, cluster.worker_urls, policy=policy,
                                          args=router_args)
            wait_router_ready(cluster.router, num_workers)
        return cluster
    except BaseException:
        cluster.close()
        raise


@pytest.fixture
def make_serve_cluster(tmp_path):
    """Factory: `make_serve_cluster(**launch_cluster kwargs)`; every cluster is closed after the
    test, pass or fail."""
    clusters: list[ServeCluster] = []

    def make(**kwargs: Any) -> ServeCluster:
        cluster = launch_cluster(tmp_path / f"cluster{len(clusters)}", **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


@pytest.fixture(scope="module")
def serve_cluster(tmp_path_factory):
    """Two tiny-qwen3 `megapkl serve` workers (seed 0) behind a round-robin sglang-router,
    shared by the tests of one module."""
    cluster = launch_cluster(tmp_path_factory.mktemp("serve_cluster"))
    yield cluster
    cluster.close()
