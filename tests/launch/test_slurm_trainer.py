"""The REAL trainer (`megapkl.train:run`, the launcher's default entry point) launched on the local
Slurm cluster: tests/launch/data/tiny.yaml (the CPU demo cut small: DP=2 over gloo, a 4x4 batch of
4-token responses) in 2 Slurm tasks of one core each.

Updates take about 0.1 s here, so a job costs about 6-10 s, mostly `import torch` and megatron. The
launcher mechanics (failures, sweeps, cancel, sbatch template, watchdog) are tested more cheaply
with the toy entry point in test_slurm.py.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from megapkl.launch import jobs
from megapkl.launch.submit import read_launch, read_metrics, submit

from .conftest import _TIMINGS, TINY, TRAINER, read_events, wait_done, wait_state

pytestmark = pytest.mark.usefixtures("slurm_cluster")

# Enough updates (about 0.1 s each) that an interrupt sent once 2 rows are logged lands well before
# the last update, in both the uninterrupted reference and the preempted run.
STEPS = 40
# docs/spec.md section 9 metrics every update of the demo's objective (proximal KL) logs.
SPEC_METRICS = {"loss", "grad_norm", "lr", "reward/mean", "train/accuracy", "staleness/mean",
                "staleness/max", "response_len/mean", "tokens_per_s", "coef/mean",
                "coef/abs_max", "is/w_mean", "is/w_max", "is/w_min", "is/log_dev", "kl/prox_k3",
                "pkl/cost_clip_frac", "pkl/credit_mean", "pkl/credit_abs_max"}


def comparable(rows):
    """Rows without their wall-clock fields (which differ between any two runs)."""
    from megapkl.train.metrics_log import wall_clock

    return [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]


@pytest.fixture(scope="module")
def trainer_reference(slurm_cluster, launch_tmp: Path):  # noqa: ARG001 - ordering
    """One uninterrupted 2-task trainer run of STEPS updates: (submission, per-task results)."""
    t0 = time.perf_counter()
    sub = submit(TINY, "local_cpu", [f"run_dir={launch_tmp}/trainer_reference",
                                     f"train.steps={STEPS}"])  # entry: the default, the trainer
    results = wait_done(sub.job, 300, "trainer reference job")
    _TIMINGS.append(("fixture trainer_reference (submit -> 2-task trainer results)",
                     time.perf_counter() - t0, "passed"))
    return sub, results


def test_trainer_two_task_job_over_gloo_returns_metrics(trainer_reference) -> None:
    """2 Slurm tasks, DP=2 over gloo, the real trainer: every task returns the last update's
    metrics; rank 0 logs every update's metrics of docs/spec.md section 9 to
    <run_dir>/metrics.jsonl, the one metrics file of the run, which `megapkl status` reads."""
    sub, results = trainer_reference
    run_dir = sub.run_dir
    assert len(results) == 2
    r0, r1 = results
    assert comparable([r0]) == comparable([r1])  # global (all-reduced) metrics: the ranks agree
    assert SPEC_METRICS <= set(r0)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        missing = SPEC_METRICS - set(r)
        assert not missing, f"step {r['step']}: metrics missing {sorted(missing)}"
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in SPEC_METRICS), r
    assert rows[0]["is/w_max"] == pytest.approx(1.0, abs=2e-4)  # update 0 is on-policy
    last = {k: v for k, v in rows[-1].items() if k != "step"}
    assert comparable([last]) == comparable([r0])  # the returned metrics are the last row's
    assert json.loads((run_dir / "result.json").read_text()) == r0

    # The launcher's run directory layout is the trainer's: one metrics.jsonl, its checkpoints
    # under checkpoint.dir, the resolved config with absolute paths.
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("metrics.jsonl")) == [
        Path("metrics.jsonl")]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step_{STEPS:08d}"]  # checkpoint.every=0, keep=1: the final one
    assert (run_dir / "checkpoints" / ckpts[0] / "complete").exists()
    config = (run_dir / "config.yaml").read_text()
    assert f"run_dir: {run_dir}\n" in config and f"dir: {run_dir}/checkpoints\n" in config
    assert "slurm:\n  profile: local_cpu" in config
    launch = read_launch(run_dir)
    assert launch["entry"] == TRAINER and launch["jobs"][0]["job_id"] == sub.job_id
    events = read_events(run_dir)
    assert [e["event"] for e in events] == ["start", "done"]
    assert (events[0]["world_size"], events[0]["backend"], events[0]["threads"]) == (2, "gloo", 1)
    wait_state(sub.job_id, "COMPLETED")
    text = jobs.status(str(run_dir))
    assert "State=COMPLETED" in text and f"last step: step={STEPS - 1}" in text


def _events(run_dir: Path) -> list[str]:
    return [e["event"] for e in read_events(run_dir)]


def _interrupt_when(sub, run_dir: Path, events: list[str], rows: int, what: str) -> None:
    """`job._interrupt()` (a Slurm preemption) once events.jsonl reads `events` and metrics.jsonl
    has `rows` rows: the running trainer is past its preemption handler's installation.

    The files are polled every 50 ms; the job's Slurm state (an sacct call, which can take seconds
    on a loaded machine) only every 5 s, to catch a trainer that died without a `done` event. A
    slow sacct inside every poll could let a short run finish unseen between two reads."""
    deadline, next_state_check = time.time() + 240, time.time() + 5
    while (seen := _events(run_dir)) != events or len(read_metrics(run_dir)) < rows:
        assert time.time() < deadline, f"{what}: events {seen}, {len(read_metrics(run_dir))} rows"
        assert "done" not in seen, f"{what}: the trainer finished before it could be interrupted"
        if time.time() > next_state_check:
            assert not sub.job.done(), f"{what}: the job ended (events {seen}) before the interrupt"
            next_state_check = time.time() + 5
        time.sleep(0.05)
    sub.job._interrupt()


TWO_NODES = "local_cpu_2nodes"  # mpn1, mpn2: slurmd in two network namespaces


def subprocess_out(argv):
    import subprocess
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def test_trainer_two_preemptions_in_a_row_resume_with_the_same_metrics(
        trainer_reference, launch_tmp: Path) -> None:
    """One task on each of two nodes (separate network namespaces and addresses), DP=2 over gloo
    between them, rendezvous from the Slurm environment (MASTER_ADDR = the allocation's first
    node). submitit's `job._interrupt()` (SIGTERM + USR2, as on a Slurm preemption) mid-run, and
    a second one right after the first resume (the requeued job is updating again): checkpoint,
    requeue, resume twice; the run ends with the metrics of the uninterrupted 2-task job on one
    node (timing fields aside)."""
    ref_sub, ref = trainer_reference
    run_dir = launch_tmp / "trainer_preempted_twice"
    sub = submit(TINY, TWO_NODES, [f"run_dir={run_dir}", f"train.steps={STEPS}",
                                   "logging.tensorboard=true"])
    _interrupt_when(sub, run_dir, ["start"], 2, "first preemption")
    t0 = time.time()
    while _events(run_dir) != ["start", "requeued", "start"]:
        assert time.time() - t0 < 240, f"the requeued job never started: {_events(run_dir)}"
        time.sleep(0.05)
    first = len(read_metrics(run_dir))  # the first checkpoint's step: the rows written until then
    # Two updates past the resume point: the requeued trainer runs (and polls for preemption).
    _interrupt_when(sub, run_dir, ["start", "requeued", "start"], first + 2, "second preemption")
    results = wait_done(sub.job, 300, "twice preempted trainer job")
    assert _events(run_dir) == ["start", "requeued", "start", "requeued", "start", "done"]

    err = (run_dir / "submitit" / f"{sub.job_id}_0_log.err").read_text()
    resumed = [int(s) for s in re.findall(r"\[megapkl\.train\] resumed from the step-(\d+) "
                                          r"checkpoint", err)]
    assert len(resumed) == 2 and 2 <= resumed[0] < resumed[1] < STEPS, (resumed, err[-3000:])
    assert resumed[0] == first and resumed[1] >= first + 2

    assert comparable(results) == comparable(ref)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == STEPS  # none twice
    assert comparable(rows) == comparable(read_metrics(ref_sub.run_dir))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS:08d}"]
    wait_state(sub.job_id, "COMPLETED")
    assert jobs.requeue_count(sub.job_id) == 2
    for start in (e for e in read_events(run_dir) if e["event"] == "start"):  # every attempt
        assert (start["world_size"], start["backend"]) == (2, "gloo")
        assert start["master"].startswith("mpn1:") and start["host"] == "mpn1", start
    nodes = subprocess_out(["sacct", "-n", "-X", "-j", sub.job_id, "-o", "NodeList%40"])
    assert nodes.strip() == "mpn[1-2]", nodes
    # Every exit closed the run: each checkpoint step written once (the two preemptions' and the
    # last), TensorBoard flushed before each requeue (every attempt's file ends at its checkpoint).
    saved = [int(s) for s in re.findall(r"saved checkpoint \S*step_(\d+)", err)]
    assert saved == [resumed[0], resumed[1], STEPS], saved
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ends = []
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"),
                         key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        ends.append(max(e.step for e in acc.Scalars("loss")) + 1)
    assert ends == saved, (ends, saved)
