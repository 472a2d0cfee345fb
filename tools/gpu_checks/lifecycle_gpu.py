"""GPU check: the colocated lifecycle's two GPU-only facts, on one GPU.

1. The weight-update group under a device-bound default group. A Slurm or torchrun task binds its
   default group to its GPU (`init_process_group(device_id=...)`); torch then builds every new
   NCCL group by splitting the default communicator, a collective over the trainer's whole world
   that the SGLang servers are no part of. The group megapkl opens for a weight push
   (`megapkl.rollout.sglang.weights.open_update_group`, what `WeightSync` calls) must not split:
   the default backend's `comm_split_count()` stays where it was after the group's first
   broadcast. The control, a `dist.new_group` made the plain way, must split (the counter moves),
   so the check can fail. One GPU cannot hold a second NCCL rank (NCCL refuses two ranks on one
   device), so the server side is not joined here; the split is what hangs it.
2. The cache freed before a resume. torch_memory_saver gives a resumed server fresh physical
   memory; blocks the trainer freed stay reserved by PyTorch's caching allocator. The trainer
   allocates and frees `--fraction` of the GPU (activations, sized like the plan's "activations
   are free while the servers generate"), then another process (standing in for the server's
   fresh allocations) asks for the same amount: it must fail before
   `megapkl.rollout.sglang.weights.free_cached_memory` and succeed after it.

    python tools/gpu_checks/lifecycle_gpu.py [--device cpu] [--fraction 0.6]

Prints one JSON line per check; exit status 1 when one fails. On CPU (gloo, no binding, no CUDA
memory) the same code runs and the GPU-only assertions are reported as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

GIB = 1024 ** 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_count(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    backend = dist.distributed_c10d._get_default_group()._get_backend(device)
    return int(backend.comm_split_count())


def check_update_group(device: torch.device) -> dict:
    from megapkl.rollout.sglang.weights import group_backend, open_update_group

    gpu = device.type == "cuda"
    backend = group_backend(cuda=gpu)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, device_id=device if gpu else None)
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    before = split_count(device)
    t0 = time.perf_counter()
    pg = open_update_group(backend, "127.0.0.1", free_port(), 1, 0, "megapkl-weights-check", 60.0)
    x = torch.ones(1024, device=device)
    dist.broadcast(x, src=0, group=pg)
    ours = split_count(device)
    control = dist.new_group([0])
    dist.broadcast(x, src=0, group=control)
    after_control = split_count(device)
    seconds = time.perf_counter() - t0
    if gpu:
        torch.cuda.synchronize()
    dist.destroy_process_group()
    row = {"check": "update_group", "device": str(device), "bound_device": str(bound),
           "split_count_before": before, "split_count_after_update_group": ours,
           "split_count_after_control_new_group": after_control, "seconds": round(seconds, 3)}
    if not gpu:
        row.update(ok=True, skipped="no NCCL on CPU: the group was made and broadcast over gloo")
        return row
    row["ok"] = bound is not None and ours == before and after_control > before
    return row


CHILD = r"""
import sys, torch
n = int(sys.argv[1])
try:
    t = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    print("allocated")
except torch.OutOfMemoryError:
    print("oom")
"""


def other_process_allocates(nbytes: int) -> str:
    out = subprocess.run([sys.executable, "-c", CHILD, str(nbytes)], capture_output=True,
                         text=True, timeout=120)
    return (out.stdout.strip().splitlines() or [f"exit {out.returncode}: {out.stderr[-300:]}"])[-1]


def check_free_before_resume(device: torch.device, fraction: float) -> dict:
    from megapkl.rollout.sglang.weights import free_cached_memory

    if device.type != "cuda":
        free_cached_memory()  # no CUDA: nothing to free and no error
        return {"check": "free_before_resume", "ok": True, "skipped": "no CUDA memory on CPU"}
    free0, total = torch.cuda.mem_get_info(device)
    want = int(free0 * fraction)
    blocks = [torch.empty(want // 8, dtype=torch.uint8, device=device) for _ in range(8)]
    torch.cuda.synchronize()
    del blocks  # the trainer's activations, freed but still reserved by the caching allocator
    reserved = torch.cuda.memory_reserved(device)
    free_cached, _ = torch.cuda.mem_get_info(device)
    before = other_process_allocates(want)
    t0 = time.perf_counter()
    free_cached_memory()
    free_s = time.perf_counter() - t0
    free_after, _ = torch.cuda.mem_get_info(device)
    after = other_process_allocates(want)
    return {"check": "free_before_resume", "gib_asked": round(want / GIB, 1),
            "gpu_gib": round(total / GIB, 1), "reserved_gib_after_del": round(reserved / GIB, 1),
            "free_gib_cached": round(free_cached / GIB, 1),
            "free_gib_after_free": round(free_after / GIB, 1),
            "other_process_before_free": before, "other_process_after_free": after,
            "free_cached_memory_s": round(free_s, 4),
            "ok": before == "oom" and after == "allocated"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--fraction", type=float, default=0.6,
                    help="share of the GPU's free memory the trainer frees and the server asks for")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"check": "lifecycle", "ok": False, "error": "no CUDA device"}))
        return 1
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # as the trainer makes groups
    rows = []
    for name, run in (("update_group", lambda: check_update_group(device)),
                      ("free_before_resume", lambda: check_free_before_resume(device,
                                                                              args.fraction))):
        try:
            rows.append(run())
        except Exception as exc:  # noqa: BLE001 - a failed check is a row, the next one runs
            rows.append({"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
