"""`megapkl retriever index` (build an index over a corpus) and `megapkl retriever serve`.

    megapkl retriever index --corpus wiki-18.jsonl --out indexes/wiki18-bm25
    megapkl retriever index --corpus wiki-18.jsonl --out indexes/wiki18-e5 --backend e5 --faiss flat
    megapkl retriever index --corpus wiki-18.jsonl --out indexes/wiki18-e5 --backend e5 \\
        --faiss-index e5_Flat.index          # Search-R1's prebuilt index, used in place
    megapkl retriever serve --index indexes/wiki18-bm25 --port 8000
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

log = logging.getLogger("megapkl.retriever")


def cmd_index(args: argparse.Namespace) -> int:
    from megapkl.retriever.index import build_index

    m = build_index(args.corpus, args.out, args.backend, encoder=args.encoder,
                    faiss_kind=args.faiss, hnsw_m=args.hnsw_m, faiss_index=args.faiss_index,
                    device=args.device, batch_size=args.batch_size, max_length=args.max_length)
    kind = f" ({m.get('faiss')})" if m["backend"] == "e5" else ""
    print(f"megapkl retriever: {m['backend']}{kind} index of {m['rows']} passages from "
          f"{m['corpus']} in {m['build_seconds']} s -> {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from megapkl.retriever.index import open_index
    from megapkl.retriever.server import RetrievalServer
    from megapkl.rollout.sglang.http import is_loopback

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if not is_loopback(args.host):
        log.warning("listening on %s: the corpus is readable by anyone who reaches port %d",
                    args.host, args.port)
    retriever = open_index(args.index, gpu=args.gpu, threads=args.threads, encoder=args.encoder,
                           device=args.device, ef_search=args.ef_search)
    server = RetrievalServer(retriever, host=args.host, port=args.port, topk=args.topk,
                             max_inflight=args.max_inflight, max_queries=args.max_queries,
                             max_topk=args.max_topk)
    where = " on GPU" if getattr(retriever.backend, "on_gpu", False) else ""
    print(f"megapkl retriever: serving {retriever.rows} passages ({retriever.backend.name}"
          f"{where}) at {server.url}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        retriever.close()
    return 0


def add_subcommands(sub) -> None:
    r = sub.add_parser("retriever", help="the search agent's retrieval service: build an index, "
                       "serve it (Search-R1's /retrieve contract)")
    rsub = r.add_subparsers(dest="retriever_command", required=True, metavar="ACTION")
    ix = rsub.add_parser("index", help="index a corpus JSONL of {id, contents} rows")
    ix.add_argument("--corpus", required=True, help="the corpus JSONL (e.g. wiki-18.jsonl)")
    ix.add_argument("--out", required=True, help="the index directory to write")
    ix.add_argument("--backend", choices=("bm25", "e5"), default="bm25",
                    help="bm25 (bm25s, CPU) or e5 (E5 embeddings + FAISS)")
    ix.add_argument("--encoder", help="e5: the encoder (default intfloat/e5-base-v2, or a local "
                    "copy of it)")
    ix.add_argument("--faiss", choices=("flat", "hnsw"), default="flat",
                    help="e5: exact inner product (flat) or HNSW (approximate, for CPU nodes)")
    ix.add_argument("--hnsw-m", type=int, default=64, help="e5 hnsw: neighbours per node (64)")
    ix.add_argument("--faiss-index", help="e5: a prebuilt FAISS index over this corpus (e.g. "
                    "Search-R1's e5_Flat.index), used in place instead of encoding")
    ix.add_argument("--device", default="auto", help="e5: where the encoder runs (auto: cuda "
                    "when present)")
    ix.add_argument("--batch-size", type=int, default=256, help="e5: passages per forward")
    ix.add_argument("--max-length", type=int, default=256, help="e5: tokens per text (256)")
    ix.set_defaults(func=cmd_index)
    sv = rsub.add_parser("serve", help="serve an index over HTTP (POST /retrieve, GET /health)")
    sv.add_argument("--index", required=True, help="an index directory (megapkl retriever index)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--topk", type=int, default=3, help="passages per query when a request "
                    "does not say (Search-R1: 3)")
    sv.add_argument("--gpu", choices=("auto", "on", "off"), default="auto",
                    help="e5 flat: FAISS on the node's GPUs (auto: when faiss sees one)")
    sv.add_argument("--device", default="auto", help="e5: where the query encoder runs")
    sv.add_argument("--encoder", help="e5: the encoder's path, if not the index's")
    sv.add_argument("--ef-search", type=int, help="e5 hnsw: candidates per search (FAISS "
                    "default 16)")
    sv.add_argument("--threads", type=int, default=0, help="search threads (0: the library's "
                    "default)")
    sv.add_argument("--max-inflight", type=int, default=8, help="searches at once; more wait")
    sv.add_argument("--max-queries", type=int, default=4096, help="queries per request")
    sv.add_argument("--max-topk", type=int, default=100, help="largest topk a request may ask")
    sv.set_defaults(func=cmd_serve)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m megapkl.retriever ...`: the same commands without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="python -m megapkl.retriever")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(["retriever", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        print(f"megapkl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
