"""A rank failing outside an agreement while its peer waits in a collective: both ranks stop within
seconds with the same line (megapkl.train.failure_notice), whichever rank failed, the store's host
(rank 0) included, and nothing is left running. The trainer-level cases (a fault inside the training
step) are in tests/reliability/test_fault_sweep.py."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist


def _one_rank_fails(rank, world, failing):  # noqa: ARG001 - run_forked's signature
    from megapkl.train.failure_notice import FailureNotice
    from megapkl.train.run_context import RunContext

    t0 = time.monotonic()
    with RunContext() as context:
        context.watch_failures()
        group = dist.new_group([0, 1])  # a group of its own, as megatron's are
        try:
            if rank == failing:
                time.sleep(0.5)  # the peer is inside its collective by then
                raise ValueError("disk on fire")
            dist.all_reduce(torch.ones(4), group=group)  # never completed: the peer failed
            raise AssertionError("the collective completed")
        except (ValueError, RuntimeError) as exc:
            told = context.told(exc, 7, "/ckpt/step_00000007")
            notice: FailureNotice = context.notice
    left = [t.name for t in threading.enumerate() if t.name.startswith("megapkl")]
    return {"line": str(told), "kind": type(told).__name__, "s": time.monotonic() - t0,
            "watched": notice is not None, "left": left}


@pytest.mark.parametrize("failing", [0, 1], ids=["store-host-fails", "peer-fails"])
def test_a_failure_outside_an_agreement_stops_both_ranks_with_one_line(dist_run, failing):
    out = dist_run(_one_rank_fails, 2, failing, timeout=60)
    lines = {o["line"] for o in out}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert line.startswith(f"rank {failing} failed outside an agreement after 7 finished update")
    assert "ValueError: disk on fire" in line
    assert "the previous checkpoint /ckpt/step_00000007 is intact" in line
    assert all(o["kind"] == "FailedOutsideAgreement" and o["watched"] for o in out)
    assert all(o["s"] < 15 for o in out), [o["s"] for o in out]  # the group's timeout: 60 s
    assert all(not o["left"] for o in out), [o["left"] for o in out]


def _agreed_failure(rank, world):  # noqa: ARG001
    from megapkl.train.agree import RankError, RanksFailed
    from megapkl.train.run_context import RunContext

    with RunContext() as context:
        context.watch_failures()
        exc = RanksFailed("the rollout", [RankError(1, "OSError", "full", False)])
        told = context.told(exc, 3, None)
    return told is exc


def test_a_failure_every_rank_raises_alike_is_not_told(dist_run):
    """An agreed failure goes on as it is (its checkpoint collectives must not be aborted)."""
    assert dist_run(_agreed_failure, 2, timeout=60) == [True, True]


@pytest.mark.parametrize("env,aborts", [(None, True), ("2", True), ("0", True), ("1", False),
                                        ("3", False)])
def test_the_notice_aborts_nccl_only_where_the_watchdog_leaves_the_process(monkeypatch, env,
                                                                           aborts):
    """torch documents its process-group abort for TORCH_NCCL_ASYNC_ERROR_HANDLING=0; under 1
    (TearDown) and 3 (SkipCleanUp, the default) the watchdog rethrows the aborted work's error in
    its own thread and the process dies before its line. megapkl makes its NCCL groups under 2
    (CleanUpOnly) unless the environment names a mode, and the notice aborts only under 0 or 2.
    Before: the profiles set 1 and the notice aborted all the same."""
    from megapkl.parallel.groups import nccl_error_handling, use_nccl_clean_up_only
    from megapkl.train.failure_notice import may_abort

    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    if env is not None:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", env)
    use_nccl_clean_up_only()  # what the NCCL launch does before its first group
    assert nccl_error_handling() == int(env or 2)
    assert may_abort() is aborts


def test_the_cluster_profiles_make_nccl_groups_the_notice_may_abort():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2] / "slurm"
    for name in ("h100", "h200"):
        env = yaml.safe_load((root / "profiles" / f"{name}.yaml").read_text())["env"]
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", name
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=2\n" in (root / "sbatch_template.sh").read_text()
