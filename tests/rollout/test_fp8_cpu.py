"""The compiled CPU FP8 kernel (megapkl.rollout.fp8_cpu): bit for bit the torch path's numbers on
every bf16 value, random fp32 bit patterns, exact e4m3 ties and odd shapes, in one and several
threads; NaN/Inf errors; the compile cache; and the loud fallback when there is no compiler.
(test_fp8.py checks both paths against the float64 reference.)"""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from megapkl.rollout import fp8 as F
from megapkl.rollout import fp8_cpu


def require_kernel() -> None:
    have_cc = shutil.which(os.environ.get("CC") or "cc") is not None
    if not have_cc and os.environ.get("MEGAPKL_REQUIRE_CC") != "1":
        pytest.skip("no C compiler on this machine (CI installs one and sets MEGAPKL_REQUIRE_CC=1)")
    assert fp8_cpu.available(), "a C compiler is present but the FP8 CPU kernel did not build"


@pytest.fixture(autouse=True)
def kernel():
    require_kernel()


def assert_same(w: torch.Tensor, block=(128, 128)) -> None:
    fast = fp8_cpu.quantize(w.contiguous(), block)
    assert fast is not None, f"the kernel did not take a {w.dtype} CPU weight"
    q, s, bad = fast
    assert bad == -1
    rq, rs = F.quantize_block_fp8_torch(w, block)
    diff = (q.view(torch.uint8) != rq.view(torch.uint8)).nonzero()[:3].tolist()
    assert not diff, [(w[i, j].item(), q[i, j].item(), rq[i, j].item()) for i, j in diff]
    assert torch.equal(s, rs)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32


def every_bf16_value() -> torch.Tensor:
    """All 63,488 finite bf16 values (both zeros, subnormals, +-max), 248 rows of 256."""
    v = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v)]
    return v[: v.numel() // 256 * 256].view(-1, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(128, 128), (1, 256), (256, 1), (1, 2), (7, 3)])
def test_every_bf16_value_matches_torch(dtype, block):
    w = every_bf16_value().to(dtype)
    assert_same(w, block)
    assert_same(w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))], block)


@pytest.mark.parametrize("block", [(1, 1), (1, 8), (128, 128), (3, 5)])
def test_random_fp32_bit_patterns_match_torch(block):
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (384, 520), generator=g, dtype=torch.int32)
    w = w.view(torch.float32)
    w[~torch.isfinite(w)] = 1.0
    assert_same(w, block)


def test_rounding_of_every_magnitude_and_exact_ties():
    """Blocks of one row whose first element is 448 have scale exactly 1, so the kernel's rounding
    of w itself is compared: random exponents over the whole e4m3 range and beyond (subnormals,
    values below half the smallest subnormal, above 448), a third of them exact midpoints."""
    g = torch.Generator().manual_seed(2)
    k = 4096
    exponent = torch.randint(100, 136, (256, k), generator=g, dtype=torch.int32)
    mantissa = torch.randint(0, 1 << 23, (256, k), generator=g, dtype=torch.int32)
    tie = torch.rand(256, k, generator=g) < 0.3
    mantissa = torch.where(tie, (mantissa & ~((1 << 20) - 1)) | (1 << 19), mantissa)
    sign = torch.randint(0, 2, (256, k), generator=g, dtype=torch.int32) << 31
    w = (sign | (exponent << 23) | mantissa).view(torch.float32).clamp(-448, 448)
    w[:, 0] = 448.0
    assert_same(w, (1, k))
    sub = torch.randint(-40, 41, (64, k), generator=g).float() * 2.0 ** -11  # subnormal midpoints
    sub[:, 0] = 448.0
    assert_same(sub, (1, k))
    q, s, _ = fp8_cpu.quantize(sub, (1, k))
    assert float(s[0, 0]) == 1.0


