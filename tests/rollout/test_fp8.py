"""Block FP8 quantization against an independent float64 reference, its error bound, the streamed
transform and the HF FP8 checkpoint writer (megapkl.rollout.fp8)."""
from __future__ import annotations

import json

import pytest
import torch

from megapkl.rollout import fp8 as F
from megapkl.rollout import fp8_cpu

# Both quantizers answer to the reference: the compiled CPU kernel (what quantize_block_fp8 runs for
# bf16 / fp32 CPU weights) and the torch path (GPU weights, CPUs without a C compiler).
IMPLS = {"kernel": F.quantize_block_fp8, "torch": F.quantize_block_fp8_torch}


@pytest.fixture(params=list(IMPLS))
def quantize(request):
    if request.param == "kernel" and not fp8_cpu.available():
        pytest.skip("no C compiler: the FP8 CPU kernel is not built (CI requires it: test_fp8_cpu)")
    return IMPLS[request.param]

# ------------------------------------------------------------------------- float64 reference
# Written from the definitions, not from the implementation: explicit loops over blocks, the e4m3
# grid from frexp (3 mantissa bits, exponent bias 7, subnormal step 2^-9, max 448), round half to
# even, saturation at +-448.


def ref_round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value (ties to even), saturated at +-448, of float64 values."""
    a = x.abs()
    _, e = torch.frexp(a)                      # a = m * 2^e with m in [0.5, 1): floor(log2 a) = e-1
    exponent = torch.clamp(e.to(torch.float64) - 1, min=-6.0)  # below 2^-6: subnormal, step 2^-9
    step = torch.pow(2.0, exponent - 3)
    r = torch.round(a / step) * step           # torch.round: half to even
    return torch.sign(x) * torch.clamp(r, max=448.0)


def ref_quantize(w: torch.Tensor, block=(128, 128)):
    """(q as float64, scale as float64) per the definition, block by block."""
    w64 = w.to(torch.float64)
    rows, cols = w64.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty_like(w64)
    s = torch.empty(nr, nc, dtype=torch.float64)
    for i in range(nr):
        for j in range(nc):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            blk = w64[sl]
            amax = float(blk.abs().max())
            scale = float(torch.tensor(amax / 448.0, dtype=torch.float64).to(torch.float32))
            scale = max(scale, 2.0 ** -126)
            x = (blk / scale).to(torch.float32).to(torch.float64)  # the fp32 quotient
            q[sl] = ref_round_e4m3(torch.clamp(x, -448.0, 448.0))
            s[i, j] = scale
    return q, s


def adversarial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    w = torch.randn(300, 260, generator=g)
    w[:128, :128] = 0                                # an all-zero block
    w[128:256, 128:256] *= 1e30                       # huge block
    w[0:128, 256:260] = torch.randn(128, 4, generator=g) * 1e-41  # denormal-sized block
    w[256, 0] = 3.0e38                                # near fp32 max: a block that must not overflow
    out["mixed"] = w
    ties = torch.zeros(128, 128)                      # scale exactly 1: e4m3 midpoints, ties to even
    ties[0, 0] = 448.0
    ties[1, :8] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.0029296875, -1.0625, 447.9, 2.0 ** -10])
    out["ties"] = ties
    spike = torch.full((129, 131), 1e-3)
    spike[5, 7] = 1e4                                 # one outlier drowns its block
    out["spike"] = spike
    out["bf16"] = (torch.randn(257, 384, generator=g) * 0.02).to(torch.bfloat16)
    out["row"] = torch.randn(1, 5, generator=g)
    return out


def check_against_reference(w: torch.Tensor, quantize) -> None:
    q, s = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == w.shape and s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    rq, rs = ref_quantize(w)
    assert torch.equal(s.to(torch.float64), rs)
    assert torch.equal(q.to(torch.float64), rq)
    assert bool(torch.isfinite(q.float()).all())


@pytest.mark.parametrize("shape,scale", [((128, 128), 1.0), ((200, 300), 0.02), ((257, 129), 5.0),
                                         ((3, 1000), 1e-3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_matches_float64_reference(shape, scale, dtype, quantize):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * scale
    check_against_reference(w.to(dtype), quantize)


@pytest.mark.parametrize("case", list(adversarial()))
def test_adversarial_matches_reference(case, quantize):
    check_against_reference(adversarial()[case], quantize)


def test_ties_round_to_even_and_saturate(quantize):
    q, s = quantize(adversarial()["ties"])
    assert float(s[0, 0]) == 1.0
    got = q[1, :8].float().tolist()
    assert got == [1.0, 1.25, 16.0, 20.0, 0.00390625, -1.0, 448.0, 0.0]


def bound_ratio(w: torch.Tensor, quantize) -> float:
    """max over elements of |w - deq| / (ERROR_REL |w| + ERROR_ABS s); <= 1 is the stated bound."""
    q, s = quantize(w)
    deq = F.dequantize_block_fp8(q, s, torch.float64)
    w64 = w.to(torch.float64)
    s_el = s.to(torch.float64).repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    err = (w64 - deq).abs()
    return float((err / (F.ERROR_REL * w64.abs() + F.ERROR_ABS * s_el)).max())


def test_round_trip_error_bound_random_and_adversarial(quantize):
    g = torch.Generator().manual_seed(7)
    cases = dict(adversarial())
    cases["normal"] = torch.randn(512, 384, generator=g)
    cases["lognormal"] = torch.exp(torch.randn(256, 256, generator=g) * 6) * torch.sign(torch.randn(256, 256, generator=g))
    ratios = {k: bound_ratio(w, quantize) for k, w in cases.items()}
    assert max(ratios.values()) <= 1.0, ratios
    # The bound is attained up to rounding (it is tight), so it is a statement, not a loose guess.
    assert ratios["normal"] > 0.9, ratios
    w = cases["normal"]
    deq = F.dequantize_block_fp8(*quantize(w), torch.float32)
    rel = float(((w - deq).abs() / w.abs().clamp(min=1e-3)).max())
    print(f"fp8 round trip: bound ratio {ratios}, max relative error (|w| >= 1e-3) {rel:.4f}")


def test_activation_quantization_matches_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 200, generator=g) * torch.tensor([1e-3] * 128 + [50.0] * 72)
    x[0, 0, :128] = 0  # an all-zero group
    got = F.fake_quant_activation(x)
    expect = torch.empty(2, 3, 200, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            for lo, hi in ((0, 128), (128, 200)):
                grp = x[i, j, lo:hi].double()
                scale = float(torch.tensor(float(grp.abs().max()) / 448.0).to(torch.float32))
                scale = max(scale, 2.0 ** -126)
                q = ref_round_e4m3((grp / scale).to(torch.float32).to(torch.float64))
                expect[i, j, lo:hi] = (q * scale).to(torch.float32).to(torch.float64)
    assert got.dtype == x.dtype and torch.equal(got.double(), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_weight_is_an_error_naming_it(dtype, bad, quantize):
    w = torch.randn(200, 300, dtype=dtype)  # padded blocks: the bad value sits in a partial one
    w[170, 290] = bad
    with pytest.raises(F.FP8Error, match="layers.0.mlp.up_proj.weight.*NaN or Inf"):
        list(F.FP8Transform()([("model.layers.0.mlp.up_proj.weight", w)]))
    with pytest.raises(F.FP8Error, match="'w'.*NaN or Inf"):
        quantize(w, name="w")
    # the largest finite value (of fp32 at most: the scale is fp32) is fine
    w[170, 290] = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    q, s = quantize(w)
    assert torch.isfinite(s).all() and torch.isfinite(q.float()).all()


# ------------------------------------------------------------------------- streams and checkpoints

def tiny_named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (100, 64), "model.norm.weight": (64,),
              "model.layers.0.input_layernorm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (128, 64),
              "model.layers.0.self_attn.k_norm.weight": (16,),
              "model.layers.0.self_attn.o_proj.weight": (64, 128),
              "model.layers.0.mlp.gate.weight": (4, 64),
              "model.layers.0.mlp.experts.3.down_proj.weight": (64, 200),
              "lm_head.weight": (100, 64)}
    return [(n, torch.randn(*s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]


def test_transform_quantizes_linear_layers_only():
    out = list(F.FP8Transform()(tiny_named()))
    names = [n for n, _ in out]
    quantized = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.experts.3.down_proj.weight"}
    for name, t in out:
        base = name.removesuffix("_scale_inv")
        if base in quantized:
            assert t.dtype == (torch.float32 if name.endswith("_scale_inv") else torch.float8_e4m3fn)
        else:
            assert t.dtype == torch.bfloat16, name
    assert names.count("model.layers.0.mlp.experts.3.down_proj.weight_scale_inv") == 1
    assert dict(out)["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (1, 2)
    assert len(out) == len(tiny_named()) + len(quantized)


@pytest.mark.parametrize("name,shape,match", [
    ("model.layers.0.self_attn.qkv_fused.weight", (8, 8), "neither a linear layer"),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 8), "neither a linear layer"),
    ("model.layers.0.mlp.up_proj.weight", (2, 8, 8), "2-D linear weight")])
def test_unhandled_weights_are_errors(name, shape, match):
    with pytest.raises(F.FP8Error, match=match):
        list(F.FP8Transform()([(name, torch.ones(shape))]))


def test_check_fp8_model_tp_sides():
    shapes = {"model.layers.0.self_attn.q_proj.weight": (512, 64),
              "model.layers.0.self_attn.o_proj.weight": (64, 768)}
    assert F.check_fp8_model(shapes, tp=2) == 2
    with pytest.raises(F.FP8Error, match="o_proj.weight.*768 split over tensor parallel 4"):
        F.check_fp8_model(shapes, tp=4)
    with pytest.raises(F.FP8Error, match="no linear layer"):
        F.check_fp8_model({"model.norm.weight": (64,)})


def test_checkpoint_writer_agrees_exactly_with_the_stream(tmp_path):
    from safetensors import safe_open

    streamed = list(F.FP8Transform()(tiny_named()))
    out = F.write_fp8_checkpoint(tmp_path / "ckpt", tiny_named(), {"model_type": "qwen3"},
                                 shard_bytes=20_000)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 1 and files[0].name.endswith(f"-of-{len(files):05d}.safetensors")
    read = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            read.update({k: h.get_tensor(k) for k in h.keys()})
    assert set(read) == {n for n, _ in streamed}
    for name, t in streamed:
        assert read[name].dtype == t.dtype and torch.equal(read[name].view(torch.uint8),
                                                           t.contiguous().view(torch.uint8)), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == F.QUANTIZATION_CONFIG
    assert F.read_quantization_config(config) == (128, 128)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read)


@pytest.mark.parametrize("qc,key", [({"quant_method": "gptq"}, "quant_method"),
                                    ({"quant_method": "fp8", "activation_scheme": "static"},
                                     "activation_scheme"),
                                    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
                                    ({"quant_method": "fp8", "activation_scheme": "dynamic"},
                                     "weight_block_size")])
def test_unknown_quantization_config_is_an_error_naming_the_key(qc, key):
    with pytest.raises(F.FP8Error, match=f"ckpt/config.json: quantization_config.{key}"):
        F.read_quantization_config({"quantization_config": qc}, "ckpt/config.json")
    assert F.read_quantization_config({"model_type": "qwen3"}) is None


def test_dequantize_stream_pairs_and_errors():
    stream = list(F.FP8Transform()(tiny_named()))
    back = dict(F.dequantize_stream(reversed(stream), torch.float32))  # scale before weight
    ref = dict(tiny_named())
    assert set(back) == set(ref)
    name = "model.layers.0.self_attn.q_proj.weight"
    q, s = F.quantize_block_fp8(ref[name])
    assert torch.equal(back[name], F.dequantize_block_fp8(q, s, torch.float32))
    with pytest.raises(F.FP8Error, match="unpaired.*q_proj.weight"):
        list(F.dequantize_stream([(name, q)], torch.float32))
