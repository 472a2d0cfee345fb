"""FP8 in the embedded engine: dequantized block-FP8 weights, FP8 checkpoints, bf16 KV cache, and
the train-inference mismatch they cause (megapkl.train.mismatch)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_tiny import DENSE, MOE, teacher_forced  # noqa: E402

from megapkl.rollout import fp8 as F  # noqa: E402
from megapkl.rollout.embedded import EmbeddedEngine  # noqa: E402
from megapkl.rollout.engine import SamplingParams  # noqa: E402
from megapkl.rollout.sample import PromptItem  # noqa: E402
from megapkl.train.mismatch import mismatch_metrics  # noqa: E402

PROMPTS = [PromptItem([1, 40, 41, 42]), PromptItem([1, 50]), PromptItem([1, 60, 61, 62, 63, 64])]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, ignore_eos=True)


def params(engine):
    return dict(engine.model.named_parameters())


def test_fp8_engine_computes_with_dequantized_weights(dense_model):
    engine = EmbeddedEngine.from_model(dense_model, fp8=True)
    plain = dense_model.state_dict()
    got = params(engine)
    name = "model.layers.1.mlp.down_proj.weight"
    q, s = F.quantize_block_fp8(plain[name])
    assert torch.equal(got[name], F.dequantize_block_fp8(q, s, torch.float32))
    assert not torch.equal(got[name], plain[name])
    for kept in ("model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert torch.equal(got[kept], plain[kept]), kept
    # W8A8: the inputs of the 7 linear layers per block are quantized too, nothing else.
    assert len(engine._act_hooks) == 7 * DENSE["num_hidden_layers"]
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        w8a8 = engine.model(input_ids=ids).logits
        for h in engine._act_hooks:
            h.remove()
        w8 = engine.model(input_ids=ids).logits
    assert 0 < float((w8a8 - w8).abs().max()) < 1.0


def test_fp8_checkpoint_and_fp8_stream_give_the_same_engine(tmp_path, dense_model):
    ckpt = F.write_fp8_checkpoint(tmp_path / "fp8", dense_model.state_dict().items(),
                                  {**DENSE, "torch_dtype": "float32"})
    from_disk = EmbeddedEngine.from_pretrained(ckpt)             # FP8 via quantization_config
    assert from_disk.fp8
    streamed = EmbeddedEngine(DENSE, fp8=True)
    streamed.update_weights(F.FP8Transform()(dense_model.state_dict().items()), version=0)
    quantized_here = EmbeddedEngine.from_model(dense_model, fp8=True)
    for name, p in params(from_disk).items():
        assert torch.equal(p, params(streamed)[name]) and torch.equal(p, params(quantized_here)[name])
    a, b = from_disk.generate(PROMPTS, 1, SAMPLING), quantized_here.generate(PROMPTS, 1, SAMPLING)
    assert all(torch.equal(x.logp_behav, y.logp_behav) for x, y in zip(a, b))


def test_unknown_quantization_config_is_an_error(tmp_path, dense_model):
    dense_model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(F.FP8Error, match="quantization_config.quant_method is 'awq'"):
        EmbeddedEngine.from_pretrained(tmp_path)


def test_kv_cache_dtype_bf16_rounds_the_cache_and_fp8_kv_is_refused(dense_model):
    auto = EmbeddedEngine.from_model(dense_model).generate(PROMPTS, 2, SAMPLING)
    bf16 = EmbeddedEngine.from_model(dense_model, kv_cache_dtype="bf16").generate(PROMPTS, 2, SAMPLING)
    diff = max(float((a.logp_behav - b.logp_behav).abs().max()) for a, b in zip(auto, bf16)
               if torch.equal(a.response_ids, b.response_ids))
    assert 0 < diff < 0.05, diff
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype: 'fp8_e4m3'"):
        EmbeddedEngine(DENSE, kv_cache_dtype="fp8_e4m3")


def engine_mismatch(model, **kw) -> dict:
    """Mismatch of the engine's behavior log-probs against the exact weights' teacher-forced ones."""
    samples = EmbeddedEngine.from_model(model, **kw).generate(PROMPTS, 2, SAMPLING)
    trainer = []
    for s in samples:
        logp, _ = teacher_forced(model, s, 1.0)
        trainer.append(logp.gather(1, s.response_ids[:, None]).squeeze(1))
    return mismatch_metrics([s.logp_behav for s in samples], trainer)


def test_fp32_engine_has_no_mismatch_and_fp8_raises_it(dense_model):
    exact = engine_mismatch(dense_model)
    fp8 = engine_mismatch(dense_model, fp8=True)
    print(f"embedded engine mismatch vs exact weights: fp32 {exact}, fp8 {fp8}")
    assert exact["mismatch/k3_kl"] < 1e-6 and exact["mismatch/abs_log_ratio_max"] < 1e-4
    assert fp8["mismatch/k3_kl"] > 100 * max(exact["mismatch/k3_kl"], 1e-9)
    assert fp8["mismatch/abs_log_ratio_mean"] > 1e-3


def test_fp8_moe_keeps_the_router_and_quantizes_experts():
    from rollout_tiny import build_model

    from megapkl.rollout.embedded import checkpoint_tensors

    model = build_model(MOE)
    engine = EmbeddedEngine.from_model(model, fp8=True)
    got, plain = params(engine), dict(checkpoint_tensors(model))
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], plain["model.layers.0.mlp.gate.weight"])
    assert torch.equal(got["lm_head.weight"], plain["lm_head.weight"])
    expert = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert torch.equal(got[expert], F.dequantize_block_fp8(*F.quantize_block_fp8(plain[expert]),
                                                           torch.float32))


def test_fp8_with_a_model_whose_layers_it_does_not_know_is_an_error():
    gpt2 = dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    EmbeddedEngine(gpt2)  # fine in the engine's own dtype
    with pytest.raises(F.FP8Error, match=r"rollout.fp8: weight 'transformer\..*FP8 cannot handle"):
        EmbeddedEngine(gpt2, fp8=True)
