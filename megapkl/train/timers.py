"""Wall-clock timers of an update, taken where the work happens.

    timers = Timers()
    with timers("generate"):
        engine.generate(...)
    row.update(timers.lap())    # time/generate_s, ..., and time/update_s: the wall time since the
                                # previous lap (the previous row), which the timers should cover

The timed sections never nest (a section inside another would be counted twice), so their sum
is at most `time/update_s`; what it leaves uncovered is bookkeeping between them. For the timeline
(`megapkl plot`), the row also gives where the update's generation and training lay in time:
time/<name>_from_s and time/<name>_to_s, seconds since the run started (generation ahead of
training, on its own thread, is absorbed into the row of the update that uses its batch).
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

NAMES = ("export", "sync", "generate", "reward", "wait", "reference", "train", "eval",
         "checkpoint", "log")
TIMELINE = ("generate", "train")  # the sections whose first start and last end each row gives


class Timers:
    def __init__(self) -> None:
        self.totals = dict.fromkeys(NAMES, 0.0)
        self.spans: dict[str, list[float]] = {}  # TIMELINE name -> [first start, last end]
        self._origin = self._mark = time.perf_counter()
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
            t1 = time.perf_counter()
            self.totals[name] += t1 - t0
            self._span(name, t0, t1)
            self._inside = ""

    def _span(self, name: str, t0: float, t1: float) -> None:
        if name in TIMELINE:
            first, last = self.spans.get(name, (t0, t1))
            self.spans[name] = [min(first, t0), max(last, t1)]

    def absorb(self, other: "Timers") -> None:
        """Add work timed by `other` (generation ahead of training, on its own thread)."""
        for name, seconds in other.totals.items():
            self.totals[name] += seconds
        for name, (t0, t1) in other.spans.items():
            self._span(name, t0, t1)

    def start(self) -> None:
        """Start over: the run's (and the first update's) time begins here."""
        self._origin = time.perf_counter()
        self._next()

    def _next(self) -> None:
        self.totals = dict.fromkeys(NAMES, 0.0)
        self.spans = {}
        self._mark = time.perf_counter()

    def lap(self) -> dict[str, float]:
        """time/<name>_s of every timer since the last lap, time/update_s, and the timeline's
        time/<name>_from_s / _to_s; then the next lap begins."""
        now = time.perf_counter()
        out = {f"time/{k}_s": v for k, v in self.totals.items()}
        out["time/update_s"] = now - self._mark
        for name, (t0, t1) in self.spans.items():
            out[f"time/{name}_from_s"] = t0 - self._origin
            out[f"time/{name}_to_s"] = t1 - self._origin
        self._next()
        return out
