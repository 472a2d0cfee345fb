"""The retrieval server: Search-R1's wire contract over HTTP (docs/search-agent.md).

    POST /retrieve  {"queries": [str, ...], "topk": int | null, "return_scores": bool}
        -> {"result": [[{"document": {"id", "contents", ...}, "score": float}, ...], ...]}
           (return_scores false: [[document, ...], ...])
    GET  /health    -> {"status": "ok", "backend", "rows", "topk"}

One list of hits per query, in the order of the queries, best first; `topk` null or 0 takes the
server's `--topk` (Search-R1's fallback). A malformed body is answered 422 with FastAPI's
{"detail": [{"loc", "msg", "type"}]}, an unknown route 404, a failure while searching 500.

The HTTP layer is the standard library's ThreadingHTTPServer (one thread per connection, as
`megapkl serve`); at most `max_inflight` searches run at once, the others wait their turn. The
server binds 127.0.0.1 unless told another address; it has no route that loads code or tensors,
but beyond loopback the corpus is readable by whoever reaches the port.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from megapkl.errors import MegapklError
from megapkl.parallel.threads import start_thread

log = logging.getLogger("megapkl.retriever")

MAX_BODY = 16 << 20  # bytes of one request body


class BadRequest(MegapklError, ValueError):
    """A /retrieve body the contract refuses (answered 422 with FastAPI's detail shape)."""

    def __init__(self, field: str, msg: str, kind: str = "value_error"):
        super().__init__(msg)
        self.detail = [{"loc": ["body", field], "msg": msg, "type": kind}]


def parse_request(body: Any, *, max_queries: int, max_topk: int) -> tuple[list[str], Optional[int],
                                                                            bool]:
    """(queries, topk or None, return_scores) of a /retrieve body; BadRequest otherwise. Fields
    other than these three are ignored (as Search-R1's pydantic model does)."""
    if not isinstance(body, dict):
        raise BadRequest("", "Input should be a valid dictionary", "dict_type")
    if "queries" not in body:
        raise BadRequest("queries", "Field required", "missing")
    queries = body["queries"]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest("queries", "Input should be a valid list of strings", "list_type")
    if len(queries) > max_queries:
        raise BadRequest("queries", f"at most {max_queries} queries per request (--max-queries)")
    topk = body.get("topk")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 0):
        raise BadRequest("topk", "Input should be a valid non-negative integer", "int_type")
    if topk is not None and topk > max_topk:
        raise BadRequest("topk", f"at most {max_topk} passages per query (--max-topk)")
    scores = body.get("return_scores", False)
    if not isinstance(scores, bool):
        raise BadRequest("return_scores", "Input should be a valid boolean", "bool_type")
    return queries, (topk or None), scores


class RetrievalServer:
    """Serves a `megapkl.retriever.index.Retriever` (anything with `search(queries, topk)` and
    `rows`) on host:port; `start()` runs it on a thread, `serve_forever()` in the caller."""

    def __init__(self, retriever: Any, *, host: str = "127.0.0.1", port: int = 8000,
                 topk: int = 3, max_inflight: int = 8, max_queries: int = 4096,
                 max_topk: int = 100) -> None:
        self.retriever, self.topk = retriever, topk
        self.max_queries, self.max_topk = max_queries, max_topk
        self._slots = threading.BoundedSemaphore(max_inflight)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - the stdlib's name
                if self.path.split("?")[0] == "/health":
                    self._send(200, {"status": "ok", "backend": server.backend_name,
                                     "rows": server.retriever.rows, "topk": server.topk})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                if self.path.split("?")[0] != "/retrieve":
                    self._send(404, {"detail": "Not Found"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self._send(413, {"detail": f"request body over {MAX_BODY} bytes"})
                    return
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw) if raw else None
                    code, answer = 200, server.retrieve(body)
                except json.JSONDecodeError as e:
                    code, answer = 422, {"detail": [{"loc": ["body", e.pos], "msg": "JSON decode "
                                                     "error", "type": "json_invalid"}]}
                except BadRequest as e:
                    code, answer = 422, {"detail": e.detail}
                except Exception as e:  # noqa: BLE001 - the search failed: 500, logged
                    log.exception("retrieval failed")
                    code, answer = 500, {"detail": f"Internal Server Error: {type(e).__name__}: {e}"}
                self._send(code, answer)

            def _send(self, code: int, payload: Any) -> None:
                data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt, *args):  # per-request lines only in debug logs
                log.debug("%s " + fmt, self.address_string(), *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._thread: Optional[threading.Thread] = None

    @property
    def backend_name(self) -> str:
        return getattr(getattr(self.retriever, "backend", None), "name", "unknown")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    def retrieve(self, body: Any) -> dict:
        queries, topk, scores = parse_request(body, max_queries=self.max_queries,
                                              max_topk=self.max_topk)
        with self._slots:
            hits = self.retriever.search(queries, topk or self.topk)
        if scores:
            return {"result": [[{"document": h.document, "score": h.score} for h in q]
                               for q in hits]}
        return {"result": [[h.document for h in q] for q in hits]}

    def start(self) -> "RetrievalServer":
        self._thread = start_thread(self.httpd.serve_forever, name="megapkl-retriever")
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:  # serve_forever runs on our thread: stop it first
            self.httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.httpd.server_close()
