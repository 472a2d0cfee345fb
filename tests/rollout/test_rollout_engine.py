"""Embedded engine: behavior log-probs, top-K, truncation, versions, weights, routed experts."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_tiny import DENSE, build_model, teacher_forced  # noqa: E402

from megapkl.rollout.embedded import EmbeddedEngine  # noqa: E402
from megapkl.rollout.engine import RolloutEngineError, SamplingParams, WeightUpdateError  # noqa: E402
from megapkl.rollout.sample import PromptItem  # noqa: E402

# Prompts of different lengths, so the batch is left-padded.
PROMPTS = [PromptItem([1, 40, 41, 42]), PromptItem([1, 50]), PromptItem([1, 60, 61, 62, 63, 64, 65])]
# Many stop tokens: rows finish at different steps, exercising finished-row handling in a batch.
STOPS = tuple(range(70, 100))


def engine_for(model, **kw):
    return EmbeddedEngine.from_model(model, version=kw.pop("version", 0), **kw)


def test_logp_matches_teacher_forced_recompute(dense_model):
    engine = engine_for(dense_model, seed=1, max_batch_size=4)  # 9 rows: batches of 4, 4, 1
    sampling = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.95, top_k=50,
                              stop_token_ids=STOPS, topk_logprobs=5)
    samples = engine.generate(PROMPTS, 3, sampling)
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    trainer = build_model(DENSE, seed=123)  # the trainer's copy, loaded through the same names
    trainer.load_state_dict(dense_model.state_dict())
    for s in samples:
        assert s.temperature == 0.7
        logp, _ = teacher_forced(trainer, s, 0.7)
        expect = logp.gather(1, s.response_ids[:, None]).squeeze(1)
        torch.testing.assert_close(s.logp_behav, expect, atol=2e-5, rtol=0)
        # top-K: the true top-K of the full distribution, best first
        top = torch.topk(logp, 5, dim=-1)
        assert torch.equal(s.topk_ids, top.indices)
        torch.testing.assert_close(s.topk_logp, top.values, atol=2e-5, rtol=0)
        if s.finish_reason == "stop":
            assert int(s.response_ids[-1]) in STOPS
            assert not any(int(t) in STOPS for t in s.response_ids[:-1])
        else:
            assert s.response_len == 10


def test_sampling_stays_inside_top_k_and_top_p(dense_model):
    engine = engine_for(dense_model, seed=2)
    for params in (dict(top_k=3), dict(top_p=0.5), dict(top_k=4, top_p=0.6)):
        sampling = SamplingParams(max_new_tokens=5, temperature=1.3, **params)
        for s in engine.generate(PROMPTS, 4, sampling):
            logp, _ = teacher_forced(dense_model, s, 1.3)
            sorted_logp, order = logp.sort(dim=-1, descending=True)
            rank = (order == s.response_ids[:, None]).int().argmax(dim=-1)
            if "top_k" in params:
                assert bool((rank < params["top_k"]).all()), (params, rank)
            if "top_p" in params:
                probs = sorted_logp.exp()
                mass_before = (torch.cumsum(probs, -1) - probs).gather(1, rank[:, None]).squeeze(1)
                assert bool((mass_before < params["top_p"] + 1e-5).all()), (params, mass_before)


def test_top_p_truncation_is_active(dense_model):
    """Guard for the test above: the model's distributions are peaky enough for top-p to cut."""
    engine = engine_for(dense_model, seed=3)
    s = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4, temperature=1.3))[0]
    logp, _ = teacher_forced(dense_model, s, 1.3)
    probs = logp.exp().sort(dim=-1, descending=True).values
    assert int((torch.cumsum(probs, -1) < 0.5).sum(-1).max()) < 64


def test_greedy_is_argmax_with_temperature_one_logprobs(dense_model):
    engine = engine_for(dense_model)
    s = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    logp, _ = teacher_forced(dense_model, s, 1.0)
    assert torch.equal(s.response_ids, logp.argmax(-1))
    torch.testing.assert_close(s.logp_behav, logp.max(-1).values, atol=2e-5, rtol=0)
    assert s.temperature == 1.0


