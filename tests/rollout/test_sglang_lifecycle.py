"""The heartbeat over a colocated server's lifecycle, against `megapkl serve` processes that live it
as SGLang does (tests/contract/test_serve_lifecycle_contract.py): `/health` generates, a forward
while the memory is released kills the server, the health route answers 503 while the scheduler
is blocked in a weight load, and a server's `/server_info` carries its `startup_time`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from sglang_fixtures import Owner, free_port, http
from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
from megapkl.rollout.sglang.launch import ServerProcess, ServerSpec, wait_healthy


def _serve_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3",
            "--port", str(port), *extra]


def _start(tmp_path: Path, name: str, port: int, *extra: str, env=None) -> ServerProcess:
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(name, url, _serve_cmd(port, *extra), tmp_path / f"{name}.log",
                         env=env or {}).start()
    wait_healthy(proc, url, first_wait_s=0, interval_s=0.2, timeout_s=30, deadline_s=240,
                 route="model_info")
    return proc


@pytest.fixture
def procs():
    made: list[ServerProcess] = []
    yield made
    for p in made:
        p.stop(grace_s=1.0)


def test_a_released_server_is_never_sent_a_generation(tmp_path, procs):
    """Defect 1: SGLang's /health generates; a released server must be checked without one."""
    port = free_port()
    w = Worker(f"http://127.0.0.1:{port}", process=_start(tmp_path, "engine0", port),
               state="ready")
    procs.append(w.process)
    fleet = Fleet([w], health=HealthSettings(interval_s=0.1, timeout_s=30, max_failures=1))
    released: set[str] = set()
    fleet.bind(Owner(asleep=lambda w: w.url in released))
    assert http("POST", w.url + "/release_memory_occupation", {})[0] == 200
    released.add(w.url)
    for _ in range(3):
        fleet.beat()
    time.sleep(0.5)
    assert w.process.alive(), (tmp_path / "engine0.log").read_text()[-2000:]
    assert w.state == "ready", w.describe()
    assert http("POST", w.url + "/resume_memory_occupation", {})[0] == 200
    released.clear()
    fleet.beat()  # holding its memory again: a real generation
    assert w.state == "ready" and w.process.alive(), w.describe()


def test_a_long_disk_load_does_not_get_its_server_killed(tmp_path, procs):
    """Defect 7: while one update_weights_from_disk blocks the scheduler for longer than the
    health timeout x max_failures, the heartbeat running beside it declares nobody dead."""
    port = free_port()
    proc = _start(tmp_path, "engine0", port, "--weight-load-delay-s", "4",
                  env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    procs.append(proc)
    w = Worker(f"http://127.0.0.1:{port}", process=proc, state="ready")
    fleet = Fleet([w], health=HealthSettings(interval_s=0.2, timeout_s=30, max_failures=2))
    fleet.bind(Owner())
    fleet.start_heartbeat()
    try:
        with fleet.weight_targets() as targets:
            assert targets == [w]
            status, body = http("POST", w.url + "/update_weights_from_disk",
                                {"model_path": str(tmp_path / "no_checkpoint")})
        assert status == 400, body  # the load ran (and found no checkpoint) on a live server
        time.sleep(1.0)  # a beat after the push
    finally:
        fleet.stop_heartbeat()  # the heartbeat only (the process is the fixture's)
    assert w.process.alive() and w.state == "ready", (w.describe(), fleet.events)


def test_a_foreign_server_on_a_killed_servers_port_is_never_admitted(tmp_path, procs):
    """Defect 8: the server at a URL dies and another process takes its port; the heartbeat sees
    another startup_time and never syncs or admits it."""
    port = free_port()
    first = _start(tmp_path, "engine0", port)
    procs.append(first)
    w = Worker(f"http://127.0.0.1:{port}", state="ready")  # not launched by the fleet
    fleet = Fleet([w], health=HealthSettings(interval_s=0.1, timeout_s=30, max_failures=1))
    owner = Owner(version=1)
    fleet.bind(owner)
    fleet.beat()
    assert w.state == "ready" and w.identity is not None, w.describe()
    first.stop(grace_s=1.0)
    fleet.beat()
    assert w.state == "dead", w.describe()
    other = _start(tmp_path, "other", port)  # another job's server on the freed port
    procs.append(other)
    for _ in range(3):
        fleet.beat()
    assert w.state == "dead" and not owner.resynced, (w.describe(), owner.resynced)
    assert "another server answers" in w.last_error, w.last_error


def test_a_launched_server_whose_port_is_taken_is_not_admitted(tmp_path, procs):
    """A restart whose port another, older process answers: the listener is not the process
    the fleet launched (checked first, on a loopback URL), and its startup_time predates our
    launch (what a server on another node is judged by); either keeps it from being taken for
    our server."""
    port = free_port()
    other = _start(tmp_path, "other", port)
    procs.append(other)
    time.sleep(2.0)  # it has served a while (the fleet allows 1 s of clock difference)
    url = f"http://127.0.0.1:{port}"
    w = Worker(url, spec=ServerSpec(0, url, _serve_cmd(port), tmp_path / "engine0.log"),
               state="dead")
    fleet = Fleet([w], health=HealthSettings(interval_s=0.1, timeout_s=30, max_failures=1,
                                             deadline_s=240, max_restarts=1))
    owner = Owner(version=1)
    fleet.bind(owner)
    fleet.beat()
    assert w.state != "ready" and not owner.resynced, (w.describe(), owner.resynced)
    assert "lost its port" in w.last_error, (w.last_error, fleet.events)
    assert "the port is taken" in (fleet.foreign(w) or "")


def test_closing_ends_within_seconds_while_a_probe_waits_on_a_hung_server():
    """The heartbeat's probe of a server that accepts and never answers waits up to
    health_timeout_s; closing the engine cuts it and joins the heartbeat with a bound. Before:
    the join waited health_timeout_s + 5 s (and a beat may last longer than that)."""
    import socket

    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    w = Worker(f"http://127.0.0.1:{sock.getsockname()[1]}", state="ready")
    fleet = Fleet([w], health=HealthSettings(interval_s=0.05, timeout_s=60, max_failures=1))
    engine = SGLangEngine(fleet, {}, WeightSync(SyncSettings(timeout_s=60)))  # heartbeat on
    try:
        time.sleep(0.5)  # the first probe is waiting on the server
        t0 = time.monotonic()
        engine.close()
        took = time.monotonic() - t0
        assert took < 5 and not fleet._thread.is_alive(), (took, fleet.events)
    finally:
        sock.close()
