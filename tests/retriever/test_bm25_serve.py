"""The BM25 backend (bm25s) and the server's wire contract (Search-R1's /retrieve)."""
import http.client
import json

import pytest

from megapkl.retriever.corpus import CorpusError
from megapkl.retriever.index import build_index, open_index
from megapkl.retriever.server import RetrievalServer


def post(url, path, body, method="POST"):
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode())
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.fixture
def bm25(corpus, tmp_path):
    build_index(str(corpus), str(tmp_path / "ix"), "bm25")
    r = open_index(str(tmp_path / "ix"))
    yield r
    r.close()


def test_bm25_finds_the_passage_and_matches_the_library(bm25):
    import bm25s

    hits = bm25.search(["capital of France", "Which city is the capital of Japan?"], 3)
    assert hits[0][0].document == {"id": "0", "contents": '"Paris"\nParis is the capital city of '
                                   'France.'}
    assert hits[1][0].document["id"] == "4"
    assert hits[0][0].score > hits[0][1].score > 0
    # the scores are bm25s's own for the same index and query tokens
    q = bm25.backend.tokenizer.tokenize(["capital of France"], update_vocab=False,
                                        return_as="ids", show_progress=False)
    docs, scores = bm25.backend.model.retrieve(q, k=3, show_progress=False)
    assert [h.score for h in hits[0]] == pytest.approx(scores[0].tolist())
    assert bm25.backend.model.k1 == 0.9 and bm25.backend.model.b == 0.4


def test_no_shared_term_is_no_hit(bm25):
    """Lucene's rule (Search-R1's BM25 server): a passage sharing no term is not returned."""
    assert bm25.search(["zzyzx qwerty", ""], 3) == [[], []]


def test_server_contract(bm25):
    server = RetrievalServer(bm25, port=0, topk=2).start()
    try:
        code, ans = post(server.url, "/retrieve", {"queries": ["capital of Egypt", "Peru"],
                                                   "topk": 3, "return_scores": True})
        assert code == 200 and list(ans) == ["result"] and len(ans["result"]) == 2
        first = ans["result"][0][0]
        assert set(first) == {"document", "score"} and first["document"]["id"] == "5"
        assert set(first["document"]) == {"id", "contents"} and isinstance(first["score"], float)
        # topk null / 0: the server's --topk; return_scores false: bare documents
        for topk in (None, 0):
            code, ans = post(server.url, "/retrieve", {"queries": ["capital city"], "topk": topk})
            assert code == 200 and len(ans["result"][0]) == 2
            assert set(ans["result"][0][0]) == {"id", "contents"}
        code, ans = post(server.url, "/retrieve", {"queries": ["a"], "extra": 1})  # ignored
        assert code == 200
        for bad, field in (({"topk": 3}, "queries"), ({"queries": "x"}, "queries"),
                           ({"queries": ["x"], "topk": "3"}, "topk"),
                           ({"queries": ["x"], "return_scores": "yes"}, "return_scores"),
                           ({"queries": ["x"], "topk": 1000}, "topk")):
            code, ans = post(server.url, "/retrieve", bad)
            assert code == 422 and ans["detail"][0]["loc"] == ["body", field], bad
        assert post(server.url, "/nope", {})[0] == 404
        code, ans = post(server.url, "/health", None, method="GET")
        assert code == 200 and ans == {"status": "ok", "backend": "bm25", "rows": 68, "topk": 2}
    finally:
        server.close()


def test_a_failing_search_is_a_500(bm25):
    class Broken:
        rows, backend = 1, None

        def search(self, queries, topk):
            raise RuntimeError("disk gone")
    server = RetrievalServer(Broken(), port=0).start()
    try:
        code, ans = post(server.url, "/retrieve", {"queries": ["x"]})
        assert code == 500 and "disk gone" in ans["detail"]
    finally:
        server.close()


def test_bad_corpus_names_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "1", "contents": "ok"}\n\n{"id": "2", "text": "no contents"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:3: 'contents' must be a string"):
        build_index(str(p), str(tmp_path / "ix"))


def test_a_changed_corpus_is_refused(corpus, tmp_path):
    build_index(str(corpus), str(tmp_path / "ix"))
    with open(corpus, "a") as f:
        f.write('{"id": "new", "contents": "appended"}\n')
    with pytest.raises(CorpusError, match="rebuild the index"):
        open_index(str(tmp_path / "ix"))
