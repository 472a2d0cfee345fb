"""Reward scoring with a hard time limit, safe from any thread: math-verify, or a user's function.

math-verify bounds its own parsing and comparison with SIGALRM, which works only in a process's
main thread; in any other thread it runs unbounded, and a pathological answer such as
`9^{9^{9^{9}}}` then blocks the caller for good. A user's reward function may hang as well. So the
scoring runs in a dedicated worker process (a fresh interpreter: no copy of the trainer's threads
or locks, in its own session so a Ctrl-C meant for the trainer does not kill it) whose main thread
keeps the in-worker time limit, and the caller waits at most `kill_after_s` for each answer: a
worker that does not answer in time (stuck in code signals cannot interrupt) is killed and
restarted, and the answer counts as failed. Every timeout and kill is logged.

    with BoundedVerifier(timeout_s=5) as v:
        r = v.score(response_text, gold)      # VerifyResult(correct, extracted, error)
    with BoundedFunction("my_pkg.rewards:score", timeout_s=30) as f:
        rewards = f.call(prompts=[...], responses=[...], answers=[...], fields=[...])
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megapkl.errors import MegapklError

log = logging.getLogger(__name__)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
STARTUP_GRACE_S = 60.0  # a spawned worker's interpreter start and imports (math-verify, sympy)


class RewardError(MegapklError, RuntimeError):
    """A reward function or server failed (raised, timed out, answered wrongly); names which."""


@dataclass(frozen=True)
class VerifyResult:
    correct: bool
    extracted: Optional[str]  # the response's answer as scored (last \boxed{} content), or None
    error: Optional[str] = None  # 'timeout', 'killed after N s', or the exception; None if clean


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed{...} (or \\fbox{...}) in `text`, braces balanced;
    None when there is none (a box cut off by the length limit does not count)."""
    best: Optional[tuple[int, str]] = None
    for command in _BOX_COMMANDS:
        start = text.rfind(command)
        while start != -1:
            content = _braced_after(text, start + len(command))
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(command, 0, start)
    return None if best is None else best[1]


def _braced_after(text: str, i: int) -> Optional[str]:
    """The balanced {...} group starting at text[i] (spaces allowed before '{'), else None."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


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


# ------------------------------------------------------------------ inside the worker


def _serve_math(timeout_s: Optional[int]) -> None:
    """[response, gold, require_boxed] in, [correct, extracted, error] out, one JSON line each."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # the caller logs failures
    for line in sys.stdin:
        response, gold, require_boxed = json.loads(line)
        r = score_text(response, gold, require_boxed, timeout_s)
        sys.stdout.write(json.dumps([r.correct, r.extracted, r.error]) + "\n")
        sys.stdout.flush()


def resolve(dotted: str) -> Any:
    """The callable `package.module:name` names (`name` may be dotted: a class attribute)."""
    import importlib

    module, _, attr = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{dotted} is a {type(obj).__name__}, not a callable")
    return obj


def _serve_calls(dotted: str, timeout_s: float, kind: str = "rewards") -> None:
    """{"ready": true} (or {"error": ...}) first; then keyword arguments in, {"rewards": [...]}
    (kind "rewards") or {"result": ...} (kind "result": any JSON value) or {"error": ...} out,
    one JSON line each. The user's prints go to stderr, never into the answers; SIGALRM bounds
    each call (code that ignores signals is killed by the caller)."""
    import signal

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: Any) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    def expired(signum, frame) -> None:  # noqa: ARG001
        key = "reward" if kind == "rewards" else "env"
        raise TimeoutError(f"no answer within {key}.timeout_s ({timeout_s:g} s)")

    try:
        fn = resolve(dotted)
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises
        reply({"error": f"{type(e).__name__}: {e}"})
        return
    reply({"ready": True})
    signal.signal(signal.SIGALRM, expired)
    for line in sys.stdin:
        kwargs = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            if kind == "rewards":
                reply({"rewards": check_rewards(fn(**kwargs), len(kwargs["responses"]))})
            else:
                reply({"result": fn(**kwargs)})
        except BaseException as e:  # noqa: BLE001 - the caller decides (reward.on_error)
            kind = "timeout" if isinstance(e, TimeoutError) else type(e).__name__
            reply({"error": f"{kind}: {e}"})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


def check_rewards(values: Any, n: int) -> list[float]:
    """`values` as n finite floats; ValueError naming what is wrong otherwise."""
    import math

    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"expected a list of {n} rewards (one per response), got {got}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"reward {i} is {v!r}, not a finite number")
        out.append(float(v))
    return out


# ------------------------------------------------------------------ the caller's side