@pytest.mark.parametrize("shape", [(1, 1), (5, 700), (300, 200), (129, 131), (128, 128),
                                   (1000, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_odd_shapes_zeros_and_negative_zero(shape, dtype):
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
    assert_same(w)
    z = torch.zeros(*shape, dtype=dtype)
    assert_same(z)
    assert_same(-z)  # -0.0 keeps its sign bit (e4m3 0x80), as torch's cast does
    assert fp8_cpu.quantize(-z, (128, 128))[0].view(torch.uint8).eq(0x80).all()


def test_threads_split_block_rows_without_changing_a_bit():
    w = (torch.randn(1000, 700, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp8_cpu.quantize(w, (128, 128))
        torch.set_num_threads(max(2, before))
        many = fp8_cpu.quantize(w, (128, 128))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0].view(torch.uint8), many[0].view(torch.uint8))
    assert torch.equal(one[1], many[1]) and one[2] == many[2] == -1
    assert_same(w.t())  # a transposed (non-contiguous) weight is made contiguous first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_in_any_block_row_is_an_error(dtype, bad):
    w = torch.randn(1000, 700, dtype=dtype)  # several block rows, several threads
    w[517, 699] = bad
    assert fp8_cpu.quantize(w, (128, 128))[2] == 4  # the block row holding it
    with pytest.raises(F.FP8Error, match="'model.layers.3.mlp.down_proj.weight'.*NaN or Inf"):
        F.quantize_block_fp8(w, name="model.layers.3.mlp.down_proj.weight")


def test_other_devices_and_dtypes_take_the_torch_path():
    assert fp8_cpu.quantize(torch.randn(4, 4, dtype=torch.float16), (128, 128)) is None
    assert fp8_cpu.quantize(torch.randn(4, 4, dtype=torch.float64), (128, 128)) is None
    assert fp8_cpu.quantize(torch.randn(4, 4, 4), (128, 128)) is None
    assert fp8_cpu.quantize(torch.randn(4, 4, device="meta"), (128, 128)) is None


def test_compiled_once_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = fp8_cpu.build()
    assert first.parent == tmp_path / "megapkl" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert fp8_cpu.build() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    monkeypatch.setattr(fp8_cpu, "_cpu_id", lambda: "another CPU model and flags")
    other = fp8_cpu.build()
    assert other != first and other.exists()  # a node with another CPU never loads `first`
    assert sorted(p.name for p in (tmp_path / "megapkl").iterdir()) == sorted([first.name, other.name])


@pytest.mark.parametrize("why", ["no compiler", "compile error"])
def test_without_a_working_compiler_one_warning_and_the_same_numbers(why, tmp_path, monkeypatch,
                                                                     caplog):
    w = (torch.randn(300, 200, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    want = F.quantize_block_fp8(w)
    monkeypatch.setattr(fp8_cpu, "_state", {})  # forget the loaded kernel for this test only
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if why == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        broken = tmp_path / "fp8_cpu.c"
        broken.write_text("int megapkl_fp8_quantize_bf16( {\n")
        monkeypatch.setattr(fp8_cpu, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger="megapkl.rollout.fp8_cpu"):
        got = F.quantize_block_fp8(w)
        F.quantize_block_fp8(w)
    warnings = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert ("no-such-cc" if why == "no compiler" else "error") in warnings[0]
    assert fp8_cpu.quantize(w, (128, 128)) is None
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


# ------------------------------------------------------------------------- dequantization

def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit, except that any NaN matches any NaN (payloads are not a contract)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    diff = ((a.view(bits) != b.view(bits)) & ~nan).nonzero()[:3].tolist()
    assert not diff, [(a[i, j].item(), b[i, j].item()) for i, j in diff]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(128, 128), (1, 128), (3, 7)])
def test_dequantize_every_code_and_extreme_scales_match_torch(dtype, block):
    g = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = codes[torch.randint(0, 256, (300, 520), generator=g)].view(torch.float8_e4m3fn)
    q[:1, :256] = codes.view(torch.float8_e4m3fn)  # every code, NaN ones included
    nr, nc = -(-300 // block[0]), -(-520 // block[1])
    scale = torch.exp(torch.randn(nr, nc, generator=g) * 3)
    scale.view(-1)[:4] = torch.tensor([2.0 ** -126, 1e38, 3.0e38, 2.0 ** -140])  # overflow, denormal
    got = F.dequantize_block_fp8(q, scale, dtype, block)
    assert fp8_cpu.dequantize(q, scale, dtype, block) is not None
    assert_same_values(got, F.dequantize_block_fp8_torch(q, scale, dtype, block))
    assert torch.isinf(got).any() and torch.isnan(got).any()  # the extremes were exercised


def test_dequantize_round_trip_threads_and_layouts():
    w = (torch.randn(1000, 700, generator=torch.Generator().manual_seed(6)) * 0.02)
    q, s = F.quantize_block_fp8(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = F.dequantize_block_fp8(q, s, torch.bfloat16)
        torch.set_num_threads(max(2, before))
        many = F.dequantize_block_fp8(q, s, torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int16), many.view(torch.int16))
    assert torch.equal(one, F.dequantize_block_fp8_torch(q, s, torch.bfloat16))
    qt = q.t()  # a non-contiguous weight and scale grid
    assert torch.equal(F.dequantize_block_fp8(qt, s.t(), torch.float32),
                       F.dequantize_block_fp8_torch(qt, s.t(), torch.float32))
    assert fp8_cpu.dequantize(q, s, torch.float16, (128, 128)) is None  # torch path
    assert fp8_cpu.dequantize(q, s.double(), torch.float32, (128, 128)) is None
