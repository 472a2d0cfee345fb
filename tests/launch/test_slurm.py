"""The launcher's mechanics against the real local Slurm cluster
(tools/slurm/setup_local_cluster.sh), with the TOY entry point.

Every job here runs megapkl.launch.toy:run (gloo all-reduce "steps" with a checkpointed state, not
the trainer) on the tiny run config (the CPU demo, DP=2) in 2 Slurm tasks: cheap, and with knobs the
trainer has not (step_seconds, fail_at_step, poll=False). A job costs about 5-15 s on 2 cores,
mostly `import torch`. The real trainer (megapkl.train:run, the launcher's default entry) is
launched in test_slurm_trainer.py, whose preemption test (checkpoint, requeue, resume, the same
metrics) stands for the toy's too; here the toy's knobs test what only they reach: a template's
requeue, torchrun across nodes, the watchdog behind an entry point that never polls.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import submitit

from megapkl.launch import jobs
from megapkl.launch.cli import main as cli_main
from megapkl.launch.jobs import sweep_rows
from megapkl.launch.runtime import rendezvous_port
from megapkl.launch.submit import read_launch, read_metrics, submit
from megapkl.launch.sweep import sweep

from .conftest import _TIMINGS, TINY, TOY, master_ports, read_events, wait_done, wait_state

pytestmark = pytest.mark.usefixtures("slurm_cluster")
STEPS = 8


@pytest.fixture(scope="module")
def toy_reference_run(slurm_cluster, launch_tmp: Path):  # noqa: ARG001 - ordering
    """One uninterrupted 2-task toy-entry run of STEPS steps: (submission, per-task results)."""
    t0 = time.perf_counter()
    sub = submit(TINY, "local_cpu", [f"run_dir={launch_tmp}/reference", f"train.steps={STEPS}"],
                 entry=TOY)
    results = wait_done(sub.job, 240, "toy reference job")
    _TIMINGS.append(("fixture toy_reference_run (submit -> 2-task toy results)",
                     time.perf_counter() - t0, "passed"))
    return sub, results


def test_toy_two_task_job_over_gloo_returns_metrics(toy_reference_run) -> None:
    """Toy entry: 2 tasks, gloo, per-task results, the run directory's layout."""
    sub, results = toy_reference_run
    assert len(results) == 2
    r0, r1 = results
    assert (r0["rank"], r1["rank"]) == (0, 1)
    for r in results:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["threads"] == 1
        assert r["resumed_from"] == 0 and r["restarts"] == 0
    assert [m["step"] for m in r0["metrics"]] == list(range(1, STEPS + 1))
    assert r0["metrics"] == r1["metrics"]  # the all-reduce made every rank agree
    # The run directory is laid out predictably.
    run_dir = sub.run_dir
    for name in ("config.yaml", "launch.json", "metrics.jsonl", "events.jsonl", "result.json",
                 "checkpoints/toy_state.json"):
        assert (run_dir / name).exists(), name
    assert read_metrics(run_dir) == r0["metrics"]
    assert json.loads((run_dir / "result.json").read_text())["metrics"] == r0["metrics"]
    launch = read_launch(run_dir)
    assert launch["jobs"][0]["job_id"] == sub.job_id and launch["entry"] == TOY
    assert launch["profile"]["name"] == "local_cpu"
    assert "slurm:\n  profile: local_cpu" in (run_dir / "config.yaml").read_text()
    for task in (0, 1):
        assert (run_dir / "submitit" / f"{sub.job_id}_{task}_log.out").exists()


def test_status_and_logs_helpers(toy_reference_run, capsys: pytest.CaptureFixture[str]) -> None:
    """`megapkl status|logs` on the toy reference run."""
    sub, _ = toy_reference_run
    wait_state(sub.job_id, "COMPLETED")
    text = jobs.status(str(sub.run_dir))
    assert f"JobID={sub.job_id}" in text and "State=COMPLETED" in text
    assert f"last step: step={STEPS}" in text
    assert jobs.status(sub.job_id).startswith(f"JobID={sub.job_id}")  # by id, via the index
    assert "Starting with JobEnvironment" in jobs.logs(sub.job_id, task=1)
    assert cli_main(["logs", str(sub.run_dir), "--err", "-n", "3"]) == 0
    assert cli_main(["status", str(sub.run_dir)]) == 0
    assert "State=COMPLETED" in capsys.readouterr().out


