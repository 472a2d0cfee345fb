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
