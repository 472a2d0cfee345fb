"""Bounded-time math-verify scoring: a pathological answer never blocks the caller, from any
thread, and counts wrong (real math-verify in a real worker process)."""
import logging
import threading
import time

from megapkl.rollout.bounded_verify import BoundedVerifier, score_text

SLOW = "The answer is \\boxed{9^{9^{9^{9}}}}"  # math-verify compares it for minutes unbounded


def test_score_text_extracts_and_verifies():
    r = score_text("so x = \\boxed{\\frac{1}{2}}", "0.5")
    assert r.correct and r.extracted == "\\frac{1}{2}" and r.error is None
    r = score_text("x = \\boxed{3}", "4")
    assert not r.correct and r.extracted == "3"
    assert score_text("no box: 4", "4") == score_text("no box: 4", "4")
    assert not score_text("no box: 4", "4").correct
    assert score_text("no box: 4", "4", require_boxed=False).correct


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.update(r=fn()))
    t.start()
    t.join(120)
    assert not t.is_alive(), "scoring blocked its thread"
    return box["r"]


def test_slow_answer_off_main_thread_is_bounded_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="megapkl.rollout.bounded_verify")
    with BoundedVerifier(timeout_s=1) as v:
        t0 = time.time()
        r = _in_thread(lambda: v.score(SLOW, "1", where="bench/p0"))
        assert not r.correct and r.error == "timeout"
        assert v.num_timeouts == 1 and "bench/p0" in caplog.text
        # the same worker keeps scoring correctly afterwards
        assert _in_thread(lambda: v.score("\\boxed{2}", "2")).correct
    assert time.time() - t0 < 60


def test_worker_stuck_past_the_hard_limit_is_killed_and_replaced(caplog):
    caplog.set_level(logging.WARNING, logger="megapkl.rollout.bounded_verify")
    # math-verify's own limit off inside the worker: only the caller's hard limit stops it
    with BoundedVerifier(timeout_s=None, kill_after_s=2) as v:
        assert v.score("\\boxed{1}", "1").correct  # warm (start-up is not part of the limit)
        t0 = time.time()
        r = _in_thread(lambda: v.score(SLOW, "1", where="bench/p7"))
        assert time.time() - t0 < 30
        assert not r.correct and r.error.startswith("killed") and v.num_killed == 1
        assert "worker killed" in caplog.text and "bench/p7" in caplog.text
        assert v.score("\\boxed{x+1}", "1+x").correct  # a fresh worker took over
