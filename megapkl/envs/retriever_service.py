"""A retrieval server the run starts and owns (`env.search.index` set): `megapkl retriever serve`
in its own process, health-checked before the first rollout, stopped on every exit.

    with ManagedRetriever(index_dir, log_path=run_dir / "retriever.log") as r:
        client = RetrieverClient(r.url, key="env.search.index")

The process runs in its own session and dies with its parent (the launcher of the SGLang
servers, `megapkl.rollout.sglang.launch.ServerProcess`); close() stops it (SIGTERM, then
SIGKILL). On a Slurm job, `launcher` turns the command into the job's own step on the node the
cluster profile names (`megapkl.launch.retriever.step_launcher`) and says which host to reach.
"""
from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from megapkl.errors import MegapklError

# (command, host) -> (command to run, host other processes reach it at)
Launcher = Callable[[list[str], str], tuple[list[str], str]]


class RetrieverLaunchError(MegapklError, RuntimeError):
    """The managed retriever did not come up; the message names its log."""


class ManagedRetriever:
    def __init__(self, index: str, *, log_path: Path, host: str = "127.0.0.1", port: int = 8000,
                 topk: int = 3, args: Sequence[str] = (), launcher: Optional[Launcher] = None,
                 health_deadline_s: float = 600.0, key: str = "env.search") -> None:
        self.index, self.log_path, self.host, self.port = index, Path(log_path), host, int(port)
        self.topk, self.args, self.launcher = topk, list(args), launcher
        self.health_deadline_s, self.key = float(health_deadline_s), key
        self.proc = None
        self.reach = host

    @property
    def url(self) -> str:
        """The /retrieve endpoint (the retriever's host as other processes reach it)."""
        from megapkl.rollout.sglang.launch import local_address

        return f"http://{local_address(self.reach)}:{self.port}/retrieve"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "megapkl.retriever", "serve", "--index", str(self.index),
                "--host", self.host, "--port", str(self.port), "--topk", str(self.topk),
                *self.args]

    def start(self) -> "ManagedRetriever":
        """Start the server and wait until it answers /health (RetrieverLaunchError if it
        exits first or `health_deadline_s` passes)."""
        from megapkl.rollout.sglang.launch import ServerProcess, port_free

        if not Path(self.index, "manifest.json").is_file():
            raise RetrieverLaunchError(f"{self.key}.index: {self.index} is not an index directory "
                                       "(build it with `megapkl retriever index`)")
        cmd, self.reach = self.command(), self.host
        if self.launcher is not None:
            cmd, self.reach = self.launcher(cmd, self.host)
        elif not port_free(self.host, self.port):
            raise RetrieverLaunchError(f"{self.key}.port: port {self.port} on {self.host} is "
                                       "taken; choose another")
        self.proc = ServerProcess("retriever", self.url, cmd, self.log_path).start()
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        t0, base = time.monotonic(), self.url.rsplit("/", 1)[0]
        while True:
            if not self.proc.alive():
                self._check_own_port(failed=True)
                raise RetrieverLaunchError(
                    f"the retriever ({' '.join(self.proc.cmd[:6])} ...) exited with code "
                    f"{self.proc.popen.returncode} before it answered; log: {self.log_path}: "
                    f"{_last_line(self.proc.log_tail())}")
            if _healthy(base):
                self._check_own_port(failed=False)
                return
            if time.monotonic() - t0 > self.health_deadline_s:
                self.close()
                raise RetrieverLaunchError(
                    f"the retriever at {base} did not answer /health within "
                    f"{self.health_deadline_s:g} s ({self.key}.health_deadline_s); log: "
                    f"{self.log_path}")
            time.sleep(0.2)

    def _check_own_port(self, failed: bool) -> None:
        """A retriever binds its port after loading its index, seconds after the port was found
        free: another process of this host may have taken it meanwhile, so the retriever exits,
        or (worse) that process answers /health and the run would search someone else's index."""
        from megapkl.rollout.sglang.launch import port_lost

        if self.launcher is None and (why := port_lost(self.proc, self.port, failed)):
            self.close()
            raise RetrieverLaunchError(f"{self.key}.port: {why}; choose another")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def __enter__(self) -> "ManagedRetriever":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _healthy(base: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        ok = resp.status == 200 and json.loads(resp.read() or b"{}").get("status") == "ok"
        return ok
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(empty)"
