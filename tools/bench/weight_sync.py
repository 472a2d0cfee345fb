"""Weight sync benchmark: a Qwen3-0.6B-shaped model (BF16, ~1.5 GB with its untied lm_head) pushed
to a local `megapkl serve` worker in each mode of rollout.sglang.weight_sync (tensor, distributed
over gloo, disk), side by side with a plain memory copy of the same bytes, in one run; then the same
with `rollout.fp8` on (to a worker started with `--quantization fp8`).

Each mode pushes from two sources: `stored`, the trainer's own path (a policy version in the
VersionStore, pushed by reference to its file: FP8-quantized when it was written under rollout.fp8),
and `memory`, tensors in this process (quantized bucket by bucket under rollout.fp8, the sync's
transform).

Every timed pass is paired with a memory copy of the same bytes just before it, so both see the same
load on a shared host. Printed per row: seconds per sync (the whole pause -> buckets -> version ->
continue sequence, the server's loading included) as the median and range of `--repeats` timed
passes, GB/s of the BF16 export at the median, the median of the row's own memory copies and the
ratio of the two medians, and the median CPU seconds of a pass (this process and the worker
together; on a loaded host it moves far less than wall time). Warm pages: every row starts with one
untimed pass, which faults the copy's destination in, sets up what the first sync builds (shared
memory, the process group, the files) and reads the stored version's file into the page cache
(read once before as well), so the timed passes measure the steady state. The worker's reported
version is checked after every sync (outside the timing). `--shape tiny` runs in seconds.

    python tools/bench/weight_sync.py [--shape qwen3-0.6b|tiny] [--bucket-mb 512] [--repeats 5]
                                      [--fp8 both|off|on] [--modes tensor,distributed,disk]
                                      [--sources stored,memory]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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
MODES = ("tensor", "distributed", "disk")
SOURCES = ("stored", "memory")


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


def stored_version(weights, root: Path, fp8: bool):
    """The weights as the trainer keeps a policy version (block FP8 under rollout.fp8), its file
    read once into the page cache."""
    from megapkl.rollout.fp8 import FP8Transform
    from megapkl.rollout.version_store import VersionStore

    store = VersionStore(root)
    store.save(1, FP8Transform()(weights) if fp8 else weights)
    source = store.get(1)
    with open(source.path, "rb") as f:
        while f.read(64 << 20):
            pass
    return source


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (every thread), or of process `pid`."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Copy:
    """A plain memory copy of the weights into buffers allocated (and faulted in) once."""

    def __init__(self, weights):
        self.weights = weights
        self.dst = [torch.empty_like(t) for _, t in weights]
        self()  # the destination's pages faulted in before any timing
        self.seconds: list[float] = []
        self.cpu: list[float] = []

    def __call__(self) -> None:
        for d, (_, t) in zip(self.dst, self.weights):
            d.copy_(t)

    def timed(self) -> float:
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        self()
        self.seconds.append(time.perf_counter() - t0)
        self.cpu.append(cpu_seconds() - cpu0)
        return self.seconds[-1]


def timed(fn, repeats: int, copy: Copy, check=None, worker: int | None = None) -> dict:
    """`repeats` timed calls of `fn` after one untimed warm-up call, each right after a timed
    memory copy; `check` runs untimed after every call. Seconds, paired copies, CPU seconds."""
    out = {"seconds": [], "copies": [], "cpu": []}
    for i in range(repeats + 1):
        if i:
            out["copies"].append(copy.timed())
        cpu0 = cpu_seconds() + (cpu_seconds(worker) if worker else 0.0)
        t0 = time.perf_counter()
        fn()
        if i:
            out["seconds"].append(time.perf_counter() - t0)
            out["cpu"].append(cpu_seconds() + (cpu_seconds(worker) if worker else 0.0) - cpu0)
        if check is not None:
            check()
    return out


def row(what: str, seconds: list[float], nbytes: int, copies: list[float],
        cpu: list[float] | None = None) -> dict:
    """Median and range of `seconds`; GB/s and the ratio to the memory copies' median."""
    med, base = statistics.median(seconds), statistics.median(copies)
    out = {"what": what, "median_s": _sig(med), "min_s": _sig(min(seconds)),
           "max_s": _sig(max(seconds)), "GB/s": _sig(nbytes / med / 1e9),
           "copy_median_s": _sig(base), "ratio": _sig(med / base)}
    if cpu is not None:
        out["cpu_s"] = _sig(statistics.median(cpu))
    return out


