"""The generation thread: an exception escaping a unit's work becomes that unit's failed result
(take() does not wait forever), take() does not wait on a thread that ended, stop() returns only
when the thread has ended, and readiness uses the versions the producer was told of."""
from __future__ import annotations

import threading

from megapkl.train.producer import Producer


def _producer(work):
    return Producer(work, versions=lambda k: [k], failed=lambda r: r[0] == "failed",
                    on_error=lambda exc: ("failed", repr(exc)), published=[0])


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("megapkl")]


def test_an_exception_in_the_work_is_the_units_failed_result_and_stop_ends_the_thread():
    def work(key):
        if key == 1:
            raise OSError("engine gone")
        return ("ok", key)
    p = _producer(work)
    p.plan([0, 1, 2])
    p.published(1)
    p.published(2)
    assert p.take(0) == ("ok", 0)
    assert p.take(1) == ("failed", "OSError('engine gone')")
    assert p.take(2) is None  # the thread stopped generating after the failure: generate here
    p.stop()
    assert _threads() == []


def test_take_does_not_wait_on_a_thread_that_ended():
    def work(key):
        raise SystemExit  # escapes everything: the thread ends
    p = _producer(work)
    p.plan([0])
    assert p.take(0)[0] == "failed"
    p.plan([5])
    p.published(5)
    assert p.take(5) is None
    p.stop()
    assert _threads() == []


def test_a_unit_waits_for_the_versions_it_was_told_of():
    started = threading.Event()

    def work(key):
        started.set()
        return ("ok", key)
    p = _producer(work)
    p.plan([3])
    assert not started.wait(0.3)  # version 3 not published
    p.published(3)
    assert p.take(3) == ("ok", 3)
    p.stop()


def _hung_server():
    """A listening socket that accepts and never answers: a server whose scheduler hangs."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_stop_behind_a_request_to_a_hung_server_ends_within_seconds():
    """The unit in progress is in an engine call to a server that never answers (a push here,
    whose calls wait up to sync_timeout_s; a generation waits up to request_timeout_s, an
    hour by default). stop() cuts the engine's calls and joins with a bound. Before: it joined
    without one, and the run's exit waited for the server's timeout."""
    import time

    import torch

    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync

    sock, url = _hung_server()
    engine = SGLangEngine(Fleet([Worker(url, state="ready")], health=HealthSettings(timeout_s=60)),
                          {}, WeightSync(SyncSettings(mode="tensor", timeout_s=60)),
                          heartbeat=False)
    started = threading.Event()

    def work(key):
        started.set()
        engine.update_weights([("w", torch.zeros(4))], version=key)
        return ("ok", key)

    p = _producer(work)
    try:
        p.plan([0])
        assert started.wait(30)
        time.sleep(0.2)  # inside its call to the hung server
        t0 = time.monotonic()
        ended = p.stop(interrupt=engine.interrupt)
        took = time.monotonic() - t0
        assert ended and took < 5, took
        assert "megapkl-rollout-producer" not in _threads()
    finally:
        engine.close()
        sock.close()
