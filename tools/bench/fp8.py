"""Benchmark: block-FP8 quantization throughput, and host memory of the stale-version pool.

1. Quantization (`megapkl.rollout.fp8.quantize_block_fp8`, 128x128 blocks) of a set of bf16 linear
   weights shaped like Qwen3-0.6B layers, against a plain memory copy of the same bytes
   (`dst.copy_(src)` per tensor into preallocated bf16 tensors). Interleaved repetitions, medians;
   ratio = copy time / quantization time (throughput relative to a copy). Goal: >= 0.5. On CPU
   quantize_block_fp8 runs the compiled kernel (fp8_cpu); the torch path (`quantize_block_fp8_torch`,
   what GPUs run) is timed beside it.
2. Host memory per rank for the uniform-stale protocol (k versions of lag, the schedule holds about
   k + 2 versions): before = the in-memory pool (every version a full CPU copy, as the rollout stage
   held them before version_store), after = the disk store (`megapkl.rollout.version_store`: each
   version written once, one version streamed into an engine-sized staging copy). Each side runs
   in its own process; the figure is its peak RSS above the live weights, in model copies.
   Goal: after <= 2 model copies regardless of k. The default shape is reduced (`--mem-layers 1`,
   `--mem-vocab 8192`, hidden 1024 like Qwen3-0.6B) to fit a small machine: the ratios in model
   copies do not depend on the shape.

    python tools/bench/fp8.py [--layers 4] [--repeats 5] [--threads N] [--k 32] [--fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

H, I, HEADS, KV, HD = 1024, 3072, 16, 8, 128  # Qwen3-0.6B


def layer_shapes(layers: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (HEADS * HD, H),
                    p + "self_attn.k_proj.weight": (KV * HD, H),
                    p + "self_attn.v_proj.weight": (KV * HD, H),
                    p + "self_attn.o_proj.weight": (H, HEADS * HD),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I)})
    return out


def bench_quantization(args) -> dict:
    from megapkl.rollout import fp8_cpu
    from megapkl.rollout.fp8 import quantize_block_fp8, quantize_block_fp8_torch

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g).mul_(0.02).to(torch.bfloat16)
               for s in layer_shapes(args.layers).values()]
    dst = [torch.empty_like(w) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    def copy():
        for d, w in zip(dst, weights):
            d.copy_(w)

    def quant():
        for w in weights:
            quantize_block_fp8(w)

    def quant_torch():
        for w in weights:
            quantize_block_fp8_torch(w)

    cases = {"copy": copy, "quantize": quant, "torch": quant_torch}
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up (and the kernel's first-use compile)
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": nbytes, "threads": torch.get_num_threads(),
            "path": "kernel" if fp8_cpu.available() else "torch (no C compiler)",
            "copy_GBps": nbytes / med["copy"] / 1e9, "quantize_GBps": nbytes / med["quantize"] / 1e9,
            "ratio_quantize_vs_copy": med["copy"] / med["quantize"],
            "ratio_torch_path_vs_copy": med["copy"] / med["torch"]}


# ------------------------------------------------------------------------------------ memory

def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_side(args) -> dict:
    """One side of the memory benchmark, in this process (run through a subprocess)."""
    from megapkl.rollout.fp8 import SCALE_SUFFIX, FP8Transform
    from megapkl.rollout.version_store import VersionStore

    shapes = {"model.embed_tokens.weight": (args.mem_vocab, H), **layer_shapes(args.mem_layers)}
    live = {n: torch.randn(*s).to(torch.bfloat16) for n, s in shapes.items()}
    model_bytes = sum(t.numel() * 2 for t in live.values())

    def export(v):  # the trainer's export of version v: fresh tensors, as a gather produces them
        for n, t in live.items():
            yield n, t.clone().add_(v * 1e-3)

    held = args.k + 2
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    base = rss_kib("VmRSS")
    t0 = time.perf_counter()
    if args.side == "before":
        pool = {}
        for v in range(held + 4):
            pool[v] = [(n, t.detach().to("cpu", copy=True)) for n, t in export(v)]
            for old in [u for u in pool if u < v - held + 1]:
                del pool[old]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            store = VersionStore(tmp)
            transform = FP8Transform() if args.fp8 else (lambda s: s)
            for v in range(held + 4):
                store.save(v, transform(export(v)))
                store.delete_before(v - held + 1)
            staged = {n: t.clone() for n, t in store.load(held)}  # an engine's staging copy
            # every live weight staged (under FP8: each quantized one plus its `_scale_inv`)
            assert {n for n in staged if not n.endswith(SCALE_SUFFIX)} == set(live)
            disk = store.nbytes()
            del staged
    peak = (rss_kib("VmHWM") - base) * 1024
    out = {"side": args.side, "k": args.k, "versions_held": held, "model_bytes": model_bytes,
           "peak_extra_bytes": peak, "model_copies": peak / model_bytes,
           "seconds": time.perf_counter() - t0}
    if args.side == "after":
        out["disk_bytes"] = disk
    return out


def bench_memory(args) -> dict:
    sides = {}
    for side in ("before", "after"):
        cmd = [sys.executable, __file__, "--memory-side", side, "--k", str(args.k),
               "--mem-layers", str(args.mem_layers), "--mem-vocab", str(args.mem_vocab)]
        cmd += ["--fp8"] if args.fp8 else []
        res = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        sides[side] = json.loads(res.stdout.strip().splitlines()[-1])
    return sides


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="Qwen3-0.6B layers to quantize")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--k", type=int, default=32, help="uniform-stale lag bound")
    p.add_argument("--mem-layers", type=int, default=1)
    p.add_argument("--mem-vocab", type=int, default=8192)
    p.add_argument("--fp8", action="store_true", help="store versions block-FP8 (rollout.fp8)")
    p.add_argument("--memory-side", choices=["before", "after"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_side:
        args.side = args.memory_side
        print(json.dumps(memory_side(args)))
        return
    q = bench_quantization(args)
    print(f"quantization: {q['bytes'] / 1e6:.0f} MB bf16, {q['threads']} threads, {q['path']}: "
          f"copy {q['copy_GBps']:.2f} GB/s, quantize {q['quantize_GBps']:.2f} GB/s, ratio "
          f"{q['ratio_quantize_vs_copy']:.2f} (goal >= 0.5); the torch path alone: ratio "
          f"{q['ratio_torch_path_vs_copy']:.2f}")
    m = bench_memory(args)
    for side, r in m.items():
        disk = f", {r['disk_bytes'] / 1e6:.0f} MB on disk" if "disk_bytes" in r else ""
        print(f"stale pool {side}: k={r['k']}, {r['versions_held']} versions held, peak "
              f"{r['peak_extra_bytes'] / 1e6:.0f} MB above the live weights = "
              f"{r['model_copies']:.2f} model copies ({r['model_bytes'] / 1e6:.0f} MB each){disk}")
    print(f"memory ratio after/before: {m['after']['model_copies'] / m['before']['model_copies']:.3f}")


if __name__ == "__main__":
    main()
