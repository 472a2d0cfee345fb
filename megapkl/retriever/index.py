"""An index directory: what `megapkl retriever index` writes and `megapkl retriever serve` reads.

    DIR/manifest.json        backend, corpus path and size, rows, encoder, FAISS kind, build time
    DIR/corpus.offsets.npy   where each corpus row starts (rows are read from the corpus in place)
    DIR/bm25/                bm25s's index and tokenizer vocabulary (backend bm25)
    DIR/faiss.index          the FAISS index (backend e5; or the manifest names a prebuilt one)

Row i of the index is row i of the corpus. A prebuilt FAISS index over the same corpus (Search-R1
publishes one for wiki-18) is used in place with `--faiss-index FILE`: the manifest names the
file, and its row count must equal the corpus's.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megapkl.retriever.corpus import CorpusError, CorpusFile, iter_rows

FORMAT = 1
BACKENDS = ("bm25", "e5")


class IndexDirError(CorpusError):
    """An index directory that cannot be served as it is; the message names it."""


def _contents(path: Path):
    for _, _, row in iter_rows(path):
        yield row["contents"]


def build_index(corpus: str, out: str, backend: str = "bm25", *, encoder: Optional[str] = None,
                faiss_kind: str = "flat", hnsw_m: int = 64, faiss_index: Optional[str] = None,
                device: str = "auto", batch_size: int = 256, max_length: int = 256) -> dict:
    """Index `corpus` (JSONL of {"id", "contents"}) into directory `out`; returns the manifest."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {backend!r}")
    t0 = time.monotonic()
    src = Path(corpus).resolve()
    docs = CorpusFile.scan(src)  # every row checked before any work
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    np.save(dest / "corpus.offsets.npy", docs.offsets)
    manifest: dict[str, Any] = {"format": FORMAT, "backend": backend, "corpus": str(src),
                                "corpus_bytes": int(docs.offsets[-1]), "rows": len(docs)}
    docs.close()
    if backend == "bm25":
        from megapkl.retriever.bm25 import ANALYZER, BM25Backend

        n = BM25Backend.build(_contents(src), dest / "bm25")
        manifest["bm25"] = dict(ANALYZER)
    else:
        from megapkl.retriever.dense import E5_MODEL, DenseBackend, E5Encoder

        model = encoder or E5_MODEL
        manifest.update(encoder=model, max_length=max_length)
        if faiss_index is not None:
            n = _check_prebuilt(Path(faiss_index), len_rows=manifest["rows"])
            manifest.update(faiss_index=str(Path(faiss_index).resolve()), faiss="prebuilt")
        else:
            enc = E5Encoder(model, device=device, max_length=max_length, batch_size=batch_size)
            n = DenseBackend.build(_contents(src), enc, dest / "faiss.index", kind=faiss_kind,
                                   hnsw_m=hnsw_m)
            manifest.update(faiss=faiss_kind, dim=enc.dim, **({"hnsw_m": hnsw_m}
                                                             if faiss_kind == "hnsw" else {}))
    if n != manifest["rows"]:
        raise IndexDirError(f"{dest}: {n} indexed passages for {manifest['rows']} corpus rows")
    manifest.update(build_seconds=round(time.monotonic() - t0, 1),
                    created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _check_prebuilt(path: Path, len_rows: int) -> int:
    from megapkl.retriever.dense import _faiss

    if not path.is_file():
        raise IndexDirError(f"--faiss-index {path}: no such file")
    index = _faiss().read_index(str(path), _faiss().IO_FLAG_MMAP)
    if int(index.ntotal) != len_rows:
        raise IndexDirError(f"--faiss-index {path}: {index.ntotal} vectors, the corpus has "
                          f"{len_rows} rows (row i of the index must be row i of the corpus)")
    return int(index.ntotal)


def read_manifest(path: str | Path) -> dict:
    f = Path(path) / "manifest.json"
    if not f.is_file():
        raise IndexDirError(f"{path}: not an index directory (no manifest.json; build one with "
                          "`megapkl retriever index`)")
    m = json.loads(f.read_text())
    if m.get("format") != FORMAT or m.get("backend") not in BACKENDS:
        raise IndexDirError(f"{f}: format {m.get('format')} / backend {m.get('backend')!r} is not "
                          f"one this megapkl serves (format {FORMAT}, backends {BACKENDS})")
    return m


@dataclass
class Hit:
    document: dict  # the corpus row: {"id", "contents", ...}
    score: float


class Retriever:
    """A loaded index: queries -> top-k corpus rows with scores."""

    def __init__(self, manifest: dict, corpus: CorpusFile, backend: Any) -> None:
        self.manifest, self.corpus, self.backend = manifest, corpus, backend
        if backend.rows != len(corpus):
            raise IndexDirError(f"the {backend.name} index has {backend.rows} rows, the corpus "
                              f"{corpus.path} has {len(corpus)}")

    @property
    def rows(self) -> int:
        return len(self.corpus)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if not queries:
            return []
        rows, scores = self.backend.search(queries, topk)
        return [[Hit(self.corpus.row(int(r)), float(s)) for r, s in zip(rr, ss) if r >= 0]
                for rr, ss in zip(rows, scores)]

    def close(self) -> None:
        self.backend.close()
        self.corpus.close()


def open_index(path: str, *, gpu: str = "auto", threads: int = 0,
               encoder: Optional[str] = None, device: str = "auto",
               ef_search: Optional[int] = None) -> Retriever:
    """Load index directory `path` for serving. `encoder`: another path of the same encoder
    (e.g. a local copy of e5-base-v2 on an offline node)."""
    d = Path(path)
    m = read_manifest(d)
    corpus = CorpusFile(m["corpus"], np.load(d / "corpus.offsets.npy"))
    try:
        if m["backend"] == "bm25":
            from megapkl.retriever.bm25 import BM25Backend

            backend = BM25Backend.load(d / "bm25", threads=threads)
        else:
            from megapkl.retriever.dense import DenseBackend, E5Encoder

            if threads:
                from megapkl.retriever.dense import _faiss

                _faiss().omp_set_num_threads(threads)
            enc = E5Encoder(encoder or m["encoder"], device=device,
                            max_length=int(m.get("max_length", 256)))
            backend = DenseBackend.load(Path(m.get("faiss_index") or d / "faiss.index"), enc,
                                        gpu=gpu, ef_search=ef_search)
        return Retriever(m, corpus, backend)
    except BaseException:
        corpus.close()
        raise
