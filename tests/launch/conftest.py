"""Fixtures for the launcher tests.

`slurm_cluster` (session): the real local Slurm cluster must be up (started by
`tools/slurm/setup_local_cluster.sh`, stopped by `tools/slurm/stop_local_cluster.sh`). When it is
not reachable the Slurm tests are skipped, except with MEGAPKL_REQUIRE_SLURM=1 (CI), where they
fail with the reason. Tests that need no cluster (profiles, grids, CLI parsing) never use it.

Every Slurm test's wall time (and the shared reference jobs', toy and trainer) is printed at the end
of the session ("launcher test timings").
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

HERE = Path(__file__).resolve().parent
TINY = HERE / "data" / "tiny.yaml"
TOY = "megapkl.launch.toy:run"  # the launcher-mechanics tests' cheap entry point (test_slurm.py)
TRAINER = "megapkl.train:run"  # the real trainer, the launcher's default (test_slurm_trainer.py)
_TIMINGS: list[tuple[str, float, str]] = []


def cluster_problem() -> Optional[str]:
    """None when the local cluster can run jobs, else why not."""
    start = "start it with: sudo bash tools/slurm/setup_local_cluster.sh"
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return f"Slurm is not installed (no sinfo/sbatch on PATH); {start}"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"sinfo timed out (slurmctld not answering); {start}"
    if r.returncode != 0:
        return f"sinfo failed ({' '.join(r.stderr.split())}); {start}"
    states = r.stdout.split()
    if not any(s.rstrip("*~#!%$@^-").startswith(("idle", "mix", "alloc", "complet"))
               for s in states):
        return f"no schedulable node (sinfo states: {states or 'none'}); {start}"
    r = subprocess.run(["sacct", "-n", "-X", "-S", "now-1hours"], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        return (f"sacct failed ({' '.join(r.stderr.split())}): accounting (slurmdbd) is needed, "
                f"submitit polls sacct; {start}")
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = cluster_problem()
    if problem is None:
        return
    if os.environ.get("MEGAPKL_REQUIRE_SLURM") == "1":
        pytest.fail(f"MEGAPKL_REQUIRE_SLURM=1 but the local Slurm cluster is not usable: {problem}",
                    pytrace=False)
    pytest.skip(f"local Slurm cluster not usable: {problem}")


@pytest.fixture(scope="session")
def launch_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directories of the Slurm tests (visible to the jobs: same machine)."""
    return tmp_path_factory.mktemp("launch")


@pytest.fixture(autouse=True, scope="session")
def _job_index(tmp_path_factory: pytest.TempPathFactory):
    """Keep `megapkl logs JOBID`'s index out of the user's home during tests."""
    old = os.environ.get("MEGAPKL_JOB_INDEX")
    os.environ["MEGAPKL_JOB_INDEX"] = str(tmp_path_factory.mktemp("index") / "jobs.jsonl")
    yield
    if old is None:
        os.environ.pop("MEGAPKL_JOB_INDEX", None)
    else:
        os.environ["MEGAPKL_JOB_INDEX"] = old


def read_events(run_dir: Path) -> list[dict]:
    """The launcher's records in <run_dir>/events.jsonl ([] before the first)."""
    path = run_dir / "events.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def master_ports(run_dir: Path) -> list[int]:
    """The rendezvous port each attempt of the job met on (its `start` record's master)."""
    return [int(e["master"].rsplit(":", 1)[1]) for e in read_events(run_dir)
            if e["event"] == "start"]


def wait_done(job, timeout_s: float, what: str = "job"):
    """job.results() with a deadline; on timeout, fail with the state and the log tails."""
    deadline = time.time() + timeout_s
    while not job.done():
        if time.time() > deadline:
            job.cancel(check=False)
            logs = ""
            for p in sorted(Path(job.paths.folder).glob(f"{job.job_id}_*_log.*")):
                logs += f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace")
                                                          .splitlines()[-15:])
            pytest.fail(f"{what} {job.job_id} not done after {timeout_s:.0f}s (state "
                        f"{job.get_info().get('State')}); cancelled.{logs}")
        time.sleep(0.5)
    return job.results()


def wait_state(job_id: str, prefix: str, timeout_s: float = 60) -> str:
    """Poll sacct until the job's state starts with `prefix` (results land before Slurm's end)."""
    from megapkl.launch.jobs import sacct_states
    deadline = time.time() + timeout_s
    while True:
        state = sacct_states([job_id]).get(job_id, {}).get("State", "")
        if state.startswith(prefix):
            return state
        if time.time() > deadline:
            pytest.fail(f"job {job_id}: state {state!r} after {timeout_s:.0f}s, expected {prefix}")
        time.sleep(0.5)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    t0 = time.perf_counter()
    outcome = yield
    dt = time.perf_counter() - t0
    if "slurm_cluster" in getattr(item, "fixturenames", ()):
        _TIMINGS.append((item.nodeid, dt, "failed" if outcome.excinfo else "passed"))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _TIMINGS:
        return
    tr = terminalreporter
    tr.section("launcher test timings (call phase, wall seconds)")
    for nodeid, dt, status in sorted(_TIMINGS, key=lambda t: -t[1]):
        tr.write_line(f"{dt:7.1f}s  {status:6s}  {nodeid}")