def test_versions_and_snapshot_semantics(dense_model):
    model = build_model(DENSE, seed=7)
    engine = EmbeddedEngine(DENSE, seed=0)
    assert engine.version is None and engine.health()["weights_loaded"] is False
    with pytest.raises(RolloutEngineError, match="no weights"):
        engine.generate(PROMPTS, 1, SamplingParams())
    engine.update_weights(model.state_dict().items(), version=5)
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    first = engine.generate(PROMPTS, 2, sampling)
    assert [s.version for s in first] == [5] * 6
    with torch.no_grad():  # the trainer moves on; the engine keeps the pushed snapshot
        for p in model.parameters():
            p.mul_(-1.0)
    again = engine.generate(PROMPTS, 2, sampling)
    assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(first, again))
    assert [s.uid for s in again] == list(range(6, 12)) and again[0].group_id == 3
    engine.update_weights(model.state_dict().items(), version=6)
    newer = engine.generate(PROMPTS, 2, sampling)
    assert {s.version for s in newer} == {6} and engine.version == 6
    assert any(not torch.equal(a.logp_behav, b.logp_behav) for a, b in zip(first, newer))
    engine.update_weights(dense_model.state_dict().items(), version=2)  # an older snapshot
    assert engine.generate(PROMPTS[:1], 1, sampling)[0].version == 2


