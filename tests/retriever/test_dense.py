"""The dense backend: E5 pooling and FAISS (flat, HNSW) with a tiny random BERT made by the test
(transformers' own classes, saved locally: the real intfloat/e5-base-v2 cannot be downloaded here)."""
import numpy as np
import pytest
import torch

from tests.retriever.conftest import corpus_rows

faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def tiny_e5(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = tmp_path_factory.mktemp("tiny-e5")
    words = sorted({w.strip('".?,:').lower() for r in corpus_rows() for w in r["contents"].split()}
                   | {"query", "passage", ":", "which", "city", "what", "is", "of"})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    assert tok.unk_token_id not in tok("query: capital of France")["input_ids"]
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=5 + len(words), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(d)
    return str(d)


def test_e5_pooling_prefix_and_normalisation(tiny_e5):
    from transformers import AutoModel, AutoTokenizer

    from megapkl.retriever.dense import E5Encoder

    enc = E5Encoder(tiny_e5, device="cpu", max_length=16)
    texts = ["Paris", "Nairobi is the capital city of Kenya and a river0 passage"]
    both = enc.encode(texts, "query")
    one = np.concatenate([enc.encode([t], "query") for t in texts])
    # padding never changes an embedding: the mean runs over the attention mask only
    assert np.allclose(both, one, atol=1e-5)
    assert np.allclose(np.linalg.norm(both, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(enc.encode(["Paris"], "passage"), both[:1], atol=1e-3)  # the prefix
    tok, model = AutoTokenizer.from_pretrained(tiny_e5), AutoModel.from_pretrained(tiny_e5)
    x = tok(["query: Paris"], return_tensors="pt")
    with torch.no_grad():
        h = model(**x).last_hidden_state[0]
    want = h.mean(0) / h.mean(0).norm()
    assert np.allclose(both[0], want.numpy(), atol=1e-5)
    # max_length counts [CLS] and [SEP]: 9 keeps "query : capital city of france paris"
    a, b = "capital city of France Paris Berlin", "capital city of France Paris Lima"
    short = E5Encoder(tiny_e5, device="cpu", max_length=9)
    assert np.allclose(short.encode([a], "query"), short.encode([b], "query"), atol=1e-6)
    assert not np.allclose(enc.encode([a], "query"), enc.encode([b], "query"), atol=1e-3)


def test_faiss_index_ranks_by_inner_product(corpus, tmp_path, tiny_e5):
    for kind in ("flat", "hnsw"):
        check_index(corpus, tmp_path, tiny_e5, kind)


def check_index(corpus, tmp_path, tiny_e5, kind):
    from megapkl.retriever.dense import E5Encoder
    from megapkl.retriever.index import build_index, open_index

    m = build_index(str(corpus), str(tmp_path / kind), "e5", encoder=tiny_e5, faiss_kind=kind,
                    device="cpu")
    assert m["rows"] == 68 and m["faiss"] == kind and m["dim"] == 32
    r = open_index(str(tmp_path / kind), device="cpu", gpu="off")
    try:
        enc = E5Encoder(tiny_e5, device="cpu")
        passages = enc.encode([row["contents"] for row in corpus_rows()], "passage")
        queries = ["capital of France", "river3 mountain5"]
        want = enc.encode(queries, "query") @ passages.T
        hits = r.search(queries, 5)
        for q, h in zip(want, hits):
            best = np.argsort(-q)[:5]
            assert [x.document["id"] for x in h][:1] == [corpus_rows()[best[0]]["id"]]
            if kind == "flat":  # exact: the very ranking and scores
                assert [x.document["id"] for x in h] == [corpus_rows()[i]["id"] for i in best]
                assert [x.score for x in h] == pytest.approx(q[best].tolist(), abs=1e-5)
    finally:
        r.close()


def test_prebuilt_faiss_index_must_match_the_corpus(corpus, tmp_path, tiny_e5):
    from megapkl.retriever.index import IndexDirError, build_index

    index = faiss.IndexFlatIP(32)
    index.add(np.zeros((3, 32), dtype=np.float32))
    faiss.write_index(index, str(tmp_path / "other.index"))
    with pytest.raises(IndexDirError, match="3 vectors, the corpus has 68 rows"):
        build_index(str(corpus), str(tmp_path / "ix"), "e5", encoder=tiny_e5,
                    faiss_index=str(tmp_path / "other.index"))
