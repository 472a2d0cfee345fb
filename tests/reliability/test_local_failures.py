"""A failure in a rank-local step between agreements (rank 0's metrics log, its evaluation result
files, its checkpoint rename; the generation thread's work) stops every rank of DP=2 within
seconds with one line naming the rank and the error, the finished updates checkpointed. Before,
rank 0 left run() at once and rank 1 waited in the next collective until the process-group
timeout (here 300 s), with no checkpoint."""
from __future__ import annotations

import threading

import pytest

from megapkl.train import checkpointing as ckpt

from .conftest import tiny_cfg
from .exits import assert_closed, checked_run
from .test_failure_agreement import _assert_prompt_exits, _one_error


def _inject(target, rank, call, error):
    def inject(r, marks):
        if r == rank:
            from megapkl.train.faults import fail_at

            fail_at(target, call=call, error=error, mark=marks / "fault")
    return inject


def _rank(rank, world, cfg, marks, inject):
    got = checked_run(rank, world, cfg, marks, lambda r: inject(r, marks))
    left = [t.name for t in threading.enumerate() if t.name.startswith("megapkl")]
    (marks / f"threads{rank}").write_text(" ".join(left))
    return got


CASES = [  # (id, target, rank, call, extra overrides, expected error, checkpointed step)
    ("metrics-log", "megapkl.train.metrics_log:MetricsLogger.log", 0, 3, [],
     r"RunStopped: update 2: the metrics log failed on rank 0: OSError: disk full", 3),
    ("eval-write", "megapkl.eval.runner:write_results", 0, 1, ["eval.every=2"],
     r"RunStopped: update 1: writing the evaluation's results failed on rank 0: "
     r"OSError: disk full", 2),
]


@pytest.mark.parametrize("case,target,rank,call,extra,message,saved", CASES,
                         ids=[c[0] for c in CASES])
def test_a_local_failure_stops_every_rank_at_once(dist_run, tmp_path, case, target, rank, call,
                                                  extra, message, saved):
    import re

    marks, run = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    cfg = tiny_cfg(run, "train.steps=5", *extra, data=2)
    dist_run(_rank, 2, cfg, marks, _inject(target, rank, call, OSError("disk full")),
             timeout=300)
    facts, error = _one_error(marks)
    assert re.match(message, error), error
    path = run / "checkpoints" / f"step_{saved:08d}"
    assert f"checkpoint {path} holds the {saved} finished updates" in error, error
    ckpt.verify(path)
    assert_closed(facts, run, rows=0)
    for r in (0, 1):
        assert (marks / f"threads{r}").read_text() == "", "a megapkl thread was left"
    _assert_prompt_exits(facts, marks, case)


def test_a_failed_checkpoint_rename_on_rank_0_stops_every_rank_at_once(dist_run, tmp_path):
    """Rank 0's rename of the step-2 checkpoint into place raises: every rank raises the same
    CheckpointError at once (before, rank 1 waited in the save's last barrier)."""
    marks, run = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    cfg = tiny_cfg(run, "train.steps=5", data=2)
    dist_run(_rank, 2, cfg, marks,
             _inject("megapkl.train.checkpointing:_commit", 0, 1, OSError("read-only")),
             timeout=300)
    facts, error = _one_error(marks)
    assert error.startswith("CheckpointError: committing "), error
    assert "step_00000002 failed (read-only; " in error, error
    assert not (run / "checkpoints" / "step_00000002").exists()
    assert_closed(facts, run, rows=0)
    _assert_prompt_exits(facts, marks, "checkpoint-rename")