def test_weight_update_errors_are_clear_and_atomic(dense_model):
    engine = EmbeddedEngine(DENSE)
    named = dict(dense_model.state_dict())
    with pytest.raises(WeightUpdateError, match="first weight push must cover every parameter"):
        engine.update_weights([("model.norm.weight", named["model.norm.weight"])], version=0)
    engine.update_weights(named.items(), version=1)
    before = engine.model.model.norm.weight.clone()
    bad_name = [("model.norm.weight", before + 1), ("model.layers.0.self_attn.q_prj.weight",
                                                    named["model.layers.0.self_attn.q_proj.weight"])]
    with pytest.raises(WeightUpdateError, match=r"unknown weight 'model\.layers\.0\.self_attn\.q_prj"
                                                r"\.weight'.*q_proj"):
        engine.update_weights(bad_name, version=2)
    with pytest.raises(WeightUpdateError, match=r"shape \[64, 32\] does not match the engine's "
                                                r"\[64, 64\]"):
        engine.update_weights([("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 32))], 2)
    with pytest.raises(WeightUpdateError, match="floating-point"):
        engine.update_weights([("model.norm.weight", torch.ones(64, dtype=torch.int64))], 2)
    for bad in (float("nan"), float("inf"), -float("inf")):  # one element is enough
        for copy in (True, False):
            value = torch.ones(64)
            value[37] = bad
            with pytest.raises(WeightUpdateError, match="model.norm.weight': contains NaN or Inf"):
                engine.update_weights([("model.norm.weight", value)], 2, copy=copy)
    with pytest.raises(WeightUpdateError, match="version"):
        engine.update_weights(named.items(), version=-1)
    assert engine.version == 1 and torch.equal(engine.model.model.norm.weight, before)
    engine.update_weights([("model.norm.weight", before * 2)], version=3)  # partial after the first
    assert engine.version == 3 and torch.equal(engine.model.model.norm.weight, before * 2)
    engine.close()
    with pytest.raises(RolloutEngineError, match="closed"):
        engine.health()
    with pytest.raises(RolloutEngineError, match="closed"):
        engine.update_weights(named.items(), version=4)


def test_deterministic_and_resumable(dense_model):
    sampling = SamplingParams(max_new_tokens=5, topk_logprobs=2)
    a = engine_for(dense_model, seed=9)
    b = engine_for(dense_model, seed=9)
    a.generate(PROMPTS, 2, sampling)
    state = a.state_dict()
    next_a = a.generate(PROMPTS, 2, sampling)
    b.generate(PROMPTS, 2, sampling)  # b follows the same path ...
    c = engine_for(dense_model, seed=0)
    c.load_state_dict(state)  # ... and c resumes from a's checkpoint
    for other in (b.generate(PROMPTS, 2, sampling), c.generate(PROMPTS, 2, sampling)):
        assert [s.uid for s in other] == [s.uid for s in next_a]
        assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(other, next_a))


def test_a_groups_samples_do_not_depend_on_the_rest_of_the_call(dense_model):
    """A prompt's responses are a function of its seed alone: the same whichever prompts share
    the call, in whatever order, chunked however (max_batch_size), and on whichever engine. This
    is what keeps the data-parallel size from changing the samples."""
    sampling = SamplingParams(max_new_tokens=6, temperature=1.2, stop_token_ids=STOPS)
    whole = engine_for(dense_model, seed=0, max_batch_size=256).generate(
        PROMPTS, 4, dataclasses.replace(sampling, prompt_seeds=(11, 22, 33)))
    alone = engine_for(dense_model, seed=5, max_batch_size=3).generate(
        PROMPTS[2:0:-1], 4, dataclasses.replace(sampling, prompt_seeds=(33, 22)))
    key = lambda ss: [(s.response_ids.tolist(), s.finish_reason) for s in ss]  # noqa: E731
    assert key(alone) == key(whole[8:12]) + key(whole[4:8])
    for a, b in zip(alone, whole[8:12] + whole[4:8]):
        torch.testing.assert_close(a.logp_behav, b.logp_behav, atol=1e-5, rtol=0)
    # the responses of a group differ from each other, and another seed draws others
    assert len({tuple(r) for r, _ in key(whole[:4])}) > 1
    other = engine_for(dense_model).generate(PROMPTS[:1], 4, dataclasses.replace(
        sampling, prompt_seeds=(12,)))
    assert key(other) != key(whole[:4])


def test_a_groups_prompt_is_prefilled_once_with_the_same_samples(dense_model):
    """The n responses of a prompt share its prefill (one row in the prompts' forward pass, its
    cache copied to the n rows): the samples a prefill of every row gives, the log-probs to the
    round-off that another batch composition gives too (the kernels' sums depend on the batch's
    shape: see the test above); a chunk that starts inside a group (max_batch_size 3, groups of
    4) prefills that prompt again. Each sample's tensors hold their own storage."""
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=STOPS,
                              topk_logprobs=3, prompt_seeds=(7, 8, 9))
    runs = {}
    for shared in (True, False):
        engine = engine_for(dense_model, max_batch_size=3)
        prefill, forward, rows = engine._prefill, engine._forward, []
        if not shared:
            engine._prefill = lambda prompt_ids, firsts: prefill(  # noqa: E731
                prompt_ids, list(range(len(prompt_ids))))

        def counted(ids, mask, pos, cache, forward=forward, rows=rows):
            if cache is None:  # the prompts' pass
                rows.append(ids.shape[0])
            return forward(ids, mask, pos, cache)
        engine._forward = counted
        runs[shared] = (engine.generate(PROMPTS, 4, sampling), rows)
    (shared, shared_rows), (each, each_rows) = runs[True], runs[False]
    assert each_rows == [3, 3, 3, 3] and shared_rows == [1, 2, 2, 1]  # rows 0-2, 3-5, 6-8, 9-11
    for a, b in zip(shared, each):
        assert a.finish_reason == b.finish_reason
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.topk_ids, b.topk_ids)
        torch.testing.assert_close(a.logp_behav, b.logp_behav, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.topk_logp, b.topk_logp, atol=1e-5, rtol=0)
        for t in (a.response_ids, a.logp_behav, a.topk_ids, a.topk_logp):  # no batch storage
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_inverse_cdf_draw_follows_the_kept_distribution():
    """sampling.draw with one uniform per row: token frequencies match the (truncated)
    probabilities within sampling error, and masked tokens are never drawn."""
    from megapkl.rollout.sampling import draw, keep_mask
    from megapkl.rollout.seeds import row_seeds, uniforms

    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]]), dim=-1)
    rows = 40000
    for params in (SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.8)):
        u = uniforms(row_seeds([7], rows), 0)
        tokens = draw(logp.expand(rows, -1), params, u)
        freq = torch.bincount(tokens, minlength=6).double() / rows
        mask = keep_mask(logp, params.top_k, params.top_p)
        p = logp.exp().double()[0] * (1 if mask is None else mask[0])
        p = p / p.sum()
        assert torch.all(freq[p == 0] == 0), (params, freq)
        assert torch.allclose(freq, p, atol=4 * (0.25 / rows) ** 0.5), (params, freq, p)


