"""Fault injection for the failure tests: make one named function raise on one rank.

    fail_at("megapkl.train.metrics_log:MetricsLogger.log", call=3, error=OSError("disk full"))

patches the function in this process (a forked rank) so that its `call`-th call raises `error`
(earlier and later calls run the real function); the wall time of the fault is written to
`mark` if given. Used by tests/reliability to put a failure at a given call site and update.
"""
from __future__ import annotations

import functools
import importlib
import time
from pathlib import Path
from typing import Any, Optional


def _owner(target: str) -> tuple[Any, str]:
    """('module:Class.attr' or 'module:function') -> (the object holding it, its name)."""
    module, _, qual = target.partition(":")
    owner: Any = importlib.import_module(module)
    *path, name = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise AttributeError(f"fault target {target}: {owner!r} has no attribute {name!r}")
    return owner, name


def fail_at(target: str, *, call: int = 1, error: Optional[BaseException] = None,
            mark: Optional[Path] = None) -> None:
    """From now on in this process, the `call`-th call of `target` raises `error`."""
    owner, name = _owner(target)
    real = getattr(owner, name)
    raised = error if error is not None else RuntimeError(f"injected fault in {target}")
    calls = [0]

    @functools.wraps(real)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            if mark is not None:
                Path(mark).write_text(str(time.time()))
            raise raised
        return real(*args, **kwargs)
    setattr(owner, name, faulty)
