"""The search environment's client of a retrieval server with Search-R1's contract: megapkl's own
(`megapkl retriever serve`) or Search-R1's `retrieval_server.py`.

    POST <url> {"queries": [...], "topk": k, "return_scores": true}
      -> {"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}

The turn driver runs the environment's steps of many trajectories at once on its tool threads;
each step asks for one query. `RetrieverClient.search` gathers the queries asked at about the
same time (within `batch_wait_s`, at most `max_batch`) into one request, as Search-R1 sends a
turn's queries together; at most `concurrency` requests are in flight. Each request waits at
most `timeout_s`; a refused or reset connection, a timeout or a 5xx is retried `max_retries`
times (0.5 s, 1 s, ... apart), a 4xx is not. A failure is a `RetrieverError`, one line naming
the URL and the config key (an `EnvError`: the turn driver handles it as `env.on_error` says).
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import threading
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from megapkl.parallel.threads import rank_executor, start_thread
from megapkl.rollout.turns import EnvError


class RetrieverError(EnvError):
    """The retriever is dead, slow, failing or answers something else than the contract."""


def endpoint(url: str) -> str:
    """`url` as the /retrieve endpoint (a base URL gets /retrieve appended)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"'{url}' is not an http(s) URL")
    return url if parts.path.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"


def check_answer(answer: Any, n: int) -> list[list[dict]]:
    """The hits of an answer for `n` queries; ValueError saying what is wrong."""
    if not isinstance(answer, dict) or not isinstance(answer.get("result"), list):
        raise ValueError(f"expected {{\"result\": [...]}}, got {_short(answer)}")
    result = answer["result"]
    if len(result) != n:
        raise ValueError(f"{len(result)} result lists for {n} queries")
    for i, hits in enumerate(result):
        if not isinstance(hits, list):
            raise ValueError(f"result[{i}] is not a list: {_short(hits)}")
        for j, hit in enumerate(hits):
            doc = hit.get("document") if isinstance(hit, dict) else None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise ValueError(f"result[{i}][{j}] has no document.contents string: "
                                 f"{_short(hit)}")
    return result


def _short(value: Any, n: int = 120) -> str:
    """A value (a text as it is, anything else as JSON) on one line, at most `n` characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text[:4 * n].split())
    return text[:n] + ("..." if len(text) > n else "")


class RetrieverClient:
    """Queries -> hits from the retriever at `url` (see the module docstring). `key`: the config
    key that names the URL, for error messages. Owns one batching thread: close() it."""

    def __init__(self, url: str, *, topk: int = 3, timeout_s: float = 10.0, max_retries: int = 2,
                 concurrency: int = 4, max_batch: int = 64, batch_wait_s: float = 0.005,
                 key: str = "env.search.url") -> None:
        self.url, self.key = endpoint(url), key
        self.topk, self.timeout_s, self.max_retries = int(topk), float(timeout_s), int(max_retries)
        self.max_batch, self.batch_wait_s = int(max_batch), float(batch_wait_s)
        self._pool = rank_executor(concurrency, "megapkl-retrieve")
        self._cond = threading.Condition()
        self._pending: list[tuple[str, cf.Future]] = []
        self._closed = False
        self._thread = start_thread(self._gather, name="megapkl-retrieve-batch")

    # ---- what the environment calls

    def search(self, query: str) -> list[dict]:
        """The hits of one query (batched with the queries asked at the same time)."""
        fut: cf.Future = cf.Future()
        with self._cond:
            if self._closed:
                raise RetrieverError(self._where("the client is closed"))
            self._pending.append((query, fut))
            self._cond.notify()
        return fut.result()

    def search_batch(self, queries: list[str]) -> list[list[dict]]:
        """The hits of each query, in one request (retried as the module docstring says)."""
        if not queries:
            return []
        body = json.dumps({"queries": list(queries), "topk": self.topk,
                           "return_scores": True}).encode()
        errors: list[str] = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            try:
                status, text = self._post(body)
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
                errors.append(_describe(exc, self.timeout_s))
                continue
            if status >= 500:
                errors.append(f"HTTP {status}: {_short(text)}")
                continue
            if status != 200:
                raise RetrieverError(self._where(f"HTTP {status} (the request was refused, not "
                                                 f"retried): {_short(text)}"))
            try:
                return check_answer(json.loads(text), len(queries))
            except ValueError as exc:  # not JSON, or not the contract
                raise RetrieverError(self._where(f"malformed answer: {exc}")) from None
        raise RetrieverError(self._where(f"{len(errors)} attempt(s) failed: "
                                         + " | ".join(errors[-3:])))

    def check(self) -> None:
        """One query through the whole path (works against Search-R1's server, which has no
        /health route); RetrieverError when it fails."""
        self.search_batch(["health check"])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for _, fut in pending:
            fut.set_exception(RetrieverError(self._where("the client was closed")))
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals

    def _where(self, what: str) -> str:
        return f"retriever {self.url} ({self.key}): {what}"

    def _post(self, body: bytes) -> tuple[int, str]:
        parts = urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=self.timeout_s)
        try:
            conn.request("POST", parts.path or "/", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read().decode("utf-8", errors="replace")
        finally:
            conn.close()

    def _gather(self) -> None:
        """The batching thread: after the first query arrives, wait `batch_wait_s` for others
        (or until `max_batch`), then send them as one request on the pool."""
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                deadline = time.monotonic() + self.batch_wait_s
                while len(self._pending) < self.max_batch and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._pending = self._pending[:self.max_batch], \
                    self._pending[self.max_batch:]
            if batch:
                self._pool.submit(self._send, batch)

    def _send(self, batch: list[tuple[str, cf.Future]]) -> None:
        try:
            hits = self.search_batch([q for q, _ in batch])
        except BaseException as exc:  # noqa: BLE001 - every waiting step gets the error
            err = exc if isinstance(exc, RetrieverError) else RetrieverError(
                self._where(f"{type(exc).__name__}: {exc}"))
            for _, fut in batch:
                fut.set_exception(err)
            return
        for (_, fut), h in zip(batch, hits):
            fut.set_result(h)


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError) or "timed out" in str(exc):
        return f"no answer within {timeout_s:g} s (timeout)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the retriever running?)"
    return f"{type(exc).__name__}: {exc}"
