"""One live run per run directory: an advisory lock on `<run_dir>/.lock`.

The lock is an fcntl/flock lock held by rank 0 for the life of the run, so the kernel drops it
when the process dies however it dies (SIGKILL, OOM, node reboot on a local disk): a stale lock
file from a dead run is simply taken over. The file records the holder (host, pid, start time) for
the message a second run gets. Network file systems that support POSIX locks (NFSv4, Lustre with
flock) carry it across nodes.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from megapkl.errors import MegapklError

LOCK = ".lock"


class RunLockError(MegapklError, RuntimeError):
    """The run directory is in use by a live run."""


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd: Optional[int] = None

    def _holder(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return "another process"
        return f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')}"

    def _refused(self) -> RunLockError:
        return RunLockError(f"run directory {self.path.parent} is in use by a live run "
                            f"({self._holder()}; lock {self.path}); stop it or choose another "
                            "run_dir")

    def acquire(self) -> "RunLock":
        """Take the lock (a dead holder's lock is free); RunLockError if a live run holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refused() from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        self._fd = fd
        return self

    def check_free(self) -> None:
        """RunLockError if a live run holds the lock (takes and releases it otherwise)."""
        if not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._refused() from None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    close = release  # the run context closes what it holds
