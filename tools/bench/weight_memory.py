"""Benchmark: host memory the trainer needs, above its live weights, to give a policy version to an
SGLang server over the tensor sync, for a Qwen3-0.6B-shaped model in BF16 (~1.2 GB).

The trainer holds its live weights; the version is written to the version store first (as the
train loop does when it keeps a version), then the rollout engine is given it:
`engine.update_weights(<the stored version>, version)` against one `megapkl serve` worker. A thread
samples this process's resident memory (VmRSS, shared memory it maps included) every 2 ms.
Printed: the peak above the resident memory just before the sync, what is still held after it
(the engine still open: what it keeps between pushes) and after the engine is closed, all in model
copies (the version's bytes), for today's code beside the code of another git revision (default
`main`), measured in one run, each in a fresh process, against the same worker.
Goal: the peak <= 1.2 model copies.

    python tools/bench/weight_memory.py [--baseline main] [--shape qwen3-0.6b|tiny]
                                        [--bucket-mb 512]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Peak:
    """The highest VmRSS seen while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> "Peak":
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def child(url: str, spec: str, work: Path, bucket_mb: float) -> dict:
    """In a fresh process whose PYTHONPATH holds the code under test (today's or the baseline's)."""
    import gc

    from megapkl.config import load_config

    live = trainer_weights(spec)  # the trainer's live weights, resident from here on
    nbytes = sum(t.numel() * t.element_size() for _, t in live)
    cfg = load_config("configs/demo/cpu_demo.yaml", [  # the tree under test is the cwd
        "rollout.engine=sglang", f'rollout.sglang.urls=["{url}"]', f"run_dir={work}",
        "rollout.sglang.weight_sync=tensor", f"rollout.sglang.bucket_mb={bucket_mb}",
        "rollout.sglang.sync_timeout_s=1800", "rollout.sglang.request_timeout_s=1800"])
    try:  # today's layout
        from megapkl.rollout.factory import engine_context
        from megapkl.rollout.sglang.build import build_sglang_engine
        from megapkl.rollout.version_store import VersionStore

        try:
            from megapkl.config.layout import Layout

            ctx = engine_context(cfg.model, _hf(spec), work_dir=cfg.run_dir, seed=cfg.seed,
                                 layout=Layout.of(cfg.parallel, world=1))
        except ImportError:  # before the one layout value
            ctx = engine_context(cfg, _hf(spec))
        engine = build_sglang_engine(cfg.rollout, ctx)
    except ImportError:  # earlier revisions
        from megapkl.rollout.sglang.build import build_sglang_engine
        from megapkl.train.version_store import VersionStore

        engine = build_sglang_engine(cfg, _hf(spec))
    store = VersionStore(work / "policy_versions")
    store.save(1, live)  # what keep_weights does before any engine loads the version
    source = store.get(1) if hasattr(store, "get") else store.load(1)
    gc.collect()
    before = rss()
    t0 = time.perf_counter()
    with Peak() as peak:
        engine.update_weights(source, 1)
    seconds = time.perf_counter() - t0
    del source
    gc.collect()
    held = rss()
    from megapkl.rollout.sglang import http

    assert http.request(url, "model_info", timeout=60)["weight_version"] == "1"
    engine.close()
    gc.collect()
    return {"model_bytes": nbytes, "peak_above": peak.peak - before, "held_after": held - before,
            "closed_after": rss() - before, "seconds": round(seconds, 2)}


def trainer_weights(spec: str) -> list:
    """Random BF16 tensors with the HF names and shapes of the model (what the export yields)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megapkl.rollout.embedded import load_hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(_hf(spec)))
    g = torch.Generator().manual_seed(0)
    return [(n, (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16))
            for n, p in model.state_dict().items()]


def _hf(spec: str) -> dict:
    from megapkl.models.spec import hf_config_dict, load_spec

    return hf_config_dict(load_spec(spec), dtype="bfloat16")


def revision_tree(rev: str, into: Path) -> Path:
    """The package and configs of git revision `rev`, unpacked under `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "megapkl", "configs"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_child(code: Path, url: str, spec: str, work: Path, bucket_mb: float) -> dict:
    """One measurement in a fresh process; its answer comes back in a file (a pipe would wait for
    torch's shared-memory manager, which the child starts and which may outlive it)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    work.mkdir(parents=True, exist_ok=True)
    log = work / "measure.log"
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, __file__, "--child", url, "--spec", spec,
                             "--work", str(work), "--bucket-mb", str(bucket_mb)],
                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=code).returncode
    if rc != 0:
        raise SystemExit(f"the measurement with {code} failed:\n{log.read_text()[-3000:]}")
    return json.loads((work / "result.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="main", help="git revision to measure beside today's")
    ap.add_argument("--shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(args.child, args.spec, args.work, args.bucket_mb)
        (args.work / "result.json").write_text(json.dumps(result))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weight_sync import spec_file, start_worker

    from megapkl.rollout.sglang.weights import free_port

    work = Path(tempfile.mkdtemp(prefix="megapkl_weight_memory_"))
    spec = spec_file(args.shape, work)
    port = free_port()
    server = start_worker(spec, port, work / "worker.log", fp8=False)
    url = f"http://127.0.0.1:{port}"
    try:
        trees = {args.baseline: revision_tree(args.baseline, work / "baseline"), "today": ROOT}
        rows = {}
        for name, code in trees.items():
            rows[name] = run_child(code, url, spec, work / f"run_{name.replace('/', '_')}",
                                   args.bucket_mb)
    finally:
        server.kill()
        server.wait()
    shutil.rmtree(work)  # the stored versions: GBs (kept, with the logs, on a failure)
    print(json.dumps({"shape": args.shape, "bucket_mb": args.bucket_mb,
                      "model_bytes": rows["today"]["model_bytes"]}))
    for name, r in rows.items():
        m = r["model_bytes"]
        print(json.dumps({"code": name, "peak_above_live_copies": round(r["peak_above"] / m, 2),
                          "held_after_copies": round(r["held_after"] / m, 2),
                          "closed_after_copies": round(r["closed_after"] / m, 2),
                          "peak_above_GB": round(r["peak_above"] / 1e9, 2),
                          "sync_seconds": r["seconds"]}))


if __name__ == "__main__":
    main()
