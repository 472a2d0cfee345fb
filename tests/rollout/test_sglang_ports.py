"""A launched server binds its port after loading its model, seconds after megapkl found the port
free: another process of the host (another run's server, another test's) can take it meanwhile.
Such a server is started again on the next free port of its fleet's lane, whether it died saying
so or another process answers its URL; any other failure ends every wait at once."""
from __future__ import annotations

import logging
import socket
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megapkl.rollout.sglang.build import start_servers
from megapkl.rollout.sglang.fleet import HealthSettings
from megapkl.rollout.sglang.launch import (ServerLaunchError, holds_port, plan_servers,
                                           port_free)

from sglang_fixtures import free_port

# a server that loads for `delay` seconds, then binds (as SGLang and `megapkl serve` do)
_LOADS_THEN_BINDS = """import http.server, sys, time
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
HEALTH = HealthSettings(first_wait_s=0.0, interval_s=0.1, timeout_s=5.0)


def _specs(tmp_path, script: str, engines: int = 2, delay: float = 1.0):
    path = tmp_path / "server.py"
    path.write_text(script)
    sg = SimpleNamespace(base_port=free_port(), num_engines=engines, tp=1, colocate=True)
    return plan_servers(sg, log_dir=tmp_path / "logs", host="127.0.0.1",
                        make_cmd=lambda h, p, g: [sys.executable, str(path), str(p), str(delay)])


def _stop(procs) -> None:
    for p in procs:
        p.stop(grace_s=1.0)


@pytest.mark.parametrize("taker", ["listens", "answers"])
def test_a_server_whose_port_was_taken_before_its_bind_starts_again_on_the_next(tmp_path, taker,
                                                                                caplog):
    """`listens`: a bare socket holds engine0's port, so engine0 exits with "Address already in
    use". `answers`: another HTTP server answers engine0's URL while engine0 still loads (its
    /health says 200: only the port's owner tells them apart). Either way engine0 runs on the
    lane's next port (+ 2: engine1 owns the odd ones), engine1 keeps its own, and the taker is
    left alone. Before: the run failed, or trained against the other process."""
    # `answers`: loading long enough that the first health check is answered before it dies
    specs = _specs(tmp_path, _LOADS_THEN_BINDS, delay=1.0 if taker == "listens" else 8.0)
    taken = specs[0].port
    if taker == "listens":
        other = socket.socket()
        other.bind(("127.0.0.1", taken))
        other.listen()
    else:
        other = replace(specs[0]).process()  # a server of someone else's, already up
        other.cmd = [*other.cmd[:-1], "0"]
        other.log_path = tmp_path / "other.log"
        other.start()
        while holds_port(other, taken) is not True:
            time.sleep(0.05)
    started = []
    try:
        with caplog.at_level(logging.WARNING, "megapkl.rollout.sglang.build"):
            ran = start_servers(specs, HEALTH, 60.0, started)
        (s0, p0), (s1, p1) = ran
        assert s0.port != taken and (s0.port - taken) % 2 == 0 and s1 == specs[1], ran
        assert holds_port(p0, s0.port) is True and holds_port(p1, s1.port) is True
        assert p0.url == s0.url and str(s0.port) in s0.cmd
        assert len(started) == 3 and not started[0].alive()  # the loser was stopped
        said = [r.getMessage() for r in caplog.records if r.name == "megapkl.rollout.sglang.build"]
        assert len(said) == 1 and said[0].startswith("rollout.sglang: engine0: ") and \
            f"starting it again on port {s0.port}" in said[0], said
        if taker == "listens":
            assert "taken before it could bind it" in said[0]
        else:
            assert f"another process of this host listens on port {taken}" in said[0]
            assert other.alive()
    finally:
        _stop(started)
        other.stop() if taker == "answers" else other.close()


def test_a_server_that_fails_otherwise_ends_every_wait_and_names_its_log(tmp_path):
    """engine0 exits on its own (no port involved): no second launch, and engine1, which would
    take 60 s to load, is not waited for; the error names engine0 and its log."""
    specs = _specs(tmp_path, "import sys, time\ntime.sleep(float(sys.argv[2]))\n", delay=60.0)
    crash = replace(specs[0])
    crash.cmd = [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"]
    started = []
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerLaunchError, match=r"engine0 .* exited with code 3 .*engine0.log"
                                                    r"(.|\n)*CUDA out of memory"):
            start_servers([crash, specs[1]], HEALTH, 120.0, started)
    finally:
        _stop(started)
    assert time.monotonic() - t0 < 20 and len(started) == 2


def test_a_router_whose_port_was_taken_starts_again_on_the_lanes_next_pair(tmp_path, monkeypatch,
                                                                           caplog):
    """The real sglang-router, its first pair of ports taken by another listener between the
    pick and its bind (the pick is made to return the taken port: the race, without its timing):
    it exits saying the address is in use and runs on the next pair, away from the taken one."""
    from megapkl.rollout.sglang import build
    from megapkl.rollout.sglang.launch import router_ports

    started = []
    (worker, _), = start_servers(_specs(tmp_path, _LOADS_THEN_BINDS, engines=1, delay=0.0), HEALTH,
                                 60.0, started)
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    taken, picks = other.getsockname()[1], []

    def pick(sg, replica, replicas, avoid=()):
        picks.append(list(avoid))
        return (taken, free_port()) if not avoid else router_ports(sg, replica, replicas, avoid)
    monkeypatch.setattr(build, "router_ports", pick)
    sg = SimpleNamespace(host="127.0.0.1", base_port=free_port() - 1000, router_command=None,
                         router_policy="round_robin")
    try:
        with caplog.at_level(logging.WARNING, "megapkl.rollout.sglang.build"):
            router = build.start_router(sg, build.Lane(servers=1), [worker.url],
                                        tmp_path / "router.log", HEALTH, started)
        assert len(picks) == 2 and picks[1][0] == taken and router.alive()
        assert router.url != f"http://127.0.0.1:{taken}" and holds_port(router, int(
            router.url.rsplit(":", 1)[1])) is True
        said = [r.getMessage() for r in caplog.records if r.name == "megapkl.rollout.sglang.build"]
        assert said == [f"rollout.sglang: sglang-router: port {taken} taken before it could bind "
                        f"it ({tmp_path / 'router.log'}); starting it again on other ports"], said
    finally:
        _stop(started)
        other.close()


def test_a_server_a_wrapper_starts_in_a_session_of_its_own_is_still_its_own(tmp_path):
    """A server_command wrapper whose server runs in a new session (setsid) but descends from
    the launched process holds the port as the launched server itself would: started once."""
    wrapper = ("import ctypes, subprocess, sys\n"  # (the server dies with the wrapper)
               "subprocess.run([sys.executable, sys.argv[1], *sys.argv[2:]], "
               "start_new_session=True, preexec_fn=lambda: ctypes.CDLL('libc.so.6').prctl(1, 9))\n")
    (tmp_path / "wrapper.py").write_text(wrapper)
    specs = _specs(tmp_path, _LOADS_THEN_BINDS, engines=1, delay=0.0)
    spec = replace(specs[0])
    spec.cmd = [sys.executable, str(tmp_path / "wrapper.py"), *spec.cmd[1:]]
    started = []
    try:
        (s, p), = start_servers([spec], HEALTH, 60.0, started)
        assert s.port == spec.port and len(started) == 1 and holds_port(p, s.port) is True
    finally:
        _stop(started)
    time.sleep(0.5)
    assert port_free("127.0.0.1", spec.port)  # gone with its wrapper
