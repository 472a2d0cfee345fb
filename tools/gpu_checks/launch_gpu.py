"""GPU check: `megapkl train` launched the way a cluster launches it, stopped by a signal, resumed.

1. `torchrun --standalone --nproc-per-node=1 -m megapkl.cli train ...` (torchrun's environment:
   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*; NCCL on cuda:0) on the tiny Qwen3 in bf16, started in
   its own process group;
2. once two updates are logged, SIGTERM to the whole group, as Slurm's scancel or a preemption
   delivers it: the trainer finishes its update, agrees on the stop across ranks (the stop-signal
   path), saves a checkpoint and exits;
3. the same command with `checkpoint.resume=true` runs to the end.
Checks: a checkpoint exists at the update the run stopped after, the resumed run ends with one
metrics.jsonl row per update, each loss finite. Prints one JSON line; exit status 1 on failure.

    python tools/gpu_checks/launch_gpu.py               # GPU (NCCL)
    python tools/gpu_checks/launch_gpu.py --device cpu  # the same launch on CPU (gloo)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command(run_dir: Path, steps: int, device: str, resume: bool) -> list[str]:
    overrides = ["model.name=tiny-qwen3", f"model.dtype={'bf16' if device == 'cuda' else 'fp32'}",
                 "parallel.data=1", "parallel.micro_batch_size=8", "rollout.prompts_per_batch=4",
                 "rollout.responses_per_prompt=8", f"train.steps={steps}", f"run_dir={run_dir}",
                 "checkpoint.every=0", "logging.progress_bar=false", "logging.tensorboard=false",
                 f"checkpoint.resume={'true' if resume else 'false'}"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            "--nproc-per-node=1", "-m", "megapkl.cli", "train",
            str(ROOT / "configs" / "demo" / "cpu_demo.yaml"), *overrides]


def metrics(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            rows[int(row["step"])] = row
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="megapkl_launch_check_")) / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    res: dict = {"check": "launch", "device": args.device, "checks": {}}
    t0 = time.perf_counter()
    log = open(run_dir.parent / "first.log", "wb")
    first = subprocess.Popen(command(run_dir, args.steps, args.device, False), env=env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while len(metrics(run_dir)) < 2 and first.poll() is None:
        if time.perf_counter() - t0 > args.timeout:
            break
        time.sleep(0.2)
    try:
        os.killpg(first.pid, signal.SIGTERM)  # the whole step, as Slurm signals it
    except ProcessLookupError:  # it ended on its own (a failure): its log tail is the detail
        pass
    try:
        first.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    stopped = sorted(metrics(run_dir))
    text = (run_dir.parent / "first.log").read_text(errors="replace")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    last = stopped[-1] + 1 if stopped else None
    res["checks"]["sigterm_checkpoints_and_stops"] = {
        "ok": bool(stopped) and "SIGTERM: stopped after update" in text
        and last in {int(c.split("_")[1]) for c in ckpts} and last < args.steps,
        "detail": {"logged": stopped, "checkpoints": ckpts, "exit": first.returncode,
                   "said": [ln for ln in text.splitlines() if "stopped after update" in ln]
                   or text.splitlines()[-6:]}}
    second = subprocess.run(command(run_dir, args.steps, args.device, True), env=env,
                            capture_output=True, text=True, timeout=args.timeout)
    rows = metrics(run_dir)
    losses = [rows[k].get("loss") for k in sorted(rows)]
    res["checks"]["resume_runs_to_the_end"] = {
        "ok": second.returncode == 0 and sorted(rows) == list(range(args.steps))
        and all(isinstance(x, float) and math.isfinite(x) for x in losses),
        "detail": {"exit": second.returncode, "steps": sorted(rows),
                   "stderr_tail": [] if second.returncode == 0
                   else second.stderr.splitlines()[-6:]}}
    res["total_s"] = round(time.perf_counter() - t0, 1)
    res["ok"] = all(c["ok"] for c in res["checks"].values())
    print(json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
