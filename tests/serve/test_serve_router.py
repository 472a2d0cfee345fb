"""The real sglang-router in front of two `megapkl serve` workers (real processes, real HTTP)."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

from sglang_fixtures import http, router_workers, serve_cluster  # noqa: F401,F811 (fixture)

if importlib.util.find_spec("sglang_router") is None:
    if os.environ.get("CI") == "true":  # the test extra installs it: missing is a failure
        raise ImportError("sglang-router is not installed (pyproject test extra)")
    pytest.skip("sglang-router is not installed (pip install -e .[test])", allow_module_level=True)


# The fixtures start every worker with OMP_NUM_THREADS=1. torch's CPU kernels split reductions by
# thread count, so the same weights and inputs give last-digit differences between 1 and 2
# intra-op threads: the reference must compute with the workers' thread count to be comparable
# bit for bit.
WORKER_THREADS = 1


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _engine_like_worker(seed: int = 0):
    """An in-process embedded engine built exactly as a `megapkl serve --model-config tiny-qwen3
    --seed 0` worker builds its own (same random weights)."""
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import EmbeddedEngine

    torch.manual_seed(seed)
    engine = EmbeddedEngine(hf_config_dict(load_spec("tiny-qwen3"), dtype="float32"), seed=seed)
    engine.update_weights(list(engine.model.state_dict().items()), version=0)
    return engine


def test_router_registers_both_workers(serve_cluster):
    assert router_workers(serve_cluster.router_url) == sorted(serve_cluster.worker_urls)


def test_generate_through_router_matches_embedded_engine(serve_cluster):
    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.sample import PromptItem

    engine = _engine_like_worker()
    prompt, k = [5, 9, 17, 3], 3
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "n": 2,
                                "sampling_seed": 1234, "ignore_eos": True}}
    with torch_threads(WORKER_THREADS):
        want = engine.generate([PromptItem(torch.tensor(prompt))], 2,
                               SamplingParams(max_new_tokens=6, temperature=0.8, seed=1234,
                                              topk_logprobs=k, ignore_eos=True))
    # Four calls: round robin sends two to each worker; every answer equals the engine's.
    for _ in range(4):
        status, out = http("POST", serve_cluster.router_url + "/generate", body)
        assert status == 200, out
        assert isinstance(out, list) and len(out) == 2
        for got, ref in zip(out, want):
            meta = got["meta_info"]
            assert got["output_ids"] == ref.response_ids.tolist()
            assert [e[0] for e in meta["output_token_logprobs"]] == ref.logp_behav.tolist()
            assert [e[1] for e in meta["output_token_logprobs"]] == ref.response_ids.tolist()
            tops = meta["output_top_logprobs"]
            assert [[e[1] for e in row] for row in tops] == ref.topk_ids.tolist()
            assert [[e[0] for e in row] for row in tops] == ref.topk_logp.tolist()
            assert meta["finish_reason"] == {"type": "length", "length": 6}
            assert meta["weight_version"] == "default"
    # Both workers answered generate requests: each one still generates on its own URL.
    for url in serve_cluster.worker_urls:
        status, out = http("POST", url + "/generate", body)
        assert status == 200 and out[0]["output_ids"] == want[0].response_ids.tolist()
