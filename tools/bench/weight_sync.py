"""Weight sync benchmark: a Qwen3-0.6B-shaped model (BF16, ~1.2 GB) pushed to a local
`megapkl serve` worker in each mode of rollout.sglang.weight_sync (tensor, distributed over gloo,
disk), side by side with a plain memory copy of the same bytes, in one run; then the same with
`rollout.fp8` on (the trainer quantizes every bucket to block FP8 before it is sent, to a worker
started with `--quantization fp8`).

Prints per mode: seconds per sync (the whole pause -> buckets -> version -> continue sequence,
the server's loading included) as the median and range of `--repeats` timed passes, GB/s of the
BF16 export at the median, and the ratio of medians to the memory copy. Every measurement starts
with one untimed pass: it faults the destination pages in (memory copy) and sets up what the first
sync builds (shared memory, the process group, the files), so the timed passes measure the
steady state, not the setup; the range says how much the host's other load moved them. The
worker's reported version is checked after every sync (outside the timing). `--shape tiny` runs the same on the tiny model in seconds.

    python tools/bench/weight_sync.py [--shape qwen3-0.6b|tiny] [--bucket-mb 512] [--repeats 5]
                                      [--fp8 both|off|on]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

QWEN3_0P6B = dict(family="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28,
                  num_attention_heads=16, num_query_groups=8, head_dim=128, ffn_hidden_size=3072,
                  qk_layernorm=True, rope_theta=1000000.0, rms_norm_eps=1.0e-6,
                  tie_word_embeddings=True, max_position_embeddings=40960)


def spec_file(shape: str, directory: Path) -> str:
    if shape == "tiny":
        return "tiny-qwen3"
    import yaml

    path = directory / "qwen3-0.6b.yaml"
    path.write_text(yaml.safe_dump(QWEN3_0P6B))
    return str(path)


def start_worker(spec: str, port: int, log: Path, fp8: bool) -> subprocess.Popen:
    from megapkl.rollout.sglang import http

    cmd = [sys.executable, "-m", "megapkl.serve.serve", "--model-config", spec,
           "--dtype", "bfloat16", "--port", str(port)] + (["--quantization", "fp8"] if fp8 else [])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while True:
        try:
            http.request(f"http://127.0.0.1:{port}", "health", timeout=5)
            return proc
        except (http.ServerUnreachable, http.ServerError):
            if proc.poll() is not None or time.monotonic() - t0 > 900:
                raise SystemExit(f"worker did not start; see {log}")
            time.sleep(1)


def trainer_weights(spec: str) -> list[tuple[str, torch.Tensor]]:
    """Random BF16 tensors with the HF names and shapes of the model (what export_hf yields)."""
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import load_hf_config
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(hf_config_dict(load_spec(spec), dtype="bfloat16"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    return [(n, (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16))
            for n, p in model.state_dict().items()]


def timed(fn, repeats: int, check=None) -> list[float]:
    """Seconds of `repeats` calls of `fn`, after one untimed warm-up call; `check` runs untimed
    after every call."""
    out = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            out.append(time.perf_counter() - t0)
        if check is not None:
            check()
    return out


def row(what: str, seconds: list[float], nbytes: int, base: float) -> dict:
    """Median and range of `seconds`; GB/s and the ratio to the memory copy from the median."""
    med = statistics.median(seconds)
    return {"what": what, "median_s": _sig(med), "min_s": _sig(min(seconds)),
            "max_s": _sig(max(seconds)), "GB/s": _sig(nbytes / med / 1e9), "ratio": _sig(med / base)}


def _sig(x: float) -> float:
    """Three significant digits: the tiny shape's copies take microseconds, the 0.6B's seconds."""
    return float(f"{x:.3g}")


def memcpy_seconds(weights, repeats: int) -> list[float]:
    dst = [torch.empty_like(t) for _, t in weights]

    def copy() -> None:
        for d, (_, t) in zip(dst, weights):
            d.copy_(t)

    return timed(copy, repeats)


def bench_modes(args, spec: str, weights, work: Path, fp8: bool, nbytes: int, base: float
                ) -> list[dict]:
    from megapkl.rollout.fp8 import sync_transform
    from megapkl.rollout.sglang import http
    from megapkl.rollout.sglang.weights import MiB, SyncSettings, Target, WeightSync, free_port
    from megapkl.rollout.sglang.weights import identity

    port = free_port()
    proc = start_worker(spec, port, work / f"worker{'_fp8' if fp8 else ''}.log", fp8)
    url, rows, version = f"http://127.0.0.1:{port}", [], 0
    try:
        for mode in ("tensor", "distributed", "disk"):
            sync = WeightSync(SyncSettings(mode=mode, bucket_bytes=int(args.bucket_mb * MiB),
                                           timeout_s=1800), export_dir=work,
                              transform=sync_transform() if fp8 else identity)  # as rollout.fp8
            pushed = [version]

            def push() -> None:  # the untimed first push also sets up (shm, group, files)
                pushed[0] += 1
                sync.push([Target(url)], weights, pushed[0])

            def check() -> None:
                got = http.request(url, "model_info", timeout=60)["weight_version"]
                assert got == str(pushed[0]), (mode, got, pushed[0])

            seconds = timed(push, args.repeats, check)
            version = pushed[0]
            sync.close_group([Target(url)])
            rows.append(row(f"sync {mode}" + (" fp8" if fp8 else ""), seconds, nbytes, base))
    finally:
        proc.kill()
        proc.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--repeats", type=int, default=5, help="timed passes after the warm-up one")
    ap.add_argument("--fp8", choices=("both", "off", "on"), default="both")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="megapkl_sync_bench_"))
    spec = spec_file(args.shape, work)
    weights = trainer_weights(spec)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    copies = memcpy_seconds(weights, args.repeats)
    base = statistics.median(copies)
    rows = [row("memory copy", copies, nbytes, base)]
    for fp8 in {"both": (False, True), "off": (False,), "on": (True,)}[args.fp8]:
        rows += bench_modes(args, spec, weights, work, fp8, nbytes, base)
    print(json.dumps({"shape": args.shape, "tensors": len(weights), "bytes": nbytes,
                      "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                      "torch_threads": torch.get_num_threads()}))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
