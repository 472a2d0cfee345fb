"""GPU check: the failure notice's NCCL abort, on two processes.

Rank 1 raises outside any agreement (as a rank failing inside the training step does) while rank
0 waits in an NCCL all-reduce on a group of its own, whose timeout is long (`--group-timeout`,
60 s). megapkl's failure notice (megapkl/train/failure_notice.py) publishes rank 1's record; rank
0's watcher reads it and aborts rank 0's NCCL communicators, so rank 0's collective fails within
seconds and both ranks print the same line. The processes make their NCCL groups the way the
trainer does (megapkl.parallel.groups: TORCH_NCCL_ASYNC_ERROR_HANDLING=2, CleanUpOnly, unless the
environment names a mode), under which the watchdog does not end a process whose communicators
were aborted. Checked, as one JSON line:
- both ranks left with the same line, naming rank 1 and its error;
- rank 0 left within `--within` seconds of the fault (well inside the group's timeout: the abort,
  not the timeout, released it) and its collective raised;
- both processes exited with status 0 (neither was torn down by NCCL's watchdog).

On one GPU, NCCL refuses two ranks of a communicator on one device ("Duplicate GPU detected"): the
two processes are then given different NCCL_HOSTIDs, so that NCCL takes them for two hosts and
connects them over its socket transport on loopback (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE,
NCCL_IB_DISABLE). With two GPUs each rank has its own. `--device cpu` runs the same over gloo
(which has no abort: rank 0's collective fails when rank 1's process ends).

    python tools/gpu_checks/notice_gpu.py                 # one GPU or two
    python tools/gpu_checks/notice_gpu.py --device cpu    # the same code path on gloo
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAULT = "ValueError: disk on fire"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--group-timeout", type=float, default=60.0)
    ap.add_argument("--within", type=float, default=15.0)
    return ap.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int, device: str, gpus: int) -> dict:
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank if gpus > 1 else 0),
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if device == "cuda" and gpus < 2:  # two "hosts" on one GPU (module docstring)
        env.update(NCCL_HOSTID=f"megapkl-notice-check-{rank}", NCCL_P2P_DISABLE="1",
                   NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
    return env


def one_rank(rank: int, device: str, group_timeout: float, out: str) -> None:
    """One process: the trainer's process group and failure notice; rank 1 fails."""
    import datetime

    import torch
    import torch.distributed as dist

    from megapkl.parallel.groups import _init_process_group, nccl_error_handling
    from megapkl.train.run_context import RunContext

    backend = "nccl" if device == "cuda" else "gloo"
    _init_process_group(backend, "env://", None, None, 5)
    record = {"rank": rank, "backend": backend, "error_handling": nccl_error_handling()}
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    with RunContext() as context:
        context.watch_failures()
        record["abort"] = bool(context.notice and context.notice.abort)
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=group_timeout))
        t = torch.ones(4, device=dev)
        dist.all_reduce(t, group=group)  # the communicator is up on both ranks
        if backend == "nccl":
            torch.cuda.synchronize()
        try:
            if rank == 1:
                time.sleep(1.0)  # rank 0 is inside its collective by then
                record["fault_at"] = time.time()
                raise ValueError("disk on fire")
            for _ in range(1000):  # the collective rank 1 never joins, then the aborted group's
                dist.all_reduce(t, group=group)
                t.cpu()
            raise AssertionError("the collectives completed without rank 1")
        except (ValueError, RuntimeError) as exc:
            record["raised"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            told = context.told(exc, 3, "/ckpt/step_00000003")
            record.update(line=str(told), left_at=time.time())
    Path(out).write_text(json.dumps(record))
    if dist.is_initialized():  # what the trainer's exit does (release_groups, the launcher)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - an aborted world has little left to destroy
            record["destroy"] = f"{type(exc).__name__}: {exc}"
            Path(out).write_text(json.dumps(record))


def main(argv=None) -> int:
    import subprocess

    args = parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        print(json.dumps({"check": "notice_abort", "ok": False, "error": "no CUDA device"}))
        return 1
    port, work = free_port(), Path(os.environ.get("TMPDIR", "/tmp"))
    outs = [work / f"megapkl_notice_rank{r}_{os.getpid()}.json" for r in (0, 1)]
    procs = []
    for r in (0, 1):
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import notice_gpu; notice_gpu.one_rank({r}, {args.device!r}, "
                f"{args.group_timeout}, {str(outs[r])!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code],
                                      env={**os.environ, **rank_env(r, port, args.device, gpus)}))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=args.group_timeout + 120))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    ranks = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    lines = {r.get("line") for r in ranks}
    fault = ranks[1].get("fault_at")
    took = [round(r["left_at"] - fault, 2) if fault and "left_at" in r else None for r in ranks]
    checks = {
        "same_line_on_both_ranks": len(lines) == 1 and None not in lines
        and next(iter(lines)).startswith("rank 1 failed outside an agreement") and FAULT in
        next(iter(lines)),
        "rank0_left_within": took[0] is not None and took[0] < args.within,
        "rank0_collective_raised": "raised" in ranks[0],
        "exit_status_0": codes == [0, 0],
    }
    if args.device == "cuda":
        checks["aborted_under_clean_up_only"] = ranks[0].get("abort") is True \
            and ranks[0].get("error_handling") == 2
    res = {"check": "notice_abort", "ok": all(checks.values()), "checks": checks,
           "device": args.device, "gpus": gpus, "mode": "two-gpus" if gpus > 1 else
           ("one-gpu-two-nccl-hosts" if gpus == 1 else "gloo"), "left_after_fault_s": took,
           "exit_codes": codes, "ranks": ranks}
    for o in outs:
        o.unlink(missing_ok=True)
    print(json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
