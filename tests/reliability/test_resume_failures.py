"""A resume that fails on ONE rank of DP=2 stops BOTH ranks within seconds with the same line,
whichever stage of the load failed: every stage is agreed or told, as a save's are.

- The trainer state (`trainer.pt`), read by every rank on its own: an OSError on rank 0 is agreed,
  the same CheckpointError on both ranks. Before: rank 0 raised alone and left, rank 1 broke in
  its next collective and its terminal filled with torch's TCPStore C++ frames.
- The parts' files, loaded by megatron's collectives: a failure on rank 1 inside them cannot
  meet the others at an agreement and is told out of band (megapkl.train.failure_notice). Before:
  its CheckpointError was taken, by its type, for one every rank raised, nobody was told, and
  rank 0 waited in a collective for the process group's startup timeout (30 minutes on NCCL).
"""
from __future__ import annotations

import shutil
import threading

import pytest

from .conftest import tiny_cfg
from .exits import checked_run
from .test_failure_agreement import _assert_prompt_exits, _one_error


def _train(rank, world, cfg):
    from megapkl.train.loop import run

    return run(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, megatron_loaded):
    """Two DP=2 updates, checkpointed after the second."""
    from megapkl.parallel.forked import run_forked

    run = tmp_path_factory.mktemp("resume") / "run"
    run_forked(_train, 2, tiny_cfg(run, "train.steps=2", data=2), timeout=300)
    return run


def _resume(rank, world, cfg, marks, target, failing):
    def inject(r):
        if r == failing:
            from megapkl.train.faults import fail_at

            fail_at(target, error=OSError("Input/output error"), mark=marks / "fault")
    got = checked_run(rank, world, cfg, marks, inject)
    left = [t.name for t in threading.enumerate() if t.name.startswith("megapkl")]
    (marks / f"threads{rank}").write_text(" ".join(left))
    return got


@pytest.mark.parametrize("case,target,failing,expected", [
    ("trainer-state", "megapkl.train.checkpointing:_upgrade", 0,  # inside the read of trainer.pt
     "CheckpointError: checkpoint "),
    ("collective-load", "megapkl.train.learner:Learner.load_files", 1,
     "FailedOutsideAgreement: rank 1 failed outside an agreement after 0 finished update(s): "
     "CheckpointError: checkpoint "),
], ids=["trainer-state", "collective-load"])
def test_a_resume_failing_on_one_rank_stops_both_with_one_line(dist_run, trained, tmp_path, case,
                                                                target, failing, expected):
    run, marks = tmp_path / "run", tmp_path / "marks"
    shutil.copytree(trained, run)
    marks.mkdir()
    cfg = tiny_cfg(run, "train.steps=3", "checkpoint.resume=true", data=2)
    dist_run(_resume, 2, cfg, marks, target, failing, timeout=300)
    facts, error = _one_error(marks)
    assert error.startswith(expected), error
    assert "Input/output error" in error and "\n" not in error, error
    if case == "trainer-state":
        assert error.endswith("trainer.pt: cannot be read (OSError: Input/output error) on rank 0")
    for r in (0, 1):
        assert (marks / f"threads{r}").read_text() == "", "a megapkl thread was left"
    _assert_prompt_exits(facts, marks, f"resume, {case}")


class _Counter:
    """A part with a trainer state of its own (what the checkpoint's trainer.pt holds)."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _resume_where_rank_1_lags(rank, world, root):  # noqa: ARG001
    from types import SimpleNamespace

    from megapkl.train import checkpointing as ckpt

    section = SimpleNamespace(dir=str(root), resume=True, every=1, keep=None)
    for step in (1, 2):
        ckpt.save(section, {"counter": _Counter(step)}, step, {"data": 2})
    if rank == 1:  # this rank's file system does not show step 2 yet (a lagging network mount)
        ckpt.latest = lambda section: ckpt.step_dir(section, 1)
    part = _Counter()
    manager = ckpt.CheckpointManager(section, {"counter": part}, steps=3,
                                     layout=SimpleNamespace(sizes=lambda: {"data": 2}))
    return manager.resume(), part.value


def test_every_rank_resumes_the_checkpoint_rank_0_chose(dist_run, tmp_path):
    """Which checkpoint to resume is a stage of the resume too: rank 0 chooses, every rank loads
    that one. Before: each rank took the newest its own file system showed, and a rank that did
    not see it yet loaded an older one beside its peers' (different weights per rank, or a
    collective load that never matches)."""
    assert dist_run(_resume_where_rank_1_lags, 2, tmp_path / "ckpt", timeout=120) == [(2, 2)] * 2
