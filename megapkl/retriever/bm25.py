"""The BM25 backend, on bm25s (sparse-matrix BM25, numpy/scipy only: the CPU default).

Search-R1's BM25 server is pyserini's Lucene searcher with its defaults; this backend follows
them where bm25s can: Lucene's BM25 variant with k1 0.9 and b 0.4 (Anserini's defaults),
lower-cased words, English stop words removed, Porter stemming (Lucene's EnglishAnalyzer uses
the Porter stemmer). Like Lucene, a passage sharing no term with the query is not a hit: a
query with no known term gets no passages.

Build memory: the token ids of the whole corpus are held once as Python lists before bm25s
builds its sparse matrix (about 1.5 GB per million 100-word passages); the saved index is
loaded memory-mapped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

K1, B, METHOD = 0.9, 0.4, "lucene"  # Anserini / pyserini defaults (what Search-R1 serves)
CHUNK = 50_000  # passages tokenized at a time while building
ANALYZER = {"k1": K1, "b": B, "method": METHOD, "stemmer": "porter", "stopwords": "en"}


def _tokenizer():
    import Stemmer
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, stopwords="en", stemmer=Stemmer.Stemmer("porter"))


class BM25Backend:
    """A bm25s index and the tokenizer (vocabulary, stop words) it was built with."""

    name = "bm25"

    def __init__(self, model, tokenizer, threads: int = 0) -> None:
        self.model, self.tokenizer, self.threads = model, tokenizer, threads

    @property
    def rows(self) -> int:
        return int(self.model.scores["num_docs"])

    @classmethod
    def build(cls, contents: Iterable[str], out: Path) -> int:
        """Index the passages (in corpus order) into directory `out`; returns their count."""
        import bm25s

        tok = _tokenizer()
        ids: list[list[int]] = []
        chunk: list[str] = []
        for text in contents:
            chunk.append(text)
            if len(chunk) == CHUNK:
                ids += tok.tokenize(chunk, update_vocab=True, return_as="ids", show_progress=False)
                chunk = []
        if chunk:
            ids += tok.tokenize(chunk, update_vocab=True, return_as="ids", show_progress=False)
        model = bm25s.BM25(k1=K1, b=B, method=METHOD)
        model.index((ids, tok.get_vocab_dict()), show_progress=False)
        out.mkdir(parents=True, exist_ok=True)
        model.save(str(out), show_progress=False)
        tok.save_vocab(str(out))
        tok.save_stopwords(str(out))
        return len(ids)

    @classmethod
    def load(cls, path: Path, threads: int = 0) -> "BM25Backend":
        import bm25s

        model = bm25s.BM25.load(str(path), mmap=True, load_vocab=True, show_progress=False)
        tok = _tokenizer()
        tok.load_vocab(str(path))
        tok.load_stopwords(str(path))
        return cls(model, tok, threads)

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [Q, k'] int64, scores [Q, k'] float32), best first, k' = min(k, rows); a row of
        -1 marks no hit (no shared term)."""
        k = min(int(k), self.rows)
        q = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids",
                                    show_progress=False)
        res = self.model.retrieve(q, k=k, show_progress=False, n_threads=self.threads,
                                  return_as="tuple")
        rows = np.asarray(res.documents, dtype=np.int64).reshape(len(queries), k)
        scores = np.asarray(res.scores, dtype=np.float32).reshape(len(queries), k)
        rows[scores <= 0] = -1
        return rows, scores

    def close(self) -> None:
        self.model = None

