"""GPU check for megapkl.rollout.fp8: block-FP8 quantization of a Qwen3-8B-shaped model on one GPU.

Needs torch (with numpy) and this repository: it imports `megapkl.rollout.fp8`, which imports
torch and megapkl's own light modules (`megapkl.rollout`: data, engine, rewards, sample,
synthetic, fp8_cpu; numpy through them), none of megapkl's other dependencies. The CPU kernel
(fp8_cpu) is compiled only when a CPU tensor is quantized (the --device cpu run). Prints JSON
lines:
- `export_quantize`: random bf16 linear weights shaped like Qwen3-8B (36 layers, hidden 4096,
  intermediate 12288, 32 query / 8 KV heads of 128) -- the "export" is one device copy of every
  weight (what a TP=1 gather costs), then `quantize_block_fp8` on each; seconds for both, and
  quantization throughput against the device's copy bandwidth on the same bytes. Goal: export +
  quantization <= 1 s.
- `error_bound`: the stated bound max |w - deq| / (2^-4 (1 + 2^-20) |w| + 2^-10 s) on a few
  weights, random and adversarial (must be <= 1).
- `matmul`: one activation [256, 4096] times a q_proj weight: bf16 vs the dequantized FP8 weight,
  and `torch._scaled_mm` (per-tensor e4m3 scales) where the device supports it; relative errors.

    python tools/gpu_checks/fp8_gpu.py                   # CUDA, full 8B shapes (< 5 min on a H200)
    python tools/gpu_checks/fp8_gpu.py --device cpu --small   # the same logic at toy shapes
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megapkl.rollout import fp8 as F  # noqa: E402 - after the repository is on the path

QWEN3_8B = dict(layers=36, hidden=4096, inter=12288, heads=32, kv=8, head_dim=128)
SMALL = dict(layers=2, hidden=256, inter=640, heads=4, kv=2, head_dim=64)


def shapes(m: dict) -> list[tuple[int, int]]:
    h, q, kv = m["hidden"], m["heads"] * m["head_dim"], m["kv"] * m["head_dim"]
    per_layer = [(q, h), (kv, h), (kv, h), (h, q), (m["inter"], h), (m["inter"], h),
                 (h, m["inter"])]
    return per_layer * m["layers"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def export_quantize(weights: list[torch.Tensor], device, repeats: int) -> dict:
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    def export():
        return [w.clone() for w in weights]

    def both():
        for w in export():
            F.quantize_block_fp8(w)

    def quant():
        for w in weights:
            F.quantize_block_fp8(w)

    both()  # warm-up (allocator, kernels)
    t_both = min(timed(both, device) for _ in range(repeats))
    t_copy = min(timed(export, device) for _ in range(repeats))
    t_quant = min(timed(quant, device) for _ in range(repeats))
    return {"check": "export_quantize", "params": sum(w.numel() for w in weights),
            "bytes_bf16": nbytes, "export_plus_quantize_s": t_both, "export_copy_s": t_copy,
            "quantize_s": t_quant, "copy_GBps": 2 * nbytes / t_copy / 1e9,
            "ratio_quantize_vs_copy": t_copy / t_quant, "goal_export_plus_quantize_le_1s": t_both <= 1.0}


def bound_ratio(w: torch.Tensor) -> float:
    q, s = F.quantize_block_fp8(w)
    deq = F.dequantize_block_fp8(q, s, torch.float64)
    w64 = w.double()
    s_el = s.double().repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return float(((w64 - deq).abs() / (F.ERROR_REL * w64.abs() + F.ERROR_ABS * s_el)).max())


def error_bound(weights: list[torch.Tensor], device) -> dict:
    adversarial = torch.randn(384, 300, device=device)
    adversarial[:128, :128] = 0
    adversarial[128:256, 128:256] *= 1e30
    adversarial[256:, :4] *= 1e-40
    cases = {"q_proj": weights[0], "down_proj": weights[6], "adversarial": adversarial}
    ratios = {k: bound_ratio(w) for k, w in cases.items()}
    finite = all(bool(torch.isfinite(F.quantize_block_fp8(w)[0].float()).all()) for w in cases.values())
    return {"check": "error_bound", "ratios": ratios, "ok": max(ratios.values()) <= 1.0 and finite}


def matmul(w: torch.Tensor, device) -> dict:
    x = torch.randn(256, w.shape[1], device=device, dtype=torch.bfloat16)
    ref = (x.double() @ w.double().T)
    bf16 = x @ w.T
    q, s = F.quantize_block_fp8(w)
    deq = x @ F.dequantize_block_fp8(q, s, torch.bfloat16).T

    def rel(y):
        return float((y.double() - ref).norm() / ref.norm())

    out = {"check": "matmul", "shape": [256, *w.shape], "rel_err_bf16": rel(bf16),
           "rel_err_fp8_dequantized": rel(deq)}
    if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        try:
            sx = x.abs().amax().float() / F.E4M3_MAX
            sw = w.abs().amax().float() / F.E4M3_MAX
            xq = (x.float() / sx).to(torch.float8_e4m3fn)
            wq = (w.float() / sw).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
            out["rel_err_scaled_mm_per_tensor"] = rel(y)
        except Exception as e:  # older GPUs / builds without FP8 GEMMs
            out["scaled_mm"] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy shapes (logic check, e.g. on CPU)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --small for a logic check")
    m = SMALL if args.small else QWEN3_8B
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(*s, generator=g, device=device).mul_(0.02).to(torch.bfloat16)
               for s in shapes(m)]
    info = {"check": "setup", "device": str(device), "torch": torch.__version__,
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "model": "small" if args.small else "qwen3-8b linear layers"}
    print(json.dumps(info), flush=True)
    for result in (export_quantize(weights, device, args.repeats), error_bound(weights, device),
                   matmul(weights[0], device)):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
