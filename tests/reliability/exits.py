"""What every exit of a run must leave behind, checked from inside the rank that ran it.

    dist_run(checked_run, world, cfg, marks)   # each forked rank: run(cfg), then the checks
    facts = read_facts(marks)              # in the test: {rank: {...}}

After `megapkl.train.loop.run` returns or raises, the rank records (in `marks/rank<r>.json`):
- `children`: its child processes still alive (the reward worker, launched SGLang servers, W&B's
  service): none may be left;
- `threads`: its megapkl threads still alive (the generation thread, the failure watcher, ...):
  none may be left; `groups`: process groups besides the default one (the harness's) still
  registered (megatron's, a weight-update group): none may be left;
- `lock_free` (rank 0, its holder; None elsewhere, so that two ranks' checks never meet): the
  run directory's lock can be taken (rank 0 released it);
- `tb_steps`: the steps TensorBoard's event files hold (flushed and closed: every logged row);
- `saves`: the checkpoint steps this rank wrote, in order (a step twice is a double save);
- `exit`: the wall time it left `run`, and `error`: what it raised (type: one line), if anything.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional


# torch's helper for CPU tensors shared by file name (the SGLang tensor sync): one per process,
# started by torch on first use and ending with the process, whatever megapkl closes.
TORCH_SHM_MANAGER = "torch_shm_manager"


def live_children(pid: int) -> list[str]:
    """'pid cmdline' of the live (non-zombie) processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        out.append(f"{entry} {cmd.strip()}")
    return out


def tensorboard_steps(run_dir: Path) -> list[int]:
    """The steps of the scalars in the run's TensorBoard event files (what reached the disk)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: set[int] = set()
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            steps |= {e.step for e in acc.Scalars(tag)}
    return sorted(steps)


def count_saves(marks: Path) -> None:
    """Record every checkpoint this rank writes (megapkl.train.checkpointing.save)."""
    import torch.distributed as dist

    from megapkl.train import checkpointing

    real = checkpointing.save

    def save(section, parts, step, layout):
        rank = dist.get_rank()
        with open(marks / f"saves_rank{rank}", "a") as f:
            f.write(f"{step}\n")
        return real(section, parts, step, layout)

    checkpointing.save = save


def checked_run(rank: int, world: int, cfg: Any, marks: Path,  # noqa: ARG001 - run_forked's
                inject: Optional[Callable[[int], None]] = None) -> Any:
    """`megapkl.train.loop.run(cfg)` on this rank, then the checks of the module docstring. What
    run raises is recorded (`error`), not raised: the test harness kills the other ranks as soon
    as one raises, before they could record their own exit."""
    from megapkl.train.loop import run

    marks.mkdir(parents=True, exist_ok=True)
    count_saves(marks)
    if inject is not None:
        inject(rank)
    error: Optional[BaseException] = None
    try:
        return run(cfg)
    except Exception as exc:  # noqa: BLE001 - recorded: the harness would kill the other ranks
        error = exc
        return None
    finally:
        left = time.time()
        run_dir = Path(cfg.run_dir)
        lock_free = _lock_free(run_dir) if rank == 0 else None  # rank 0 held it
        tb = tensorboard_steps(run_dir) if rank == 0 and cfg.logging.tensorboard else None
        saves = marks / f"saves_rank{rank}"
        threads = [t.name for t in threading.enumerate() if t.name.startswith("megapkl")]
        groups = _groups_left()
        facts = {"exit": left, "children": live_children(os.getpid()), "lock_free": lock_free,
                 "threads": threads, "groups": groups,
                 "tb_steps": tb, "error": None if error is None else
                 f"{type(error).__name__}: {' '.join(str(error).split())}",
                 "saves": [int(s) for s in saves.read_text().split()] if saves.exists() else []}
        (marks / f"rank{rank}.json").write_text(json.dumps(facts))


def _lock_free(run_dir: Path) -> bool:
    """Can the run directory's lock be taken? Asked a few times: a check takes the lock for an
    instant itself, and another process's check (a test's) may be that instant."""
    from megapkl.train.runlock import RunLock, RunLockError

    for _ in range(5):
        try:
            RunLock(run_dir).check_free()
            return True
        except RunLockError:
            time.sleep(0.1)
    return False


def _groups_left() -> int:
    """Process groups besides the default one (the harness's) still registered."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    return len(dist.distributed_c10d._world.pg_map) - 1


def read_facts(marks: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(marks.glob("rank*.json"))}


def assert_closed(facts: dict[int, dict], run_dir: Path, rows: int) -> None:
    """Every rank: no child process left, each checkpoint step saved once; rank 0 (its holder)
    released the lock, and its TensorBoard holds every one of the `rows` logged updates."""
    for rank, f in facts.items():
        left = [c for c in f["children"] if Path(c.split()[1]).name != TORCH_SHM_MANAGER]
        assert left == [], f"rank {rank} left processes behind: {left}"
        assert len(f["saves"]) == len(set(f["saves"])), f"rank {rank} saved twice: {f['saves']}"
        assert f["threads"] == [], f"rank {rank} left megapkl threads running: {f['threads']}"
        assert f["groups"] == 0, f"rank {rank} left {f['groups']} process groups besides the default"
    assert facts[0]["lock_free"], "rank 0 (the lock's holder) left the run directory locked"
    tb = facts[0]["tb_steps"]
    if tb is not None:
        assert tb == list(range(rows)), f"TensorBoard holds steps {tb}, metrics.jsonl {rows} rows"
