"""The dense backend: an E5 encoder (intfloat/e5-base-v2 by default) and a FAISS index.

The encoder is Search-R1's (search_r1/search/retrieval_server.py, index_builder.py): the
texts prefixed "query: " or "passage: ", at most 256 tokens, the last hidden states averaged
over the attention mask and L2-normalised, so the index's inner product is the cosine. On a
GPU the encoder runs in float16, as Search-R1's does.

Indexes: `flat` (exact inner product; FAISS on every GPU of the node when faiss has GPU support
and one is present, sharded in float16 as Search-R1 loads it) and `hnsw` (HNSW with M neighbours,
64 as Search-R1's CPU index; approximate, for nodes without a GPU). A flat index of wiki-18
holds 21,015,324 x 768 float32 = 64.6 GB, in memory while served.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

E5_MODEL = "intfloat/e5-base-v2"
MAX_LENGTH = 256  # Search-R1's query and passage limit
HNSW_M = 64  # Search-R1's CPU index: HNSW64


class E5Encoder:
    """Texts -> L2-normalised mean-pooled embeddings (float32 [n, hidden])."""

    def __init__(self, model: str = E5_MODEL, *, device: str = "auto",
                 max_length: int = MAX_LENGTH, batch_size: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device, self.max_length, self.batch_size = device, max_length, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        net = AutoModel.from_pretrained(model)
        self.model = (net.half() if device.startswith("cuda") else net).to(device).eval()
        self.name = model
        self.dim = int(self.model.config.hidden_size)
        # A fast tokenizer with padding and truncation set is not safe to call from two threads
        self._lock = threading.Lock()

    def encode(self, texts: list[str], kind: str) -> np.ndarray:
        """`kind` "query" or "passage": E5's prefix."""
        if kind not in ("query", "passage"):
            raise ValueError(f"E5Encoder.encode: kind must be 'query' or 'passage', got {kind!r}")
        out = [self._batch([f"{kind}: {t}" for t in texts[i:i + self.batch_size]])
               for i in range(0, len(texts), self.batch_size)]
        return np.concatenate(out) if out else np.zeros((0, self.dim), dtype=np.float32)

    def _batch(self, texts: list[str]) -> np.ndarray:
        import torch

        with self._lock:
            enc = self.tokenizer(texts, max_length=self.max_length, padding=True, truncation=True,
                                 return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**enc, return_dict=True).last_hidden_state
        return mean_pool_normalize(hidden, enc["attention_mask"]).float().cpu().numpy()


def mean_pool_normalize(hidden, mask):
    """Mean of `hidden` [n, t, d] over the positions `mask` [n, t] marks, L2-normalised."""
    import torch

    m = mask[..., None].to(hidden.dtype)
    pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("the dense retriever needs FAISS: pip install 'megapkl[search]' "
                          "(faiss-cpu; faiss-gpu builds come from conda)") from None
    return faiss


def faiss_gpus() -> int:
    faiss = _faiss()
    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


class DenseBackend:
    """A FAISS inner-product index over E5 passage embeddings, searched with E5 query ones."""

    name = "e5"

    def __init__(self, index, encoder: E5Encoder, on_gpu: bool = False) -> None:
        self.index, self.encoder, self.on_gpu = index, encoder, on_gpu

    @property
    def rows(self) -> int:
        return int(self.index.ntotal)

    @staticmethod
    def empty_index(dim: int, kind: str, hnsw_m: int = HNSW_M):
        faiss = _faiss()
        if kind == "flat":
            return faiss.IndexFlatIP(dim)
        if kind == "hnsw":
            return faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        raise ValueError(f"faiss index kind must be 'flat' or 'hnsw', got {kind!r}")

    @classmethod
    def build(cls, contents: Iterable[str], encoder: E5Encoder, out_file: Path, *,
              kind: str = "flat", hnsw_m: int = HNSW_M, chunk: int = 8192) -> int:
        """Encode the passages (in corpus order) and write the index to `out_file`; returns the
        number of passages."""
        faiss = _faiss()
        index = cls.empty_index(encoder.dim, kind, hnsw_m)
        batch: list[str] = []
        for text in contents:
            batch.append(text)
            if len(batch) == chunk:
                index.add(encoder.encode(batch, "passage"))
                batch = []
        if batch:
            index.add(encoder.encode(batch, "passage"))
        out_file.parent.mkdir(parents=True, exist_ok=True)
        faiss.write_index(index, str(out_file))
        return int(index.ntotal)

    @classmethod
    def load(cls, index_file: Path, encoder: E5Encoder, *, gpu: str = "auto",
             ef_search: Optional[int] = None) -> "DenseBackend":
        """`gpu`: "auto" (every GPU faiss sees, if any), "on" (an error without one), "off"."""
        faiss = _faiss()
        index = faiss.read_index(str(index_file))
        if index.d != encoder.dim:
            raise ValueError(f"{index_file}: vectors of {index.d} dimensions, the encoder "
                             f"{encoder.name} makes {encoder.dim}")
        if ef_search is not None and hasattr(index, "hnsw"):
            index.hnsw.efSearch = int(ef_search)
        gpus = faiss_gpus() if gpu != "off" else 0
        if gpu == "on" and gpus == 0:
            raise RuntimeError("--gpu on: this faiss build sees no GPU (faiss-cpu has no GPU "
                               "support; install a faiss-gpu build)")
        on_gpu = gpus > 0 and not hasattr(index, "hnsw")
        if on_gpu:  # Search-R1's placement: float16, sharded over every GPU
            co = faiss.GpuMultipleClonerOptions()
            co.useFloat16, co.shard = True, True
            index = faiss.index_cpu_to_all_gpus(index, co=co)
        return cls(index, encoder, on_gpu)

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [Q, k'] int64, scores [Q, k'] float32), best first, k' = min(k, rows); -1 marks
        no hit (an HNSW search can find fewer than k)."""
        k = min(int(k), self.rows)
        scores, rows = self.index.search(self.encoder.encode(list(queries), "query"), k)
        return rows.astype(np.int64), scores.astype(np.float32)

    def close(self) -> None:
        self.index = None
