"""Trainer checkpoints: exact resume of a run (SPEC 10: 2N steps == N + resume + N).

A checkpoint directory `<checkpoint.dir>/step_<u>` holds megatron's distributed checkpoint of the
model, optimizer, LR schedule and RNG (`model/`, reshardable), one `trainer_rank<r>.pt` per rank
with what the loop needs to continue identically (the prompt iterator, the rollout engine's pool of
policy versions, the proximal/initial snapshots, the current global batch and its reference
log-probs, the NaN counters), and a `complete` marker written last, so a checkpoint cut short by a
preemption is never resumed from.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megapkl.models.checkpoint import load_checkpoint, save_checkpoint

MARKER = "complete"


def step_dir(cfg, step: int) -> Path:
    return Path(cfg.checkpoint.dir) / f"step_{step:08d}"


def save(trainer, step: int) -> Path:
    """Collective: every rank writes its part; rank 0 marks the checkpoint complete."""
    cfg, rank = trainer.cfg, dist.get_rank()
    path = step_dir(cfg, step)
    save_checkpoint(path / "model", trainer.learner.model, trainer.learner.optimizer,
                    trainer.learner.scheduler, step=step)
    state = {"step": step, "rollouts": trainer.rollouts.state_dict(),
             "snapshots": trainer.learner.snapshots.state_dict(), "batch": trainer.batch,
             "nan_streak": trainer.nan_streak,
             "nan_skipped": trainer.nan_skipped}
    tmp = path / f".trainer_rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path / f"trainer_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (path / MARKER).write_text(json.dumps({"step": step, "world_size": dist.get_world_size()}))
        _prune(cfg)
    dist.barrier()
    return path


def _prune(cfg) -> None:
    keep = cfg.checkpoint.keep
    done = sorted(p for p in Path(cfg.checkpoint.dir).glob("step_*") if (p / MARKER).exists())
    for old in done[:-keep] if keep and keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest(cfg) -> Path | None:
    root = Path(cfg.checkpoint.dir)
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists()) if root.exists() else []
    return done[-1] if done else None


def resume(trainer, resume: Any) -> int:
    """Load the latest complete checkpoint (resume: true) or the named one; 0 if none exists."""
    cfg = trainer.cfg
    path = latest(cfg) if resume is True else Path(resume)
    if path is None:
        return 0
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete megapkl checkpoint "
                                f"(no '{MARKER}' marker)")
    meta = json.loads((path / MARKER).read_text())
    if meta["world_size"] != dist.get_world_size():
        raise ValueError(f"checkpoint.resume: {path} was written by {meta['world_size']} ranks, this "
                         f"run has {dist.get_world_size()}; the trainer state (rollout pool, "
                         "current batch) is per rank, so resume with the same world size")
    load_checkpoint(path / "model", trainer.learner.model, trainer.learner.optimizer,
                    trainer.learner.scheduler)
    state = torch.load(path / f"trainer_rank{dist.get_rank()}.pt", weights_only=False)
    trainer.rollouts.load_state_dict(state["rollouts"])
    trainer.learner.snapshots.load_state_dict(state["snapshots"])
    trainer.batch = state["batch"]   # Samples, with their advantages and per-batch logp_prox
    trainer.nan_streak, trainer.nan_skipped = state["nan_streak"], state["nan_skipped"]
    return int(state["step"])


def write_resolved_config(cfg, run_dir: Path) -> None:
    """The resolved config that alone reproduces the run."""
    from megapkl.config.loader import dump_config

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))


def truncate_metrics(run_dir: Path, start: int) -> None:
    """Drop metrics rows of updates >= start (written after the checkpoint we resume from)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < start]
    path.write_text("".join(r + "\n" for r in rows))
