"""megapkl's /generate bodies and tensor payloads, read by SGLang's own code.

Executed from sglang: the /generate route's JSON contract gate (`api_contract.
generate_contract_error`, the schema of `sglang/api/v1`), `GenerateReqInput(**body)
.normalize_batch_and_arguments()` and its per-item split (`obj[i]`),
`SamplingParams(**sampling_params).verify(vocab_size)`; for payloads,
`monkey_patch_torch_reductions()` + `MultiprocessingSerializer.deserialize` (the two steps of
`TpModelWorker.deserialize_own_rank`). Not executed: the tokenizer manager's request path (it
needs the scheduler processes); how it fans a request out into samples (item i, n copies of it
when n > 1) is restated in `sglang_side.generate_request`.
"""
from __future__ import annotations

import pytest
import torch

from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sglang.protocol import generate_payload

VOCAB = 128

CASES = {
    "greedy": SamplingParams(max_new_tokens=8, temperature=0.0),
    "sampled_topk_seed": SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=20,
                                        seed=11, topk_logprobs=4),
    "routed_stop_ids": SamplingParams(max_new_tokens=4, stop_token_ids=(3, 7),
                                      return_routed_experts=True),
    "ignore_eos": SamplingParams(max_new_tokens=5, ignore_eos=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_body_is_sglangs(sglang, case):
    sampling = CASES[case]
    body = generate_payload([5, 9, 17], sampling, n=3, seed=sampling.seed_of(0))
    got = sglang.call("generate_request", body, VOCAB)
    assert "error" not in got, got
    assert got["return_logprob"] is True and got["logprob_start_len"] == -1
    assert got["samples"] == 3 and got["prompts"] == 1
    assert got["max_new_tokens"] == sampling.max_new_tokens
    assert got["top_p"] == pytest.approx(sampling.top_p)
    if sampling.temperature == 0.0:  # SGLang's greedy: temperature 1 over the top-1 token
        assert got["top_k"] == 1
    else:
        assert got["temperature"] == pytest.approx(sampling.temperature)
        # a positive top_k stays; -1 (off) becomes SGLang's own "whole vocabulary" value
        assert got["top_k"] == sampling.top_k if sampling.top_k > 0 else got["top_k"] >= VOCAB
    assert got["top_logprobs_num"] == (sampling.topk_logprobs or 0)
    assert got["return_routed_experts"] is bool(sampling.return_routed_experts)
    assert got["ignore_eos"] is bool(sampling.ignore_eos)
    assert got["stop_token_ids"] == sorted(sampling.stop_token_ids or ())
    if sampling.seed is not None:
        assert got["seeds"] == [body["sampling_params"]["sampling_seed"]] * 3


def test_each_response_of_a_seeded_group_has_its_own_seed(sglang):
    """SGLang copies a request's sampling_params, seed included, to each of its n samples; under
    --enable-deterministic-inference equal seeds draw equal responses, and a group of equal
    responses has zero advantage. To such servers megapkl's seeded group gives every sample a
    seed of its own, in answer order; an unseeded group stays one request with n."""
    from megapkl.rollout.sglang.protocol import sample_seed

    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
    prompt_seed = sampling.seed_of(2)  # the third prompt of the call
    got = sglang.call("generate_request", generate_payload([4, 8], sampling, n=4,
                                                           seed=prompt_seed, seed_each=True),
                      VOCAB)
    assert "error" not in got, got
    assert got["samples"] == 4 and got["prompts"] == 1 and got["n"] == 1
    assert got["seeds"] == [sample_seed(prompt_seed, j) for j in range(4)]
    assert len(set(got["seeds"])) == 4
    plain = sglang.call("generate_request", generate_payload([4, 8], SamplingParams(), n=4,
                                                             seed_each=True), VOCAB)
    assert "error" not in plain, plain
    assert plain["samples"] == 4 and plain["n"] == 4 and plain["seeds"] == [None] * 4


def test_sglang_refuses_an_unknown_sampling_key(sglang):
    body = generate_payload([1, 2], SamplingParams(max_new_tokens=2), n=1)
    body["sampling_params"]["no_such_key"] = 1
    assert "error" in sglang.call("generate_request", body, VOCAB)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_tensor_payload_deserializes_in_sglang(sglang, dtype):
    from megapkl.rollout.sglang.weights import serialize_named_tensors

    g = torch.Generator().manual_seed(3)
    named = [("model.layers.0.self_attn.q_proj.weight",
              torch.randn(8, 16, generator=g).to(dtype)),
             ("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.rand(1, 1, generator=g)),
             ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16))]
    payload, alive = serialize_named_tensors(named)
    got = sglang.call("deserialize", payload)
    del alive
    assert [(n, d, s) for n, d, s, _ in got] == [
        (n, str(t.dtype).replace("torch.", ""), list(t.shape)) for n, t in named]
    for (_, t), (*_, data) in zip(named, got):
        assert data == t.contiguous().view(torch.uint8).numpy().tobytes()
