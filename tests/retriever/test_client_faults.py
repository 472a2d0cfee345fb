"""The search environment's retriever client against servers that fail: dead, slow, 5xx,
malformed. Each failure is one line naming the URL and the config key."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megapkl.envs.retriever_client import RetrieverClient, RetrieverError
from megapkl.rollout.turns import EnvError


class Scripted:
    """A server answering /retrieve by a script: a list of (status, body or None, delay_s); the
    last entry repeats. Counts requests and the queries of each."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, answer, delay = outer.script[min(len(outer.requests),
                                                         len(outer.script)) - 1]
                time.sleep(delay)
                if answer is None:  # echo: one hit per query naming it
                    answer = {"result": [[{"document": {"id": q, "contents": f'"{q}"\ntext'},
                                           "score": 1.0}] for q in body["queries"]]}
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client that timed out before the answer (what some tests ask)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    s = Scripted(request.param)
    yield s
    s.close()


def client(url, **kw):
    kw = {"timeout_s": 0.5, "max_retries": 1, **kw}
    return RetrieverClient(url, key="env.search.url", **kw)


def one_line(exc, url):
    text = str(exc)
    assert "\n" not in text and text.startswith(f"retriever {url} (env.search.url): "), text
    assert isinstance(exc, EnvError)  # the turn driver handles it as env.on_error says
    return text


def test_dead():
    url = "http://127.0.0.1:9/retrieve"  # nothing listens on the discard port
    c = client(url)
    with pytest.raises(RetrieverError) as e:
        c.search("q")
    assert "2 attempt(s) failed: connection refused" in one_line(e.value, url)
    c.close()


@pytest.mark.parametrize("server", [[(200, None, 2.0)]], indirect=True)
def test_slow(server):
    c = client(server.url)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError) as e:
        c.search("q")
    assert time.monotonic() - t0 < 1.9  # two tries of 0.5 s and a 0.5 s pause
    assert "no answer within 0.5 s (timeout)" in one_line(e.value, server.url)
    c.close()


@pytest.mark.parametrize("server", [[(500, {"detail": "boom"}, 0), (200, None, 0)]],
                         indirect=True)
def test_5xx_is_retried(server):
    c = client(server.url)
    assert c.search("paris")[0]["document"]["id"] == "paris"
    assert len(server.requests) == 2
    c.close()


@pytest.mark.parametrize("server", [[(503, {"detail": "overloaded"}, 0)]], indirect=True)
def test_5xx_every_time(server):
    c = client(server.url)
    with pytest.raises(RetrieverError) as e:
        c.search("q")
    assert 'HTTP 503: {"detail": "overloaded"}' in one_line(e.value, server.url)
    assert len(server.requests) == 2
    c.close()


@pytest.mark.parametrize("server", [[(422, {"detail": "bad"}, 0)]], indirect=True)
def test_4xx_is_not_retried(server):
    c = client(server.url)
    with pytest.raises(RetrieverError) as e:
        c.search("q")
    assert "HTTP 422 (the request was refused, not retried)" in one_line(e.value, server.url)
    assert len(server.requests) == 1
    c.close()


@pytest.mark.parametrize("server", [[(200, "<html>not json</html>", 0)],
                                    [(200, {"results": []}, 0)],
                                    [(200, {"result": [[{"document": {"id": 1}}]]}, 0)],
                                    [(200, {"result": []}, 0)]], indirect=True)
def test_malformed_answer(server):
    c = client(server.url)
    with pytest.raises(RetrieverError) as e:
        c.search("q")
    assert "malformed answer: " in one_line(e.value, server.url)
    c.close()


@pytest.mark.parametrize("server", [[(200, None, 0.05)]], indirect=True)
def test_a_turns_queries_go_in_one_request(server):
    """Queries asked at the same time (the tool threads of one turn) share a request, and
    each gets its own hits back."""
    c = client(server.url, batch_wait_s=0.05, max_batch=16, timeout_s=5)
    queries = [f"q{i}" for i in range(12)]
    out = {}
    threads = [threading.Thread(target=lambda q=q: out.__setitem__(q, c.search(q)))
               for q in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {q: h[0]["document"]["id"] for q, h in out.items()} == {q: q for q in queries}
    assert len(server.requests) < len(queries)
    assert sorted(q for r in server.requests for q in r["queries"]) == sorted(queries)
    assert all(r["topk"] == 3 and r["return_scores"] is True for r in server.requests)
    c.close()
