"""A small blocking HTTP/JSON client (stdlib only) for SGLang-style servers.

Requests run on worker threads (see `fleet.py`), each with its own connection and timeout, so a
dead or hung server only ever blocks the threads talking to it; `Connections.cut(url)` shuts
their sockets down so a server declared dead releases its callers at once.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any, Optional
from urllib.parse import urlsplit

from megapkl.errors import MegapklError
from megapkl.rollout.sglang.protocol import ROUTES, error_message


def is_loopback(host: str) -> bool:
    """Is `host` (a name or an address) this machine's loopback? Weight-update routes unpickle
    tensors, so they are exposed beyond loopback only with an explicit flag."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerUnreachable(MegapklError, ConnectionError):
    """Connection refused / reset / timed out: the server may be dead or hung."""

    url: str = ""


class ServerError(MegapklError, RuntimeError):
    """The server answered with an HTTP error (4xx: the request is wrong; 5xx: the server is)."""

    def __init__(self, url: str, route: str, status: int, message: str):
        super().__init__(f"{url}{route}: {message}")
        self.url, self.route, self.status, self.message = url, route, status, message

    @property
    def client_side(self) -> bool:
        return 400 <= self.status < 500


class Connections:
    """Open connections per base URL, so the ones to a failed server can be cut, and all of them
    when their owner closes (`close`: a request made after it fails at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, set[http.client.HTTPConnection]] = {}
        self.closed = False

    def add(self, url: str, conn: http.client.HTTPConnection) -> None:
        """Register `conn` (connected: it has its socket); shut at once after `close`."""
        with self._lock:
            self._open.setdefault(url, set()).add(conn)
            closed = self.closed
        if closed:
            _shut(conn)

    def remove(self, url: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.get(url, set()).discard(conn)

    def cut(self, url: str) -> int:
        """Shut down every socket open to `url`; the blocked callers get ServerUnreachable."""
        with self._lock:
            conns = list(self._open.pop(url, set()))
        for c in conns:
            _shut(c)
        return len(conns)

    def close(self) -> int:
        """Cut every open connection; every later request through these fails at once."""
        with self._lock:
            self.closed = True
            urls = list(self._open)
        return sum(self.cut(url) for url in urls)


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def request(url: str, route: str, body: Optional[dict] = None, *, timeout: float,
            connections: Optional[Connections] = None, method: Optional[str] = None,
            path: Optional[str] = None) -> Any:
    """Call `route` (a key of ROUTES) on the server at `url`; the parsed JSON answer (or the text
    when it is not JSON). Raises ServerUnreachable or ServerError."""
    m, p = ROUTES[route] if route in ROUTES else (method or "POST", route)
    method, path = method or m, path or p
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"'{url}' is not an http(s) URL")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        if connections is not None:  # connected first: a cut between the two is not missed
            if connections.closed:
                raise ConnectionAbortedError("the connections to the servers are closed")
            conn.connect()
            connections.add(url, conn)
        conn.request(method, (parts.path.rstrip("/") or "") + path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        status = resp.status
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timeout, cut
        err = ServerUnreachable(f"{url}{path}: {type(exc).__name__}: {exc}")
        err.url = url
        raise err from None
    finally:
        if connections is not None:
            connections.remove(url, conn)
        conn.close()
    text = raw.decode("utf-8", errors="replace")
    try:
        payload = json.loads(text) if text else None
    except json.JSONDecodeError:
        payload = text
    if status >= 400:
        raise ServerError(url, path, status, error_message(status, payload))
    if isinstance(payload, dict) and payload.get("success") is False:
        raise ServerError(url, path, status, str(payload.get("message", payload)))
    return payload
