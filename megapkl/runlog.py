"""A quiet terminal: other libraries' warnings go to the run's log file, not to the terminal.

`megapkl` (the command) calls `quiet()` first unless `--debug` is given. From then on, Python
warnings (`warnings.warn`: megatron's "Transformer Engine and Apex are not installed", torch's
deprecations, ...) and the records other libraries log are held in memory until the run's
directory is known; `attach(run_dir)` (the trainer calls it, and the commands that know their run
directory) writes them, and everything after, to `<run_dir>/megapkl.log`. megapkl's own log
records still reach the terminal too. A process that never learns its run directory says at exit
how many warnings it hid. Without `quiet()` nothing changes (library use, tests).
"""
from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Optional

LOG_FILE = "megapkl.log"
_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s"
_state: dict = {"buffer": None, "file": None, "pid": None}


# Loggers whose parent prints on its own (torch's "torch" logger has a terminal handler and does
# not propagate), with records known to come at import: handed to the root's handlers instead.
PRINTING_LOGGERS = ("torch.utils.cpp_extension",)


class _ToRoot(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        for h in logging.getLogger().handlers:
            if record.levelno >= h.level:
                h.handle(record)


class _Own(logging.Filter):
    """megapkl's own records (they are shown on the terminal as well)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] == "megapkl"


def quiet() -> None:
    """Route warnings and other libraries' log records away from the terminal (idempotent)."""
    if _state["buffer"] is not None:
        return
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    root = logging.getLogger()
    buffer = logging.handlers.BufferingHandler(capacity=10_000)
    root.addHandler(buffer)
    own = logging.StreamHandler(sys.stderr)
    own.addFilter(_Own())
    own.setLevel(logging.WARNING)
    root.addHandler(own)
    for name in PRINTING_LOGGERS:  # before torch installs its own terminal handler above them
        logger = logging.getLogger(name)
        logger.propagate = False
        logger.addHandler(_ToRoot())
    _state.update(buffer=buffer, pid=os.getpid())
    atexit.register(_report)


def _tame_libraries() -> None:
    """Libraries that print their log records themselves (torch installs a handler on its
    loggers at import): hand their records to the root logger instead."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or name.split(".")[0] == "megapkl":
            continue
        for h in list(logger.handlers):  # a terminal stream (torch's handler is no StreamHandler)
            if not isinstance(h, logging.FileHandler) \
                    and getattr(h, "stream", None) in (sys.stderr, sys.stdout):
                logger.removeHandler(h)
                logger.propagate = True


def attach(run_dir: str | os.PathLike) -> Optional[Path]:
    """From now on (and what was held so far) into <run_dir>/megapkl.log; the path, or None when
    the terminal is not quiet. A process forked after `attach` keeps writing to the same file."""
    buffer = _state["buffer"]
    if buffer is None:
        return None
    _tame_libraries()
    path = Path(run_dir) / LOG_FILE
    current = _state["file"]
    if current is not None and Path(current.baseFilename) == path.resolve():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger()
    if current is not None:
        root.removeHandler(current)
        current.close()
    root.removeHandler(buffer)
    root.addHandler(handler)
    if os.getpid() == _state["pid"]:  # what this process held (a forked child: its parent's)
        for record in buffer.buffer:
            handler.handle(record)
    buffer.buffer.clear()
    _state["file"] = handler
    return path


def _report() -> None:
    buffer = _state["buffer"]
    if buffer is None or os.getpid() != _state["pid"] or _state["file"] is not None:
        return
    hidden = [r for r in buffer.buffer if not _Own().filter(r)]
    if hidden:
        print(f"megapkl: {len(hidden)} warning(s) of other libraries hidden (--debug shows them)",
              file=sys.stderr)
