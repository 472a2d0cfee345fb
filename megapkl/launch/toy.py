"""A small real entry point for the launcher: data-parallel "steps" of all-reduces, checkpointed.

    megapkl submit configs/demo/cpu_demo.yaml --profile local_cpu --entry megapkl.launch.toy:run

Each rank draws a deterministic local "gradient" from (seed, step, rank), the ranks average it
with an all-reduce (gloo on CPU, NCCL on GPU), and a scalar parameter `x` takes an SGD step. The
state (step, x, history) is checkpointed every `cfg.checkpoint.every` steps and on preemption, so a
requeued job resumes and produces exactly the metrics of an uninterrupted run. It exercises the
whole launch path (Slurm tasks, torch.distributed, run directory, preemption/requeue, sweeps)
in seconds, with knobs the trainer (megapkl.train:run, the default entry) has not; the launcher
tests use it for the mechanics and the trainer for the end-to-end runs.

Keyword arguments (`--entry-arg k=v` / `entry_kwargs`): `steps` (default cfg.train.steps),
`step_seconds` (sleep per step, to leave time to interrupt), `fail_at_step` (raise there),
`lr` (default 0.5), `poll` (default true; false never checks for preemption, like an entry point
that ignores the context: the launcher's watchdog then requeues and it resumes from its last
periodic checkpoint).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

STATE_FILE = "toy_state.json"


def _load(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state), encoding="utf-8")
    os.replace(tmp, path)


def run(cfg: Any, ctx: Any, *, steps: Optional[int] = None, step_seconds: float = 0.0,
        fail_at_step: Optional[int] = None, lr: float = 0.5, poll: bool = True
        ) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    steps = int(steps if steps is not None else cfg.train.steps)
    every = int(cfg.checkpoint.every)
    ckpt = Path(ctx.checkpoint_dir) / STATE_FILE
    state = _load(ckpt) if cfg.checkpoint.resume else None
    state = state or {"step": 0, "x": 1.0, "history": []}
    start = int(state["step"])
    x = torch.tensor(float(state["x"]), dtype=torch.float64)
    history: list[dict[str, Any]] = list(state["history"])
    device = torch.device(ctx.device)

    def save(step: int) -> None:
        if ctx.rank == 0:
            _save(ckpt, {"step": step, "x": float(x), "history": history})
        if ctx.world_size > 1:
            dist.barrier()

    for step in range(start + 1, steps + 1):
        if fail_at_step is not None and step == int(fail_at_step):
            raise RuntimeError(f"toy entry point: deliberate failure at step {step} on rank "
                               f"{ctx.rank}")
        gen = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + step * 101 + ctx.rank)
        local = torch.randn(4, generator=gen, dtype=torch.float64) + x
        grad = local.to(device)
        if ctx.world_size > 1:
            dist.all_reduce(grad)
        grad = grad.cpu() / ctx.world_size
        loss = float((grad ** 2).mean())
        x = x - lr * grad.mean() * 0.1
        row = {"step": step, "loss": loss, "x": float(x), "grad_mean": float(grad.mean()),
               "world_size": ctx.world_size}
        history.append(row)
        ctx.log_metrics(step, row)
        if every and step % every == 0 and step < steps:
            save(step)
        if step_seconds:
            time.sleep(float(step_seconds))
        if poll and step < steps and ctx.preempt_requested():
            save(step)
            ctx.requeue()  # never returns
    save(steps)
    return {"metrics": history, "final_step": steps, "resumed_from": start,
            "restarts": ctx.restart_count, "world_size": ctx.world_size, "backend": ctx.backend,
            "threads": ctx.threads, "rank": ctx.rank}