class _Worker:
    """A `python -m megapkl.rollout.bounded_verify ARGS` subprocess talking JSON lines over pipes
    (not multiprocessing, which would re-run the caller's main script on start), waited for at
    most `kill_after_s` per answer (plus STARTUP_GRACE_S while it starts)."""

    def __init__(self, args: Sequence[str], kill_after_s: float) -> None:
        self.args, self.kill_after_s = [str(a) for a in args], kill_after_s
        self.proc: Optional[subprocess.Popen] = None
        self.warm = False  # the first answer of a worker also waits for its start-up

    def start(self) -> None:
        cmd = [sys.executable, "-m", "megapkl.rollout.bounded_verify", *self.args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     text=True, bufsize=1, start_new_session=True)
        self.warm = False

    def stop(self, kill: bool) -> None:
        proc, self.proc = self.proc, None
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

    def read(self, wait: float) -> Optional[str]:
        """The next answer line; '' when the worker died, None when none came within `wait`."""
        ready, _, _ = select.select([self.proc.stdout], [], [], wait)
        return self.proc.stdout.readline() if ready else None

    def ask(self, payload: Any) -> Optional[str]:
        """The worker's answer line to `payload` ('' if it died), or None when it gave none in
        time (the caller then kills it)."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop(kill=True)
            self.start()
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return ""
        line = self.read(self.kill_after_s + (0.0 if self.warm else STARTUP_GRACE_S))
        if line:
            self.warm = True
        return line

    def __del__(self) -> None:  # a forgotten worker must not leave a process behind
        try:
            self.stop(kill=True)
        except Exception:  # noqa: BLE001
            pass


class _WorkerOwner:
    """Closing stops the worker process (gently); usable as a context manager."""

    _worker: _Worker

    def close(self) -> None:
        self._worker.stop(kill=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BoundedVerifier(_WorkerOwner):
    """Scores (response, gold) pairs in a worker process; see the module docstring.

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
        self._worker = _Worker(["math", timeout_s or 0], self.kill_after_s)

    def score(self, response: str, gold: str, where: str = "") -> VerifyResult:
        """The verdict for one response; never raises for a bad or slow answer."""
        line = self._worker.ask([response, gold, self.require_boxed])
        if line is None:
            self.num_killed += 1
            self._worker.stop(kill=True)
            log.warning("math-verify: no verdict within %.0f s for %s (answer %r, gold %r): worker "
                        "killed, counted wrong", self.kill_after_s, where or "a sample",
                        _clip(last_boxed(response) or response), gold)
            return VerifyResult(False, last_boxed(response), f"killed after {self.kill_after_s:g} s")
        if not line:  # the worker died (e.g. out of memory): count wrong, restart next time
            self._worker.stop(kill=True)
            log.warning("math-verify worker died while scoring %s; counted wrong", where or "a sample")
            return VerifyResult(False, last_boxed(response), "worker died")
        correct, extracted, error = json.loads(line)
        if error == "timeout":
            self.num_timeouts += 1
            log.warning("math-verify: timed out after %s s on %s (answer %r, gold %r); counted wrong",
                        self.timeout_s, where or "a sample", _clip(extracted or response), gold)
        return VerifyResult(bool(correct), extracted, error)



class BoundedFunction(_WorkerOwner):
    """Calls the user's function `package.module:callable` in a worker process, each call bounded
    by `timeout_s` (SIGALRM inside the worker) and by `kill_after_s` (the caller kills the worker
    and starts a fresh one). Construction starts the worker and fails at once (RewardError) when
    the function cannot be imported."""

    def __init__(self, dotted: str, timeout_s: float = 10.0,
                 kill_after_s: Optional[float] = None, kind: str = "rewards",
                 what: str = "reward.function") -> None:
        self.dotted, self.timeout_s, self.kind, self.what = dotted, timeout_s, kind, what
        self.kill_after_s = kill_after_s if kill_after_s is not None else 2 * timeout_s + 5
        self._worker = _Worker(["call", dotted, timeout_s, kind], self.kill_after_s)
        self._start()

    def _start(self) -> None:
        self._worker.start()
        line = self._worker.read(STARTUP_GRACE_S)
        why = {None: f"no answer within {STARTUP_GRACE_S:g} s", "": "the worker exited at start"}
        answer = json.loads(line) if line else {"error": why[line]}
        if not answer.get("ready"):
            self._worker.stop(kill=True)
            raise RewardError(f"{self.what}: cannot load {self.dotted!r} ({answer['error']})")
        self._worker.warm = True

    def call(self, **kwargs: Any) -> Any:
        """The function's rewards (kind "result": its JSON answer) for one call; RewardError when
        it raised, timed out, returned something else than one finite number per response, or
        its worker died."""
        if self._worker.proc is None or self._worker.proc.poll() is not None:
            self._start()
        line = self._worker.ask(kwargs)
        if line is None:
            self._worker.stop(kill=True)
            raise RewardError(f"no answer within {self.kill_after_s:g} s (worker killed)")
        if not line:
            self._worker.stop(kill=True)
            raise RewardError("its worker process died")
        answer = json.loads(line)
        if "error" in answer:
            raise RewardError(answer["error"])
        return answer["rewards" if self.kind == "rewards" else "result"]



def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


if __name__ == "__main__":
    if sys.argv[1] == "call":
        _serve_calls(sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "rewards")
    else:
        _serve_math(int(sys.argv[2]) or None)
