"""Trainer checkpoints: exact, crash-safe and reshardable resume (SPEC 10: 2N steps == N + resume + N).

A checkpoint `<checkpoint.dir>/step_<u>` holds
- `model/`: megatron's distributed checkpoint of model, optimizer, LR schedule and RNG (reshardable);
- `snapshots/<key>/model.safetensors`: the proximal/initial reference snapshots in Hugging Face
  names and full shapes (written by rank 0 from the collective HF export, read back with the HF
  importer at any TP/PP/EP layout);
- `trainer.pt`: everything else the loop needs, in a layout-independent form (trainer_state.py);
- `policy_versions/`: hard links to the policy versions the rollout schedule still needs
  (megapkl.train.version_store), referenced rather than copied;
- `complete`: written last, a JSON manifest (step, layout, every file and its size).

Crash safety: everything is written under `.step_<u>.partial`, fsynced, the manifest added, and the
directory renamed into place (one atomic rename); older checkpoints are pruned only afterwards. A
save killed at any point (SIGKILL, preemption, a full disk) leaves the previous checkpoint intact
and an ignored `.partial` directory that the next save removes. A checkpoint whose files do not
match its manifest is refused, naming the file.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megapkl.train import trainer_state
from megapkl.train.runlock import RunLock, RunLockError  # noqa: F401 - re-exported for callers

MARKER = "complete"
STATE = "trainer.pt"
FORMAT = 2  # 1: per-rank pickles (trainer_rank<r>.pt), same world size only


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the directory or file."""


def step_dir(cfg, step: int) -> Path:
    return Path(cfg.checkpoint.dir) / f"step_{step:08d}"


def partial_dir(cfg, step: int) -> Path:
    return Path(cfg.checkpoint.dir) / f".step_{step:08d}.partial"


# ------------------------------------------------------------------ save