def test_failing_job_surfaces_the_exception(launch_tmp: Path) -> None:
    """The toy entry's fail_at_step: the exception text reaches the submitter."""
    sub = submit(TINY, "local_cpu", [f"run_dir={launch_tmp}/failing"], entry=TOY,
                 entry_kwargs={"fail_at_step": 2})
    deadline = time.time() + 240
    while not sub.job.done() and time.time() < deadline:
        time.sleep(0.5)
    with pytest.raises(submitit.core.utils.FailedJobError) as info:
        sub.job.results()
    msg = str(info.value)
    assert "RuntimeError: toy entry point: deliberate failure at step 2 on rank" in msg
    events = (sub.run_dir / "events.jsonl").read_text()
    assert '"event": "failed"' in events and "deliberate failure" in events


def test_two_element_sweep_array_completes(launch_tmp: Path) -> None:
    """A 2-element job array of the toy entry (seed=1,2) with a parallelism limit."""
    out = sweep(TINY, "local_cpu", ["seed=1,2"], [f"run_dir={launch_tmp}/sweep", "train.steps=3"],
                entry=TOY, parallelism=2)
    assert len(out.elements) == 2 and out.array_job_id
    assert [str(e.job.job_id) for e in out.elements] == [f"{out.array_job_id}_0",
                                                         f"{out.array_job_id}_1"]
    finals = []
    for el in out.elements:
        res = wait_done(el.job, 240, f"sweep element {el.label}")
        assert res[0]["world_size"] == 2 and len(res[0]["metrics"]) == 3
        finals.append(res[0]["metrics"][-1]["loss"])
    assert finals[0] != finals[1]  # different seeds, different runs
    for el in out.elements:
        wait_state(str(el.job.job_id), "COMPLETED")
    rows = sweep_rows(out.sweep_dir)
    assert [r["label"] for r in rows] == ["seed-1", "seed-2"]
    assert all(r["state"] == "COMPLETED" and r["step"] == 3 for r in rows)
    text = jobs.status(str(out.sweep_dir))
    assert "seed-1" in text and "COMPLETED" in text
    assert "%2" in (out.sweep_dir / "submitit").joinpath(
        f"{out.array_job_id}_submission.sh").read_text()


