"""The search agent's retrieval service (docs/search-agent.md): a server with Search-R1's wire
contract (`POST /retrieve`), BM25 (bm25s) and dense E5 + FAISS backends, built from a corpus
JSONL of {"id", "contents"} rows.

A service beside `serve/`: it runs as its own command (`megapkl retriever index|serve`, or
`python -m megapkl.retriever`), and no training code imports it; the search environment talks to
it over HTTP (`megapkl.envs.retriever_client`), as it would to Search-R1's own server.
"""
