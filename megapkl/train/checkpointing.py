"""Trainer checkpoints: exact, crash-safe and reshardable resume (docs/spec.md section 10: 2N
steps == N + resume + N).

`CheckpointManager` is the one place that decides whether a save is due, saves (exactly once per
step), loads, prunes and verifies. The components own their state: each part it is handed writes
its files (`save_files(dir)` / `load_files(dir)`, collective) and/or returns a picklable
`state_dict()` (`load_state_dict(state)`). A checkpoint `<checkpoint.dir>/step_<u>` holds
- `model/`: megatron's distributed checkpoint of model, optimizer, LR schedule and RNG
  (reshardable; the learner's files);
- `snapshots/<key>/model.safetensors`: the proximal/initial reference snapshots in Hugging Face
  names and full shapes (the reference policies' files, loaded before the learner's);
- `policy_versions/`: hard links to the policy versions the rollout schedule still needs
  (megapkl.rollout.version_store), referenced rather than copied (the policy versions' files);
- `trainer.pt`: every part's state_dict in a layout-independent form (the rollout stage's prompt
  iterator and engine version; the loop's update, current batch and NaN counters);
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
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megapkl.config.layout import Layout
from megapkl.errors import MegapklError
from megapkl.train.agree import RankError, RanksFailed, agree, agreed, attempt, every_rank
from megapkl.train.runlock import RunLock
from megapkl.train.timers import Timers

MARKER = "complete"
STATE = "trainer.pt"
FORMAT = 2  # 1: per-rank pickles (trainer_rank<r>.pt), same world size only


class CheckpointError(MegapklError, RuntimeError):
    """A checkpoint cannot be written or read; the message names the directory or file."""


def step_dir(section, step: int) -> Path:
    """`section`: the checkpoint section (its `dir`)."""
    return Path(section.dir) / f"step_{step:08d}"


def partial_dir(section, step: int) -> Path:
    return Path(section.dir) / f".step_{step:08d}.partial"


class CheckpointManager:
    """Save, load, prune, verify and "is a save due" for the parts it is handed (name -> part)."""

    def __init__(self, section: Any, parts: dict[str, Any], *, steps: int, layout: Layout,
                 timers: Optional[Timers] = None) -> None:
        """`section`: the checkpoint section; `steps`: the run's last update (train.steps),
        always saved; `layout`: recorded in every manifest."""
        self.section, self.parts, self.steps = section, parts, steps
        self.sizes = layout.sizes()  # once: no config code runs inside an update
        self.timers = timers or Timers()
        self.saved: Optional[int] = None  # the step this run saved (or resumed from) last

    def due(self, step: int) -> bool:
        """Is a save due after `step` updates (checkpoint.every, and always at the end)?"""
        every = self.section.every
        return (every > 0 and step % every == 0) or step == self.steps

    def save(self, step: int) -> Path:
        """Collective: the step-`step` checkpoint, written atomically unless this run saved (or
        resumed from) it already; returns its directory."""
        if self.saved != step:
            t0 = time.perf_counter()
            with self.timers("checkpoint"):
                path = save(self.section, self.parts, step, self.sizes)
            self.saved = step
            if dist.get_rank() == 0:
                print(f"[megapkl.train] saved checkpoint {path} in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
        return step_dir(self.section, step)

    def save_finished(self, update: int, then: str = "fix the cause and continue"
                      ) -> tuple[Optional[Path], str]:
        """Collective, after a failure during update `update` (before its training step) or in the
        evaluation after update `update - 1`: the checkpoint of the `update` finished updates (the
        parts have put their state back to the start of the failed work); returns its path (None
        when no update had finished) and the sentence for the error, ending with `then`."""
        if update == 0:
            return None, "no update had finished, so there is nothing to checkpoint"
        path = self.save(update)
        return path, (f"checkpoint {path} holds the {update} finished updates; {then} with "
                      "checkpoint.resume=true")

    def resume(self) -> int:
        """Collective: the latest complete checkpoint (checkpoint.resume: true) or the named one,
        loaded into the parts at this layout; returns its step (0 without a checkpoint). Every
        stage is agreed or told (`load`): which checkpoint is rank 0's choice, agreed, and every
        rank checks that one."""
        resume = self.section.resume
        chosen = agreed(lambda: (latest(self.section) if resume is True else Path(resume))
                        if resume else None, what="finding the checkpoint to resume")
        if dist.is_initialized() and dist.get_world_size() > 1:
            shared = [chosen]
            dist.broadcast_object_list(shared, src=0)  # a rank seeing another newest: rank 0's
            chosen = shared[0]
        path = chosen
        if path is None:
            return 0
        agreed(lambda: verify(path), what="checking the checkpoint")
        self.saved = int(load(path, self.parts)["step"])
        return self.saved


# ------------------------------------------------------------------ save


def save(section, parts: dict[str, Any], step: int, layout: dict[str, int]) -> Path:
    """Collective: write the step-`step` checkpoint of `parts` atomically; returns its directory.
    A failure on any rank (a full disk, a quota, an I/O error) is agreed: CheckpointError on every
    rank, and the previous checkpoint is intact. Rank 0's own file operations (the directory, the
    trainer state, the manifest, the rename and the pruning) are agreed like the parts' writes:
    no rank waits in a barrier for a rank that raised."""
    rank = dist.get_rank()
    final, tmp = step_dir(section, step), partial_dir(section, step)

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)

    def commit() -> None:
        if rank == 0:
            _commit(tmp, final)
            _prune(section)
    _saved_or_failed(section, step, tmp, _attempt_save(prepare), None)
    state, error = _write_parts(parts, tmp, step, layout)  # collective
    _saved_or_failed(section, step, tmp, error or _attempt_save(lambda: _write_state(state, tmp)),
                     None)
    _saved_or_failed(section, step, tmp, _attempt_save(commit), final)
    return final


def _attempt_save(work) -> Optional[RankError]:
    try:
        work()
    except _SAVE_ERRORS as exc:
        return RankError.of(exc)
    return None


def _saved_or_failed(section, step: int, tmp: Path, error: Optional[RankError],
                     final: Optional[Path]) -> None:
    """Collective: agree on one stage of a save; CheckpointError on every rank if it failed."""
    try:
        agree(error, what=f"saving the step-{step} checkpoint")
    except RanksFailed as exc:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = latest(section)
        why = "; ".join(dict.fromkeys(_last_line(e.message) for e in exc.errors))
        free = [_free_kb(tmp.parent)]  # rank 0's figure: the same message on every rank
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(free, src=0)
        where = f"committing {final}" if final is not None else f"saving the step-{step} " \
            f"checkpoint under {tmp}"
        ranks = sorted({e.rank for e in exc.errors})
        who = f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
        raise every_rank(CheckpointError(
            f"{where} failed ({why}; {free[0]} kB free there) on {who}; "
            + (f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint")
        )) from None


def _write_parts(parts: dict[str, Any], tmp: Path, step: int, layout: dict[str, int]
                 ) -> tuple[dict[str, Any], Optional[RankError]]:
    """Collective: every part's files and state. Not attempted as a whole: a rank raising between
    its collectives would meet its peers' collectives in the agreement (a failure there is told out
    of band, megapkl.train.failure_notice). Only megatron's own write failure, which its writer
    raises on every rank alike, is returned for the agreement."""
    state: dict[str, Any] = {"step": step, "layout": layout}
    try:
        for part in parts.values():
            if hasattr(part, "save_files"):
                part.save_files(tmp)
        for name, part in parts.items():  # collective for some (the loop gathers its batch)
            if hasattr(part, "state_dict"):
                state[name] = part.state_dict()
    except CheckpointException as exc:
        return state, RankError.of(exc)
    return state, None


def _write_state(state: dict[str, Any], tmp: Path) -> None:
    """Local: this rank's files flushed, then rank 0's trainer state and manifest (every rank's
    data files are megatron's, flushed by their writers); agreed by the caller."""
    rank = dist.get_rank()
    _fsync_mine(tmp, rank)
    if rank == 0:
        torch.save(state, tmp / STATE)
        with open(tmp / STATE, "rb") as fh:
            os.fsync(fh.fileno())
        manifest = {"format": FORMAT, "step": state["step"], "world_size": dist.get_world_size(),
                    "layout": state["layout"], "files": _sizes(tmp)}
        _write_synced(tmp / MARKER, json.dumps(manifest, indent=1))


# torch.distributed.checkpoint reports writer failures as CheckpointException, a BaseException.
_SAVE_ERRORS = (Exception, CheckpointException)


def _last_line(text: str) -> str:
    """The innermost reason: megatron wraps a worker's error (with its traceback) in its own,
    which a rank's one-line report joins with '; '."""
    parts = [p.strip() for p in text.split("; ") if p.strip()]
    return parts[-1] if parts else text


def _free_kb(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free // 1024
    except OSError:
        return -1


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


def _prune(section) -> None:
    """Keep the newest `checkpoint.keep` complete checkpoints; drop leftovers of killed saves."""
    root, keep = Path(section.dir), section.keep
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


def latest(section) -> Path | None:
    """The newest complete checkpoint under the checkpoint section's `dir` (None: none)."""
    done = _complete(Path(section.dir))
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


def preflight(section, run_dir: Path) -> None:
    """Before any rank starts: the named resume checkpoint is complete, the run dir is free."""
    if isinstance(section.resume, str):
        verify(Path(section.resume))
    RunLock(Path(run_dir)).check_free()


# ------------------------------------------------------------------ load


def load(path: Path, parts: dict[str, Any]) -> dict:
    """Collective: the verified checkpoint `path` into `parts` (each part's files, then each
    part's state, in order); returns its trainer state. Every stage is agreed or told, as a
    save's: the parts' files are loaded by collectives (megatron's), where a rank that fails
    cannot meet the others at an agreement: its CheckpointError is told to them out of band
    (megapkl.train.failure_notice); the trainer state is read by every rank and agreed, so a
    read that fails on one rank is the same CheckpointError on every rank; the parts' states
    agree their own collectives (the engines' version) and are told otherwise."""
    for part in parts.values():
        if hasattr(part, "load_files"):
            try:
                part.load_files(path)
            except (OSError, RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointError(f"checkpoint {path}: cannot be loaded ({type(exc).__name__}: "
                                      f"{' '.join(str(exc).split())[:400]})") from None
    state, error = attempt(lambda: _read_state(path))
    try:
        agree(error, what=f"reading {path / STATE}")
    except RanksFailed as exc:
        ranks = sorted({e.rank for e in exc.errors})
        who = f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
        why = "; ".join(dict.fromkeys(e.message if e.kind == "CheckpointError" else
                                      f"checkpoint {path / STATE}: {e.describe()}"
                                      for e in exc.errors))
        raise every_rank(CheckpointError(f"{why} on {who}")) from None
    for name, part in parts.items():
        if hasattr(part, "load_state_dict"):
            part.load_state_dict(state[name])
    return state


def _read_state(path: Path) -> dict:
    """This rank's read of the trainer state (local; agreed by `load`)."""
    try:
        return _upgrade(torch.load(path / STATE, weights_only=False))
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(f"checkpoint {path / STATE}: cannot be read ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())})") from None


def _upgrade(state: dict) -> dict:
    """trainer.pt of earlier format-2 checkpoints: the loop's state at the top level."""
    if "loop" not in state and "minibatches" in state:
        state["loop"] = {"update": state["step"], "minibatches": state.pop("minibatches"),
                         "nan_streak": state.pop("nan_streak"),
                         "nan_skipped": state.pop("nan_skipped")}
    return state


def write_resolved_config(text: str, run_dir: Path) -> None:
    """The resolved config (`dump_config`'s text) that alone reproduces the run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(text)


def truncate_metrics(run_dir: Path, start: int) -> None:
    """Drop metrics rows of updates >= start (written after the checkpoint we resume from)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < start]
    path.write_text("".join(r + "\n" for r in rows))
