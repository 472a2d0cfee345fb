"""Contract tests: megapkl's output checked by the pinned sglang's own code, run on CPU.

SGLang runs in a process of its own (`sglang` fixture, one per test session): importing it
installs an import hook and patches torch and transformers at import time, none of which may
leak into the rest of the test session. Tests produce megapkl's artefacts here (command lines,
request bodies, tensor payloads, model directories) and hand them over as plain data.

`tools/setup_env.sh test` installs the pinned sglang (without dependencies) from a wheel cache,
so nothing downloads at test time. Without sglang installed the contract tests skip, except in
CI (CI=true), where that is a failure.
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        message = ("the pinned sglang is not installed: run `bash tools/setup_env.sh test` "
                   "(installs it without dependencies from the wheel cache)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


class SGLangProcess:
    """Calls functions of `sglang_side` in the SGLang process: `sg.call("fn", *args)`."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        import sglang_side

        self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=sglang_side.boot)
        self._side = sglang_side

    def submit(self, name: str, *args):
        return self._pool.submit(getattr(self._side, name), *args)

    def call(self, name: str, *args, timeout: float = 300.0):
        return self.submit(name, *args).result(timeout=timeout)

    def close(self) -> None:
        """Ends the SGLang process at once (its server threads and process groups with it)."""
        try:
            self.call("exit_now", timeout=30.0)
        except Exception:  # noqa: BLE001 - the process is gone: that was the point
            pass
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def sglang():
    _require_sglang()
    proc = SGLangProcess()
    try:
        proc.call("pid", timeout=600.0)  # the import: tens of seconds on a loaded machine
        yield proc
    finally:
        proc.close()