def test_cancel(launch_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`megapkl submit` (toy entry, 30 s steps) then `megapkl cancel`."""
    run_dir = launch_tmp / "cancelled"
    rc = cli_main(["submit", str(TINY), f"run_dir={run_dir}", "--profile", "local_cpu",
                   "--entry", TOY, "--entry-arg", "step_seconds=30"])
    assert rc == 0 and "submitted job" in capsys.readouterr().out
    assert cli_main(["cancel", str(run_dir)]) == 0
    wait_state(read_launch(run_dir)["jobs"][0]["job_id"], "CANCELLED")


def test_plain_sbatch_template_runs_and_requeues(toy_reference_run, launch_tmp: Path) -> None:
    """slurm/sbatch_template.sh (srun, no submitit; ENTRY = the toy) on the CPU cluster: the GPU
    lines removed, the rest overridden on the sbatch command line; USR2 (what Slurm sends before a
    time limit) -> checkpoint -> requeue -> resume with the uninterrupted run's metrics."""
    _, ref = toy_reference_run
    run_dir = launch_tmp / "sbatch_run"
    requests = launch_tmp / "requeue_requests"
    job_id = _sbatch_template(launch_tmp, {"REQUEUE_DIR": str(requests)},
                              ["--partition=cpu", "--ntasks-per-node=2"], run_dir)
    _interrupt_template_job(job_id, run_dir, launch_tmp)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["restarts"] == 1 and 2 <= result["resumed_from"] < STEPS
    assert result["metrics"] == ref[0]["metrics"]
    assert jobs.requeue_count(job_id) == 1
    text = (launch_tmp / f"sbatch-{job_id}.out").read_text()
    assert "requeueing job" in text  # rank 0's request, and the batch script acting on it:
    assert f"[megapkl] requeueing job {job_id} from the batch script" in text, text[-3000:]
    assert requests.is_dir() and not any(requests.iterdir())  # the request was taken
    assert master_ports(run_dir) == [rendezvous_port(job_id, 0), rendezvous_port(job_id, 1)]


def test_sbatch_template_torchrun_on_two_nodes_requeues_and_resumes(toy_reference_run,
                                                                     launch_tmp: Path) -> None:
    """The template's LAUNCHER=torchrun path on the two-node partition: one srun task per node
    starts torchrun, which starts the workers and meets the other node at the first node's
    address. The preemption signal reaches the workers (torchrun itself ignores it), so the job
    checkpoints, requeues from the batch script and resumes with the uninterrupted run's
    metrics; each attempt's torchrun rendezvous is at the port every task computes
    (rendezvous_port; the workers' own MASTER_PORT is one torchrun picks)."""
    _, ref = toy_reference_run
    run_dir = launch_tmp / "torchrun_run"
    job_id = _sbatch_template(launch_tmp, {"LAUNCHER": "torchrun"},
                              ["--partition=cpu2", "--nodes=2", "--ntasks-per-node=1"], run_dir)
    _interrupt_template_job(job_id, run_dir, launch_tmp)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["restarts"] == 1
    assert 2 <= result["resumed_from"] < STEPS
    assert result["metrics"] == ref[0]["metrics"]
    starts = [e for e in read_events(run_dir) if e["event"] == "start"]
    assert {e["host"] for e in starts} == {"mpn1"}, starts  # rank 0 on the first node
    log = (launch_tmp / f"sbatch-{job_id}.out").read_text()
    endpoints = re.findall(r"torchrun: 1 workers per node, rendezvous at (\S+)", log)
    assert endpoints == [f"mpn1:{rendezvous_port(job_id, r)}" for r in (0, 1)], log[-3000:]
    # torchrun outlived the signal: had it died of it, the task would have ended with its workers
    # still checkpointing (here, under proctrack/linuxproc, they outlive it; under cgroup not)
    assert "srun: error" not in log and "User defined signal" not in log, log[-3000:]


def _sbatch_template(launch_tmp: Path, env_extra: dict, sbatch_args: list, run_dir: Path) -> str:
    """Submit slurm/sbatch_template.sh with its GPU lines removed (the rest overridden on the
    sbatch command line), the toy entry and a rendezvous port in the submitting shell that the
    job must not use; the job id."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "slurm" / "sbatch_template.sh").read_text()
    keep = [ln for ln in text.splitlines()
            if not ln.startswith(("#SBATCH --gpus", "#SBATCH --exclusive", "#SBATCH --mem"))]
    script = launch_tmp / "sbatch_cpu.sh"
    script.write_text("\n".join(keep) + "\n")
    env = {**os.environ, "CONFIG": str(TINY), "ENTRY": TOY, "PYTHON": sys.executable,
           "PREEMPT_GRACE_S": "20", "MASTER_PORT": "1", **env_extra}
    out = subprocess.run(
        ["sbatch", "--parsable", *sbatch_args, "--cpus-per-task=1", "--mem=2G", "--time=10",
         f"--chdir={repo}", f"--output={launch_tmp}/sbatch-%j.out", "--export=ALL", str(script),
         f"run_dir={run_dir}", f"train.steps={STEPS}", "--entry-arg", "step_seconds=1.5"],
        env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def _interrupt_template_job(job_id: str, run_dir: Path, launch_tmp: Path) -> None:
    """At step 2, USR2 to the job's steps (what --signal=USR2@300 sends before a time limit);
    then wait for the requeued job to complete."""
    import subprocess

    deadline = time.time() + 240
    log = launch_tmp / f"sbatch-{job_id}.out"
    while len(read_metrics(run_dir)) < 2:
        state = jobs.sacct_states([job_id]).get(job_id, {}).get("State", "")
        tail = log.read_text()[-3000:] if log.exists() else ""
        assert state in ("", "PENDING", "RUNNING"), f"sbatch job {job_id} ended: {state}\n{tail}"
        assert time.time() < deadline, f"sbatch job {job_id} never reached step 2\n{tail}"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    try:
        wait_state(job_id, "COMPLETED", 240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text()[-3000:] if log.exists() else ''}") from None


def test_watchdog_requeues_an_entry_point_that_never_polls(toy_reference_run,
                                                           launch_tmp: Path) -> None:
    """The toy entry with poll=False, an entry point that ignores ctx.preempt_requested():
    preempt_grace_s after the signal the launcher requeues the job anyway; it resumes from the
    last periodic checkpoint (every 2 steps) and still ends with the uninterrupted run's
    metrics."""
    _, ref = toy_reference_run
    profile = str(Path(__file__).parent / "data" / "local_cpu_fast_watchdog.yaml")
    run_dir = launch_tmp / "watchdog"
    sub = submit(TINY, profile, [f"run_dir={run_dir}", f"train.steps={STEPS}",
                                 "checkpoint.every=2"],
                 entry=TOY, entry_kwargs={"step_seconds": 1.0, "poll": False})
    deadline = time.time() + 240
    while len(read_metrics(run_dir)) < 2:
        assert time.time() < deadline and not sub.job.done(), "the job never reached step 2"
        time.sleep(0.2)
    sub.job._interrupt()
    results = wait_done(sub.job, 300, "watchdog job")
    r0 = results[0]
    assert r0["restarts"] == 1 and r0["resumed_from"] in (2, 4, 6)
    assert r0["metrics"] == ref[0]["metrics"]
    assert read_metrics(run_dir) == ref[0]["metrics"]
    assert "did not reach a step boundary" in (run_dir / "submitit" /
                                               f"{sub.job_id}_0_log.err").read_text()
