"""A Slurm preemption while batches are generated ahead (rollout.async_batches): the real trainer
on the local Slurm cluster, DP=2 in 2 tasks, each replica's rollout server (`megapkl serve`, the
embedded engine behind SGLang's HTTP API) launched by the trainer in a process of its own.

submitit's `job._interrupt()` (SIGTERM + USR2, as on a preemption) lands while the producer has
batches queued or in flight. The trainer checkpoints at the next update boundary (queued batches are
not saved), requeues, and the requeued job (fresh servers) generates those batches again from the
same prompts, versions and seeds: its metrics equal a synchronous job's on the same servers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megapkl.launch import jobs
from megapkl.launch.runtime import rendezvous_port
from megapkl.launch.submit import read_metrics, submit

from .conftest import TINY, master_ports, read_events, wait_done, wait_state
from .test_slurm_trainer import _interrupt_when, comparable

pytestmark = pytest.mark.usefixtures("slurm_cluster")

# 48 updates of about 0.2 s: a window of several seconds between the third row and the end
# of the run for the interrupt to land in (16 updates left about 2.5 s).
STEPS = 48
SERVE = ["{python}", "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3",
         "--host", "{host}", "--port", "{port}", "--log-level", "warning"]
SERVERS = ["rollout.engine=sglang", "rollout.sglang.colocate=false",
           "rollout.sglang.use_router=false", f"rollout.sglang.server_command={json.dumps(SERVE)}",
           "rollout.sglang.startup_timeout_s=240", f"train.steps={STEPS}",
           # controlled staleness: every batch can be generated ahead (from 2 updates earlier)
           "rollout.protocol=controlled_staleness", "rollout.refresh_every=null",
           "rollout.max_staleness=2", "rollout.minibatches_per_batch=2"]


def _run(launch_tmp: Path, name: str, *extra: str):
    run_dir = launch_tmp / name
    return run_dir, submit(TINY, "local_cpu", [f"run_dir={run_dir}", *SERVERS, *extra])


def test_preemption_with_batches_generated_ahead_requeues_and_resumes_the_sync_run(
        launch_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a rendezvous port in the submitting shell (as under torchrun) is not the jobs' to use
    monkeypatch.setenv("MASTER_PORT", "1")
    ref_dir, ref = _run(launch_tmp, "async_reference_sync", "rollout.sglang.base_port=30800")
    ref_results = wait_done(ref.job, 300, "synchronous reference job")

    run_dir, sub = _run(launch_tmp, "async_preempted", "rollout.async_batches=2",
                        "rollout.sglang.base_port=30900")
    _interrupt_when(sub, run_dir, ["start"], 3, "asynchronous job")  # training, generating ahead
    results = wait_done(sub.job, 300, "preempted asynchronous job")
    events = [r["event"] for r in read_events(run_dir)]
    assert events == ["start", "requeued", "start", "done"], events
    # each attempt meets on the port of its job id and restart count, a new one after the requeue
    ports = master_ports(run_dir)
    assert ports == [rendezvous_port(sub.job_id, 0), rendezvous_port(sub.job_id, 1)], ports
    assert ports[0] != ports[1] and all(20000 <= p < 30000 for p in ports), ports

    err = (run_dir / "submitit" / f"{sub.job_id}_0_log.err").read_text()
    found = re.findall(r"\[megapkl\.train\] resumed from the step-(\d+) checkpoint", err)
    assert len(found) == 1 and 3 <= int(found[0]) < STEPS, (found, err[-3000:])

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert comparable(rows) == comparable(read_metrics(ref_dir))  # async + preemption = sync
    assert comparable(results) == comparable(ref_results)
    before = [r for r in rows if r["step"] < int(found[0])]
    assert any("time/generate_from_s" in b and b["time/generate_from_s"] < a["time/train_to_s"]
               for a, b in zip(before, before[1:])), "the first attempt never generated ahead"
    wait_state(sub.job_id, "COMPLETED")
    assert jobs.requeue_count(sub.job_id) == 1