def _sig(x: float) -> float:
    """Three significant digits: the tiny shape's copies take microseconds, the 0.6B's seconds."""
    return float(f"{x:.3g}")


def bench_modes(args, spec: str, weights, work: Path, fp8: bool, nbytes: int, copy: Copy
                ) -> list[dict]:
    from megapkl.rollout.fp8 import sync_transform
    from megapkl.rollout.sglang import http
    from megapkl.rollout.sglang.weights import MiB, SyncSettings, Target, WeightSync
    from megapkl.rollout.sglang.weights import free_port, identity

    stored = (stored_version(weights, work / f"versions{'_fp8' if fp8 else ''}", fp8)
              if "stored" in args.sources else None)
    port = free_port()
    proc = start_worker(spec, port, work / f"worker{'_fp8' if fp8 else ''}.log", fp8)
    url, rows, version = f"http://127.0.0.1:{port}", [], 0
    try:
        for mode in args.modes:
            for source in args.sources:
                # as a run does: a stored version is sent as it was written; memory tensors are
                # quantized by the sync's transform under rollout.fp8
                transform = sync_transform() if fp8 and source == "memory" else identity
                sync = WeightSync(SyncSettings(mode=mode, bucket_bytes=int(args.bucket_mb * MiB),
                                               timeout_s=1800), export_dir=work / "export",
                                  transform=transform)
                pushed = [version]
                what = stored if source == "stored" else weights

                def push() -> None:  # the untimed first push also sets up (shm, group, files)
                    pushed[0] += 1
                    sync.push([Target(url)], what, pushed[0])

                def check() -> None:
                    got = http.request(url, "model_info", timeout=60)["weight_version"]
                    assert got == str(pushed[0]), (mode, got, pushed[0])

                t = timed(push, args.repeats, copy, check, worker=proc.pid)
                version = pushed[0]
                sync.close_group([Target(url)])
                sync.close()
                rows.append(row(f"sync {mode} {source}" + (" fp8" if fp8 else ""), t["seconds"],
                                nbytes, t["copies"], t["cpu"]))
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
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + str(MODES))
    ap.add_argument("--sources", default=",".join(SOURCES), help="comma-separated, of " +
                    str(SOURCES))
    args = ap.parse_args()
    args.modes, args.sources = args.modes.split(","), args.sources.split(",")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if not set(args.modes) <= set(MODES) or not set(args.sources) <= set(SOURCES):
        raise SystemExit(f"--modes: {MODES}, --sources: {SOURCES}")

    work = Path(tempfile.mkdtemp(prefix="megapkl_sync_bench_"))
    spec = spec_file(args.shape, work)
    weights = trainer_weights(spec)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    copy = Copy(weights)
    rows = []
    for fp8 in {"both": (False, True), "off": (False,), "on": (True,)}[args.fp8]:
        rows += bench_modes(args, spec, weights, work, fp8, nbytes, copy)
    shutil.rmtree(work)  # versions and exports: GBs (kept, with the worker's log, on a failure)
    print(json.dumps({"shape": args.shape, "tensors": len(weights), "bytes": nbytes,
                      "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                      "torch_threads": torch.get_num_threads(),
                      "load_avg": [round(x, 1) for x in os.getloadavg()]}))
    print(json.dumps(row("memory copy", copy.seconds, nbytes, copy.seconds, copy.cpu)))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
