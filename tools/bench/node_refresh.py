"""Node refresh benchmark: one stored policy version pushed to `megapkl serve` workers three ways,
side by side in one run, on one model shape, with K simulated nodes on this host:

  (a) leader-only: N servers on the leader's node, the leader pushes by `tensor` (shared memory);
  (b) per-node: N servers on each of K nodes, K owner processes each push the same stored version
      to their own node's servers by `tensor`, started together, timed until all are done;
  (c) distributed: the leader pushes to all K x N servers by `distributed` (a gloo broadcast), what
      one pusher needs when the servers are on other hosts.

Every pushing rank is a fresh process (spawned) that reads the version from the store's file, as
a trainer rank does. Prints per way: seconds per refresh (median and range of `--repeats` passes
after one untimed warm-up pass), servers refreshed, seconds per server refreshed, and per pushing
rank: `read_bytes` (bytes its read syscalls returned during a push, /proc/self/io rchar: the
stored file plus the HTTP answers), `handed_bytes` (bytes of the buckets handed to the transport,
counted at WeightSync's per-bucket transform seam; under `tensor` one shared-memory copy serves all
of a node's servers, under `distributed` the group fans one buffer out), `wrote_bytes` (write
syscalls, wchar: HTTP bodies, and gloo's broadcast, which the root writes once per receiver), and
`peak_bytes` (the RSS high-water mark, VmHWM, above the RSS before the first push, shared-memory
pages included; the largest over the pushing ranks) against one bucket and the model. Then the
ratios (b)/(a) and (b)/(c) of median seconds. After every pass each refreshed server's reported
version is checked (outside the timing), and once, after (b), a server of the last node is read
back through /get_weights_by_name against the stored tensors bit for bit (each tensor's leading
rows up to `--check-elements` elements; all of every tiny tensor). The simulated nodes share this
host's cores, page cache and memory bandwidth, which separate nodes do not: (b)/(a) here is an
upper bound.

    python tools/bench/node_refresh.py [--shape qwen3-0.6b|tiny] [--nodes 2] [--servers 1]
                                       [--repeats 3] [--bucket-mb 512]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_sync import _sig, spec_file, start_worker, trainer_weights  # noqa: E402

STORED = 1  # the store's one version; every push reports a new version number of the same bytes
BARRIER_S = 3600


def _proc_io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> int:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS, which is returned:
    ru_maxrss would not do, a spawned process inherits its parent's peak through exec."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def pusher(mode, urls, store_root, versions, bucket_bytes, start, done, out) -> None:
    """One pushing rank: for each version, wait for the start, push the stored version to `urls`,
    wait for the others. Puts its counts (or its traceback) on `out`."""
    try:
        import torch.distributed  # noqa: F401 - imported before the baseline, as a trainer has it

        from megapkl.rollout.sglang.weights import SyncSettings, Target, WeightSync
        from megapkl.rollout.version_store import VersionStore

        handed = [0]

        def count(bucket):  # the per-bucket seam every mode passes through before its transport
            handed[0] += sum(t.numel() * t.element_size() for _, t in bucket)
            return bucket

        stored = VersionStore(store_root, writer=False).get(STORED)
        sync = WeightSync(SyncSettings(mode=mode, bucket_bytes=bucket_bytes, timeout_s=1800),
                          transform=count)
        targets = [Target(u) for u in urls]
        base = _reset_peak()
        for v in versions:
            start.wait(BARRIER_S)
            io0, handed[0] = _proc_io(), 0
            sync.push(targets, stored, v)
            io1 = _proc_io()
            done.wait(BARRIER_S)
        sync.close_group(targets)
        peak = _status_bytes("VmHWM") - base
        out.put({"read_bytes": io1["rchar"] - io0["rchar"],
                 "wrote_bytes": io1["wchar"] - io0["wchar"],
                 "handed_bytes": handed[0], "peak_bytes": peak})
    except BaseException:  # noqa: BLE001 - reported by the driver, which would wait otherwise
        start.abort()
        done.abort()
        out.put({"error": traceback.format_exc()})


def measure(what, mode, groups, args, work, version, nbytes) -> tuple[dict, int]:
    """One way of refreshing: a pushing process per url group, `repeats + 1` passes."""
    from megapkl.rollout.sglang import http

    ctx = mp.get_context("spawn")
    start, done, out = ctx.Barrier(len(groups) + 1), ctx.Barrier(len(groups) + 1), ctx.Queue()
    versions = list(range(version + 1, version + args.repeats + 2))
    bucket = int(args.bucket_mb * (1 << 20))
    procs = [ctx.Process(target=pusher, args=(mode, urls, str(work / "policy_versions"), versions,
                                              bucket, start, done, out)) for urls in groups]
    for p in procs:
        p.start()
    seconds, servers = [], [u for urls in groups for u in urls]
    try:
        for i, v in enumerate(versions):
            start.wait(BARRIER_S)
            t0 = time.perf_counter()
            done.wait(BARRIER_S)
            if i:
                seconds.append(time.perf_counter() - t0)
            for url in servers:  # outside the timing
                got = http.request(url, "model_info", timeout=60)["weight_version"]
                assert got == str(v), f"{what}: {url} reports version {got}, pushed {v}"
        counts = [out.get(timeout=600) for _ in procs]
    except Exception:
        errors = [r["error"] for r in iter_queue(out) if "error" in r]
        raise SystemExit(f"{what}: a pushing rank failed:\n"
                         + "\n".join(errors or ["(no traceback)"]))
    finally:
        for p in procs:  # not join: torch's shared-memory manager holds the exit sentinel open
            deadline = time.monotonic() + 60
            while p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.is_alive():
                p.kill()
    med = statistics.median(seconds)
    peak = max(c["peak_bytes"] for c in counts)
    r = {"what": what, "mode": mode, "pushers": len(groups), "servers": len(servers),
         "median_s": _sig(med), "min_s": _sig(min(seconds)), "max_s": _sig(max(seconds)),
         "s_per_server": _sig(med / len(servers)),
         "read_bytes": max(c["read_bytes"] for c in counts),
         "handed_bytes": max(c["handed_bytes"] for c in counts),
         "wrote_bytes": max(c["wrote_bytes"] for c in counts),
         "peak_bytes": peak, "peak/bucket": _sig(peak / min(bucket, nbytes)),
         "peak/model": _sig(peak / nbytes)}
    return r, versions[-1]


def iter_queue(q):
    import queue

    while True:
        try:
            yield q.get(timeout=1)
        except queue.Empty:
            return


def check_bits(url: str, store_root: Path, max_elements: int) -> dict:
    """The server's weights against the stored version, bit for bit (leading rows of each)."""
    from megapkl.rollout.sglang import http
    from megapkl.rollout.version_store import VersionStore

    tensors = elements = 0
    for name, t in VersionStore(store_root, writer=False).get(STORED).stream():
        rows = max(1, min(t.shape[0], max_elements // max(1, t[0].numel()))) if t.dim() else 1
        held = torch.tensor(http.request(url, "/get_weights_by_name",
                                         {"name": name, "truncate_size": rows}, timeout=600))
        want = t[:rows] if t.dim() else t
        if held.shape != want.shape or not torch.equal(held.to(t.dtype).view(torch.uint8),
                                                       want.contiguous().view(torch.uint8)):
            raise SystemExit(f"bit check: {url} holds '{name}' unlike the stored version")
        tensors, elements = tensors + 1, elements + want.numel()
    return {"bit_check": url, "tensors": tensors, "elements": elements, "equal": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    ap.add_argument("--nodes", type=int, default=2, help="K simulated nodes")
    ap.add_argument("--servers", type=int, default=1, help="N servers per node")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes after the warm-up one")
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--check-elements", type=int, default=1 << 16,
                    help="elements of each tensor read back for the bit check")
    args = ap.parse_args()
    for key in ("nodes", "servers", "repeats"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key} must be >= 1, got {getattr(args, key)}")

    from megapkl.models.spec import load_spec
    from megapkl.rollout.sglang.weights import free_port
    from megapkl.rollout.version_store import VersionStore

    work = Path(tempfile.mkdtemp(prefix="megapkl_node_refresh_"))
    spec = spec_file(args.shape, work)
    weights = trainer_weights(spec)
    if load_spec(spec).tie_word_embeddings:  # the HF export writes a tied output layer once
        weights = [(n, t) for n, t in weights if n != "lm_head.weight"]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    file_bytes = VersionStore(work / "policy_versions").save(STORED, weights).stat().st_size
    del weights
    ports = [[free_port() for _ in range(args.servers)] for _ in range(args.nodes)]
    # free_port's ports are free when asked; ask all before starting any so none repeats
    with ThreadPoolExecutor(args.nodes * args.servers) as pool:
        procs = list(pool.map(
            lambda kp: start_worker(spec, kp[1], work / f"node{kp[0]}_{kp[1]}.log", False),
            [(k, p) for k, ps in enumerate(ports) for p in ps]))
    nodes = [[f"http://127.0.0.1:{p}" for p in ps] for ps in ports]
    rows, version = [], 0
    try:
        ways = [("a leader-only tensor", "tensor", nodes[:1]),
                ("b per-node tensor", "tensor", nodes),
                ("c leader distributed", "distributed", [[u for urls in nodes for u in urls]])]
        bits = None
        for what, mode, groups in ways:
            r, version = measure(what, mode, groups, args, work, version, nbytes)
            rows.append(r)
            if bits is None and len(groups) == args.nodes:  # (b): a server of the last node
                bits = check_bits(nodes[-1][0], work / "policy_versions", args.check_elements)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)  # the stored version is the model's size
    a, b, c = (r["median_s"] for r in rows)
    print(json.dumps({"shape": args.shape, "nodes": args.nodes, "servers_per_node": args.servers,
                      "bytes": nbytes, "file_bytes": file_bytes,
                      "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                      "torch_threads": torch.get_num_threads()}))
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(bits))
    print(json.dumps({"b/a_s": _sig(b / a), "b/c_s": _sig(b / c)}))


if __name__ == "__main__":
    main()
