"""Math-verify scoring with a hard per-sample time limit, safe from any thread.

math-verify bounds its own parsing and comparison with SIGALRM, which works only in a process's
main thread; in any other thread it runs unbounded, and a pathological answer such as
`9^{9^{9^{9}}}` then blocks the caller for good. `BoundedVerifier` runs the scoring in a
dedicated worker process (a fresh interpreter: no copy of the trainer's threads or locks) whose
main thread keeps math-verify's own timeout, and the caller waits at most `kill_after_s` for each
answer: a worker that does not answer in time (stuck in code signals cannot interrupt) is killed
and restarted, and the sample counts as wrong. Every timeout and kill is logged with the sample.

    with BoundedVerifier(timeout_s=5) as v:
        r = v.score(response_text, gold)      # VerifyResult(correct, extracted, error)
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from megapkl.rollout.rewards import last_boxed

log = logging.getLogger(__name__)
STARTUP_GRACE_S = 60.0  # a spawned worker's interpreter start and math-verify/sympy imports


@dataclass(frozen=True)
class VerifyResult:
    correct: bool
    extracted: Optional[str]  # the response's answer as scored (last \boxed{} content), or None
    error: Optional[str] = None  # 'timeout', 'killed after N s', or the exception; None if clean


def score_text(response: str, gold: str, require_boxed: bool = True,
               timeout_s: Optional[int] = 5) -> VerifyResult:
    """The math reward's rule (see `megapkl.rollout.rewards.MathReward`), reporting what it
    extracted and why it failed. Bounded only when called from a main thread."""
    from math_verify import parse, verify

    boxed = last_boxed(response)
    try:
        gold_text = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
        gold_parsed = parse(gold_text, parsing_timeout=timeout_s, raise_on_error=True)
        if not gold_parsed:
            return VerifyResult(False, boxed, f"gold answer {gold!r} does not parse")
        if boxed is not None:
            pred = parse("\\boxed{" + boxed + "}", parsing_timeout=timeout_s, raise_on_error=True)
        elif require_boxed:
            return VerifyResult(False, None)
        else:
            pred = parse(response, parsing_timeout=timeout_s, raise_on_error=True)
        if not pred:
            return VerifyResult(False, boxed)
        ok = verify(gold_parsed, pred, timeout_seconds=timeout_s, raise_on_error=True)
        return VerifyResult(bool(ok), boxed if boxed is not None else str(pred[-1]))
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        name = type(e).__name__
        return VerifyResult(False, boxed, "timeout" if "Timeout" in name else f"{name}: {e}")


def _serve(timeout_s: Optional[int]) -> None:
    """Worker loop on stdin/stdout, one JSON line each way: [response, gold, require_boxed] in,
    [correct, extracted, error] out; end of input stops it."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # the caller logs failures
    for line in sys.stdin:
        response, gold, require_boxed = json.loads(line)
        r = score_text(response, gold, require_boxed, timeout_s)
        sys.stdout.write(json.dumps([r.correct, r.extracted, r.error]) + "\n")
        sys.stdout.flush()


class BoundedVerifier:
    """Scores (response, gold) pairs in a worker process; see the module docstring.

    The worker is a plain `python -m megapkl.rollout.bounded_verify` subprocess talking JSON lines
    over pipes (not multiprocessing, which would re-run the caller's main script on start).
    timeout_s: math-verify's own limit inside the worker (None: off). kill_after_s: the caller's
    hard limit per sample (default 2 x timeout_s + 5 s, which leaves math-verify time to stop
    itself first)."""

    def __init__(self, timeout_s: Optional[int] = 5, kill_after_s: Optional[float] = None,
                 require_boxed: bool = True) -> None:
        self.timeout_s = timeout_s
        self.kill_after_s = kill_after_s if kill_after_s is not None else 2 * (timeout_s or 5) + 5
        self.require_boxed = require_boxed
        self.num_timeouts = 0
        self.num_killed = 0
        self._proc: Optional[subprocess.Popen] = None
        self._warm = False  # the first answer of a worker also waits for its start-up

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "megapkl.rollout.bounded_verify", str(self.timeout_s or 0)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, text=True, bufsize=1)
        self._warm = False

    def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def _ask(self, response: str, gold: str) -> Optional[str]:
        """The worker's answer line, or None when it gave none within the limit."""
        if self._proc is None or self._proc.poll() is not None:
            self._stop(kill=True)
            self._start()
        try:
            self._proc.stdin.write(json.dumps([response, gold, self.require_boxed]) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return ""
        wait = self.kill_after_s + (0.0 if self._warm else STARTUP_GRACE_S)
        ready, _, _ = select.select([self._proc.stdout], [], [], wait)
        return self._proc.stdout.readline() if ready else None

    def score(self, response: str, gold: str, where: str = "") -> VerifyResult:
        """The verdict for one response; never raises for a bad or slow answer."""
        line = self._ask(response, gold)
        if line is None:
            self.num_killed += 1
            self._stop(kill=True)
            log.warning("math-verify: no verdict within %.0f s for %s (answer %r, gold %r): worker "
                        "killed, counted wrong", self.kill_after_s, where or "a sample",
                        _clip(last_boxed(response) or response), gold)
            return VerifyResult(False, last_boxed(response), f"killed after {self.kill_after_s:g} s")
        if not line:  # the worker died (e.g. out of memory): count wrong, restart next time
            self._stop(kill=True)
            log.warning("math-verify worker died while scoring %s; counted wrong", where or "a sample")
            return VerifyResult(False, last_boxed(response), "worker died")
        self._warm = True
        correct, extracted, error = json.loads(line)
        if error == "timeout":
            self.num_timeouts += 1
            log.warning("math-verify: timed out after %s s on %s (answer %r, gold %r); counted wrong",
                        self.timeout_s, where or "a sample", _clip(extracted or response), gold)
        return VerifyResult(bool(correct), extracted, error)

    def close(self) -> None:
        self._stop(kill=False)

    def __enter__(self) -> "BoundedVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten verifier must not leave a process behind
        try:
            self._stop(kill=True)
        except Exception:
            pass


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


if __name__ == "__main__":
    _serve(int(sys.argv[1]) or None)