def test_moe_routed_experts_match_teacher_forced_routing(moe_model, dense_model):
    engine = engine_for(moe_model, seed=4, max_batch_size=5)
    assert engine.is_moe
    sampling = SamplingParams(max_new_tokens=7, temperature=0.9, stop_token_ids=STOPS,
                              return_routed_experts=True)
    samples = engine.generate(PROMPTS, 2, sampling)
    for s in samples:
        logp, experts = teacher_forced(moe_model, s, 0.9)
        assert s.routed_experts.dtype == torch.int32
        assert tuple(s.routed_experts.shape) == (s.prompt_len + s.response_len - 1, 2, 2)
        assert torch.equal(s.routed_experts, experts)
        expect = logp.gather(1, s.response_ids[:, None]).squeeze(1)
        torch.testing.assert_close(s.logp_behav, expect, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        engine_for(dense_model).generate(PROMPTS, 1, sampling)


def test_engine_samples_pack_into_the_loss_view(dense_model):
    """The engine's Samples go straight into the trainer's micro-batch and its TokenBatch view."""
    from megapkl.parallel import batching as B

    engine = engine_for(dense_model, seed=5)
    samples = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, stop_token_ids=STOPS,
                                                         topk_logprobs=3))
    for s, a in zip(samples, [1.0, -1.0] * 3):
        s.advantage = a
    for layout in ("bshd", "thd"):
        (mb,) = B.make_micro_batches(samples, 1, 2, layout=layout)
        lengths = [s.response_len for s in samples]
        batch = B.token_batch(mb, mb.fields["logp_behav"][mb.loss_mask].clone(),
                              topk_logp=mb.fields["topk_logp_behav"][mb.loss_mask].clone())
        batch.validate(need_sis=True)
        assert batch.lengths().tolist() == lengths
        assert batch.positions.tolist() == [t + 1 for n in lengths for t in range(n)]
        assert batch.group_index.tolist() == [s.group_id for s in samples]
        assert torch.equal(batch.token_ids, torch.cat([s.response_ids for s in samples]))
        assert torch.equal(batch.logp_behav, torch.cat([s.logp_behav for s in samples]))
        assert batch.advantages.tolist() == [a for s in samples for a in [s.advantage] * s.response_len]


def test_argument_validation(dense_model):
    for bad in (dict(top_k=0), dict(top_p=0.0), dict(temperature=-1.0), dict(max_new_tokens=0),
                dict(topk_logprobs=-1)):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)
    engine = engine_for(dense_model)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=300))
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        engine.generate(PROMPTS, 1, SamplingParams(topk_logprobs=200))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([PromptItem([1, 500])], 1, SamplingParams())
    with pytest.raises(ValueError, match="n \\(responses per prompt\\)"):
        engine.generate(PROMPTS, 0, SamplingParams())


def test_from_pretrained_reads_local_safetensors(tmp_path, dense_model):
    dense_model.save_pretrained(tmp_path, safe_serialization=True)
    engine = EmbeddedEngine.from_pretrained(tmp_path, version=0)
    ref = engine_for(dense_model)
    sampling = SamplingParams(max_new_tokens=4, seed=3)
    x, y = engine.generate(PROMPTS, 1, sampling), ref.generate(PROMPTS, 1, sampling)
    assert all(torch.equal(a.logp_behav, b.logp_behav) for a, b in zip(x, y))


def test_engine_accepts_the_model_rooms_export_names():
    """Contract with megapkl.models: the engine builds from `hf_config_dict(spec)` and its
    parameters are exactly the HF tensors the exporter streams (tied models: no lm_head)."""
    from megapkl.models.hf_mapping import expected_hf_shapes
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.synthetic import CharTokenizer

    for name in ("tiny-qwen3", "tiny-qwen3-moe"):
        spec = load_spec(name)
        engine = EmbeddedEngine(hf_config_dict(spec, dtype="float32"), tokenizer=CharTokenizer())
        assert engine.eos_token_ids == (2,) and engine.is_moe == spec.is_moe  # EOS from tokenizer
        shapes = expected_hf_shapes(spec)
        torch.manual_seed(0)
        engine.update_weights(((n, torch.randn(s) * 0.1) for n, s in shapes.items()), version=0)
        assert engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2))[0].version == 0


def test_tied_model_push_without_lm_head(dense_model):
    engine = EmbeddedEngine(DENSE)
    named = {k: v for k, v in dense_model.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(named.items(), version=0)
    assert torch.equal(engine.model.lm_head.weight, dense_model.lm_head.weight)
