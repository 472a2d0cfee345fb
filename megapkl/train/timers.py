"""Wall-clock timers of an update, taken where the work happens.

    timers = Timers()
    with timers("generate"):
        engine.generate(...)
    row.update(timers.lap())    # time/generate_s, ..., and time/update_s: the wall time since the
                                # previous lap (the previous row), which the timers should cover

The timed sections never nest (a section inside another would be counted twice), so their sum
is at most `time/update_s`; what it leaves uncovered is bookkeeping between them.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

NAMES = ("export", "sync", "generate", "reward", "wait", "reference", "train", "eval",
         "checkpoint", "log")


class Timers:
    def __init__(self) -> None:
        self.totals = dict.fromkeys(NAMES, 0.0)
        self._mark = time.perf_counter()
        self._inside = ""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.totals:
            raise KeyError(f"unknown timer {name!r} (one of {', '.join(NAMES)})")
        if self._inside:  # nested: already counted by the enclosing section
            yield
            return
        self._inside, t0 = name, time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0
            self._inside = ""

    def absorb(self, totals: dict[str, float]) -> None:
        """Add work timed elsewhere (generation ahead of training, on its own thread)."""
        for name, seconds in totals.items():
            self.totals[name] += seconds

    def start(self) -> None:
        """Start over (the first update's wall time begins here)."""
        self.totals = dict.fromkeys(NAMES, 0.0)
        self._mark = time.perf_counter()

    def lap(self) -> dict[str, float]:
        """time/<name>_s of every timer since the last lap and time/update_s, then start over."""
        now = time.perf_counter()
        out = {f"time/{k}_s": v for k, v in self.totals.items()}
        out["time/update_s"] = now - self._mark
        self.start()
        return out
