"""`megapkl serve`'s HTTP layer: the standard library's ThreadingHTTPServer (one thread per
connection), JSON bodies in, SGLang's response kinds out (JSON, text, or a body with no
Content-Type); the routes are the app's (`SGLangCompatServer.dispatch`, megapkl/serve/serve.py)."""
from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("megapkl.serve")


class _Untyped(str):
    """A text body sent without a Content-Type header (SGLang's plain `Response(content=...)`)."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "megapkl-serve"
    protocol_version = "HTTP/1.1"
    app: Any  # the SGLangCompatServer whose dispatch answers

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as exc:
                self._send(400, {"error": f"invalid JSON body: {exc}"})
                return
        try:
            status, out = self.app.dispatch(method, self.path, body)
        except Exception as exc:  # a bug, not bad input: still answer, and keep serving
            log.exception("request %s %s failed", method, self.path)
            status, out = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        self._send(status, out)

    def _send(self, status: int, out: Any) -> None:
        if out is None:
            data, kind = b"null", "application/json"
        elif isinstance(out, _Untyped):
            data, kind = out.encode(), None
        elif isinstance(out, str):
            data, kind = out.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(out).encode(), "application/json"
        self.send_response(status)
        if kind is not None:
            self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


def make_http_server(app: Any, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"app": app})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
