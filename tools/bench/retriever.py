"""Benchmark: the retrieval service against its backend library called directly, side by side.

A corpus of generated passages (100 words each, drawn from a Zipf law over 50,000 made-up words,
seeded) is indexed; then the same queries (generated the same way, 6 words each) are searched in
batches of `--batch` (a turn's queries):

- direct: the backend in this process (bm25s's retrieve; the encoder and FAISS's search), rows
  read from the corpus, one batch after another;
- service: `megapkl retriever serve` in its own process, `--concurrency` clients each sending
  batches over HTTP (Search-R1's /retrieve body), as the search environment does.

Printed per backend: queries/s and latency percentiles of a batch (ms) for both, and service /
direct (qps ratio; > 1 when concurrent requests use cores a sequential loop leaves idle).

Dense backends: the real encoder (intfloat/e5-base-v2) is not downloadable everywhere; with
`--encoder` unset the passages get random unit vectors of 768 dimensions (the index's cost is
that of the real one: FAISS sees the same sizes) and queries are encoded by a one-layer random BERT
of hidden size 768 saved by the script (the query path's shape, not e5's cost). With
`--encoder PATH` the passages and queries are encoded for real.

    python tools/bench/retriever.py                                   # 1M passages, every backend
    python tools/bench/retriever.py --passages 200000 --backends bm25,flat
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

WORDS, DIM = 50_000, 768


def words(rng: np.random.Generator, n: int, k: int) -> list[str]:
    ids = np.minimum(rng.zipf(1.2, size=(n, k)), WORDS) - 1
    return [" ".join(f"w{i}" for i in row) for row in ids]


def make_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, n, 50_000):
            for i, text in enumerate(words(rng, min(50_000, n - start), 100), start):
                f.write(json.dumps({"id": str(i), "contents": f'"Title {i}"\n{text}'}) + "\n")


def tiny_encoder(d: Path) -> str:
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "query", "passage", ":"] + \
        [f"w{i}" for i in range(2000)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(d)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=DIM, num_hidden_layers=1,
                         num_attention_heads=12, intermediate_size=1024)).save_pretrained(d)
    return str(d)


def build_dense(corpus: Path, out: Path, kind: str, n: int, encoder: str, real: bool) -> float:
    """The index directory for a dense backend; returns the build seconds."""
    from megapkl.retriever.dense import DenseBackend
    from megapkl.retriever.index import build_index

    t0 = time.monotonic()
    if real:
        build_index(str(corpus), str(out), "e5", encoder=encoder, faiss_kind=kind)
        return time.monotonic() - t0
    import faiss

    index = DenseBackend.empty_index(DIM, kind)
    rng = np.random.default_rng(1)
    for start in range(0, n, 100_000):
        v = rng.standard_normal((min(100_000, n - start), DIM), dtype=np.float32)
        index.add(v / np.linalg.norm(v, axis=1, keepdims=True))
    out.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(out / "prebuilt.index"))
    build_index(str(corpus), str(out), "e5", encoder=encoder, faiss_index=str(out / "prebuilt.index"))
    return time.monotonic() - t0


def direct(index_dir: Path, batches: list[list[str]], topk: int) -> list[float]:
    """Seconds per batch through the backend in this process (rows read from the corpus)."""
    from megapkl.retriever.index import open_index

    r = open_index(str(index_dir), gpu="off")
    out = []
    try:
        r.search(batches[0], topk)  # warm-up
        for b in batches:
            t0 = time.perf_counter()
            rows, _ = r.backend.search(b, topk)
            [[r.corpus.row(int(i)) for i in q if i >= 0] for q in rows]
            out.append(time.perf_counter() - t0)
    finally:
        r.close()
    return out


def service(index_dir: Path, batches: list[list[str]], topk: int, concurrency: int,
            port: int) -> tuple[list[float], float]:
    """Seconds per request and the wall time, `concurrency` clients against the server."""
    log = index_dir / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "megapkl.retriever", "serve", "--index",
                                 str(index_dir), "--port", str(port), "--gpu", "off",
                                 "--max-inflight", str(concurrency)],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        while "serving" not in log.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)

        def one(b: list[str]) -> float:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            t0 = time.perf_counter()
            conn.request("POST", "/retrieve", json.dumps({"queries": b, "topk": topk,
                                                          "return_scores": True}))
            resp = conn.getresponse()
            body = resp.read()
            dt = time.perf_counter() - t0
            conn.close()
            assert resp.status == 200 and len(json.loads(body)["result"]) == len(b)
            return dt

        one(batches[0])  # warm-up
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as pool:
            lat = list(pool.map(one, batches))
        return lat, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def pct(xs: list[float]) -> str:
    a = np.array(xs) * 1000
    return " ".join(f"p{p} {np.percentile(a, p):7.1f}" for p in (50, 90, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--dense-passages", type=int, help="passages of the dense indexes (default: "
                    "--passages; HNSW builds take long on few cores)")
    ap.add_argument("--backends", default="bm25,flat,hnsw")
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="queries per request (a turn's)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--encoder", help="a real E5 encoder (path); default: random vectors")
    ap.add_argument("--port", type=int, default=18931)
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="megapkl-bench-retriever-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    queries = words(rng, args.queries, 6)
    batches = [queries[i:i + args.batch] for i in range(0, len(queries), args.batch)]
    rows = []
    for backend in args.backends.split(","):
        n = args.passages if backend == "bm25" else (args.dense_passages or args.passages)
        corpus = work / f"corpus-{n}.jsonl"
        if not corpus.exists():
            t0 = time.monotonic()
            make_corpus(corpus, n)
            print(f"corpus: {n} passages, {corpus.stat().st_size / 1e9:.2f} GB in "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
        index = work / f"{backend}-{n}"
        t0 = time.monotonic()
        if backend == "bm25":
            from megapkl.retriever.index import build_index

            build_index(str(corpus), str(index), "bm25")
        else:
            encoder = args.encoder or tiny_encoder(work / "tiny-encoder")
            build_dense(corpus, index, backend, n, encoder, real=args.encoder is not None)
        built = time.monotonic() - t0
        d = direct(index, batches, args.topk)
        s, wall = service(index, batches, args.topk, args.concurrency, args.port)
        dq, sq = len(queries) / sum(d), len(queries) / wall
        rows.append((backend, n, built, dq, sq, d, s))
        print(f"{backend}: {n} passages, index built in {built:.0f} s", flush=True)
    print(f"\n{len(queries)} queries in batches of {args.batch}, top-{args.topk}; service: "
          f"{args.concurrency} concurrent clients; {os.cpu_count()} CPUs; latency per batch (ms)")
    for backend, n, built, dq, sq, d, s in rows:
        print(f"{backend:5s} {n:>9d}  direct {dq:8.1f} q/s  {pct(d)}")
        print(f"{'':5s} {'':>9s}  service {sq:7.1f} q/s  {pct(s)}   service/direct {sq / dq:.2f}")


if __name__ == "__main__":
    main()