def save(trainer, step: int) -> Path:
    """Collective: write the step-`step` checkpoint atomically; returns its directory."""
    cfg, rank = trainer.cfg, dist.get_rank()
    final, tmp = step_dir(cfg, step), partial_dir(cfg, step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    error: Optional[BaseException] = None
    try:
        _write(trainer, tmp, step)
    except _SAVE_ERRORS as exc:  # a full disk, a quota, an I/O error
        error = exc
    if not _all_ok(error is None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = latest(cfg)
        why = _last_line(error) if error else "another rank failed"
        raise CheckpointError(
            f"saving the step-{step} checkpoint under {tmp} failed ({why}; "
            f"{_free_kb(tmp.parent)} kB free there); "
            + (f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint"))
    if rank == 0:
        _commit(tmp, final)
        _prune(cfg)
    dist.barrier()
    return final


def _save_errors() -> tuple:
    # torch.distributed.checkpoint reports writer failures as CheckpointException, a BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


_SAVE_ERRORS = _save_errors()


def _last_line(exc: BaseException) -> str:
    """The innermost reason: megatron wraps a worker's error (with its traceback) in its own."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _free_kb(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free // 1024
    except OSError:
        return -1


def _write(trainer, tmp: Path, step: int) -> None:
    from megapkl.models.checkpoint import save_checkpoint

    learner, rank = trainer.learner, dist.get_rank()
    save_checkpoint(tmp / "model", learner.model, learner.optimizer, learner.scheduler, step=step,
                    groups=trainer.groups)
    trainer_state.save_snapshots(learner, tmp / "snapshots")
    state = trainer_state.gather(trainer, step, tmp)  # collective; None except on rank 0
    if rank == 0:
        torch.save(state, tmp / STATE)
    _fsync_mine(tmp, rank)
    dist.barrier()
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": dist.get_world_size(),
                    "layout": trainer_state.layout(trainer), "files": _sizes(tmp)}
        _write_synced(tmp / MARKER, json.dumps(manifest, indent=1))


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())


def _fsync_mine(tmp: Path, rank: int) -> None:
    """Flush what this rank wrote (megatron names its data files __<rank>_<n>.distcp); rank 0 also
    flushes the shared files. fsync from the writer matters on network file systems."""
    for path in tmp.rglob("*"):
        if not path.is_file():
            continue
        mine = path.name.startswith(f"__{rank}_")
        shared = not path.name.startswith("__") and rank == 0
        if mine or shared:
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MARKER}


def _commit(tmp: Path, final: Path) -> None:
    """Rename the finished checkpoint into place (replacing one of the same step, e.g. after a
    resume from an older checkpoint) and make the rename durable."""
    old = final.with_name(final.name + ".replaced")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(cfg) -> None:
    """Keep the newest `checkpoint.keep` complete checkpoints; drop leftovers of killed saves."""
    root, keep = Path(cfg.checkpoint.dir), cfg.checkpoint.keep
    done = _complete(root)
    for old in done[:-keep] if keep and keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step_*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


# ------------------------------------------------------------------ find and verify


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).exists())


def latest(cfg) -> Path | None:
    done = _complete(Path(cfg.checkpoint.dir))
    return done[-1] if done else None


def verify(path: Path) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming the file otherwise."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume: {path} does not exist (or is not a directory)")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint.resume: {path} is not a complete megapkl checkpoint "
                              f"(no '{MARKER}' marker: its save did not finish)")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {marker}: unreadable manifest ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format', 1) if isinstance(meta, dict) else '?'} "
                              f"is not this megapkl's checkpoint format {FORMAT}")
    for rel, size in meta["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {f} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is corrupted: {f} has {f.stat().st_size} "
                                  f"bytes, the manifest says {size}")
    return meta


def preflight(cfg) -> None:
    """Before any rank starts: the named resume checkpoint is complete, the run dir is free."""
    resume = cfg.checkpoint.resume
    if isinstance(resume, str):
        verify(Path(resume))
    RunLock(Path(cfg.run_dir)).check_free()


# ------------------------------------------------------------------ resume


def resume(trainer, resume: Any) -> int:
    """Load the latest complete checkpoint (resume: true) or the named one; 0 if none exists.
    Works at another DP/TP/PP layout (trainer_state.py says how the state is re-split)."""
    cfg = trainer.cfg
    path = latest(cfg) if resume is True else Path(resume)
    if path is None:
        return 0
    verify(path)
    try:
        trainer_state.load_snapshots(trainer.learner, path / "snapshots")
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {path / 'snapshots'}: cannot load the reference "
                              f"snapshots: {' '.join(str(exc).split())}") from None
    _load_model(trainer, path / "model")
    try:
        state = torch.load(path / STATE, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(f"checkpoint {path / STATE}: cannot be read ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())})") from None
    trainer_state.apply(trainer, state, path)
    return int(state["step"])


def _load_model(trainer, path: Path) -> None:
    from megapkl.models.checkpoint import load_checkpoint

    learner = trainer.learner
    try:
        load_checkpoint(path, learner.model, learner.optimizer, learner.scheduler,
                        groups=trainer.groups)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path}: megatron cannot load it "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:400]})") from None


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


# ------------------------------------------------------------------ start and end of a run


def begin(trainer) -> int:
    """Collective, at trainer start: lock the run directory (rank 0; a second live run on it is
    refused), stop handlers for a local run, then resume. Returns the first update to run."""
    from megapkl.train import stopping

    msg: list[Optional[str]] = [None]
    if dist.get_rank() == 0:
        try:
            trainer.run_lock = RunLock(Path(trainer.cfg.run_dir)).acquire()
        except RunLockError as exc:
            msg = [str(exc)]
    dist.broadcast_object_list(msg, src=0)
    if msg[0]:
        raise RunLockError(msg[0])
    if trainer.ctx is None:
        stopping.install()
    try:
        return resume(trainer, trainer.cfg.checkpoint.resume) if trainer.cfg.checkpoint.resume else 0
    except BaseException:
        end(trainer)
        raise


def stop_if_requested(trainer, u: int, saved: bool) -> bool:
    """Collective, after update u: on SIGTERM/SIGINT save (unless just saved) and say stop."""
    from megapkl.train import stopping

    if trainer.ctx is not None:
        return False
    sig = stopping.requested()
    if sig is None:
        return False
    path = step_dir(trainer.cfg, u + 1) if saved else save(trainer, u + 1)
    if dist.get_rank() == 0:
        import sys
        print(f"[megapkl.train] {sig}: stopped after update {u} with checkpoint {path}; continue "
              "with checkpoint.resume=true", file=sys.stderr, flush=True)
    return True


def save_for_outage(trainer, update: int) -> str:
    """Collective, when the rollout engines failed during update `update` (before its training
    step), or in the evaluation after update `update - 1`: the checkpoint of the last finished
    update, unless it exists already (checkpoint.every, or the resume point); returns the sentence
    for the error. The rollout stage has put its state back to the start of the batch (or to the
    version rollouts used before the evaluation), so a resume continues exactly."""
    if update == 0:
        return "no update had finished, so there is nothing to checkpoint"
    exists = [(step_dir(trainer.cfg, update) / MARKER).is_file()]
    dist.broadcast_object_list(exists, src=0)  # one decision for every rank
    path = step_dir(trainer.cfg, update) if exists[0] else save(trainer, update)
    return (f"checkpoint {path} holds the {update} finished updates; fix the engines and continue "
            "with checkpoint.resume=true")


def end(trainer) -> None:
    lock = getattr(trainer, "run_lock", None)
    if lock is not None:
        lock.release()
