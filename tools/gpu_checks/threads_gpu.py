"""GPU check: work on the threads megapkl starts lands on the rank's GPU, not on GPU 0.

CUDA's current device belongs to a thread; a new thread starts on device 0. This process plays a
rank whose local rank is 1 (its main thread on cuda:1, NCCL world of one on it, as the trainer's
launch sets it) and runs, on megapkl's own threads, what a leader does off its main thread:
- the producer's unit of work (generation ahead of training): the device of a fresh CUDA tensor
  and the device a bucket would be flattened on for the NCCL weight-update group
  (`group_device`), the one the servers receive on;
- the fleet's heartbeat resyncing a stale server (a stand-in HTTP server here): the same;
- the tensor weight sync's layout thread, through the push's transform (the FP8 seam): the same.
Every one must be cuda:1. One JSON line; exit status 1 when a check fails. With fewer than two
GPUs the rank's device and a new thread's are both 0 and nothing can be told apart: the line
says so (skipped), and `--device cpu` runs the same code paths without CUDA.

    python tools/gpu_checks/threads_gpu.py                # two GPUs or more
    python tools/gpu_checks/threads_gpu.py --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class _Ok(BaseHTTPRequestHandler):
    """Answers every route as SGLang does a successful call (enough for a tensor push)."""

    def _ok(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        body = b'{"success": true, "message": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _ok

    def log_message(self, *args):
        pass


def where(torch, dist) -> dict:
    """What work on the calling thread uses: its current device, a fresh tensor's, and the device
    a bucket for the NCCL update group is made on."""
    from megapkl.parallel.groups import group_device

    if not torch.cuda.is_available():
        return {"current": None, "tensor": "cpu", "group_device": str(group_device(None))}
    return {"current": torch.cuda.current_device(),
            "tensor": str(torch.empty(1, device="cuda").device),
            "group_device": str(group_device(dist.group.WORLD))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    from megapkl.parallel.groups import _init_process_group
    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
    from megapkl.rollout.sglang.weights import SyncSettings, Target, WeightSync
    from megapkl.train.producer import Producer

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        print(json.dumps({"check": "thread_devices", "ok": False, "error": "no CUDA device"}))
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(1 if gpus > 1 else 0))
    _init_process_group("nccl" if gpus else "gloo", "env://", None, None, 5)
    want = f"cuda:{1 if gpus > 1 else 0}" if gpus else "cpu"
    seen: dict[str, dict] = {"main": where(torch, dist)}

    producer = Producer(lambda key: seen.setdefault("producer", where(torch, dist)),
                        versions=lambda k: [], failed=lambda r: False, on_error=repr)
    producer.plan(["unit"])
    producer.take("unit")
    producer.stop()

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    class Owner:  # the fleet's weight owner, reduced to what a resync does on its thread
        version = 0

        def asleep(self, w):
            return False

        def restarted(self, w):
            pass

        def resync(self, workers):
            seen.setdefault("heartbeat_resync", where(torch, dist))

        def may_recover(self):
            return True

    fleet = Fleet([Worker(url, state="stale")], health=HealthSettings(interval_s=0.05,
                                                                      timeout_s=10))
    fleet.bind(Owner())
    fleet.start_heartbeat()
    deadline = time.monotonic() + 30
    while "heartbeat_resync" not in seen and time.monotonic() < deadline:
        time.sleep(0.02)
    fleet.close()

    def transform(bucket):
        seen.setdefault("sync_layout", where(torch, dist))
        return bucket

    sync = WeightSync(SyncSettings(mode="tensor", timeout_s=30), transform=transform)
    sync.push([Target(url)], [("w", torch.ones(8))], version=1)
    sync.close()
    server.shutdown()

    parts = ("producer", "heartbeat_resync", "sync_layout")
    checks = {p: p in seen and seen[p]["tensor"] == want and seen[p]["group_device"] == want
              for p in parts}
    distinguishes = gpus > 1
    res = {"check": "thread_devices", "device": args.device, "gpus": gpus, "want": want,
           "seen": seen, "checks": checks, "skipped": not distinguishes,
           "ok": all(checks.values())}
    if not distinguishes:
        res["note"] = ("fewer than two GPUs: the rank's device and a new thread's are the same, "
                       "so this run only shows the code paths work")
    print(json.dumps(res), flush=True)
    dist.destroy_process_group()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
