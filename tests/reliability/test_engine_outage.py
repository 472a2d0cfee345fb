"""No rollout engine can serve (rollout.sglang.no_engine_timeout_s): the run checkpoints its last
finished update on every rank, stops with one error naming the failed engine, and a resume from
that checkpoint logs the uninterrupted run's metrics.

Real processes: DP=2 trainer ranks over gloo (megatron-core learner), each rank's SGLang engine on
its own `megapkl serve` worker; the test SIGKILLs rank 1's worker mid-run, so only one rank's
engine fails and the other must take the same decision (or the collective save would hang).
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megapkl.parallel.forked import WorkerError
from megapkl.train import checkpointing as ckpt
from megapkl.train.metrics_log import read_metrics

from .conftest import comparable, tiny_cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from sglang_fixtures import start_worker, wait_healthy  # noqa: E402

STEPS = 8
SGLANG = ["rollout.engine=sglang", "rollout.sglang.health_interval_s=0.3",
          "rollout.sglang.health_timeout_s=3", "rollout.sglang.no_engine_timeout_s=2",
          "rollout.sglang.max_retries=1", "rollout.sglang.startup_timeout_s=120",
          "checkpoint.every=0", f"train.steps={STEPS}"]


def _cfgs(run_dir: Path, urls: list[str], *extra: str) -> list:
    """One config per DP rank: rank r's engine talks to urls[r] only."""
    return [tiny_cfg(run_dir, *SGLANG, f'rollout.sglang.urls=["{u}"]', *extra, data=2)
            for u in urls]


def _rank(rank, world, cfgs):  # noqa: ARG001 - run_forked's signature
    from megapkl.train.loop import run

    return run(cfgs[rank])


def _kill_after(worker, run_dir: Path, rows: int) -> threading.Thread:
    """SIGKILL `worker` (its whole process group) once the run has logged `rows` updates."""
    def watch() -> None:
        deadline = time.monotonic() + 240
        while _rows(run_dir) < rows and time.monotonic() < deadline:
            time.sleep(0.05)
        _sigkill(worker)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _sigkill(worker) -> None:
    try:
        os.killpg(worker.popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.popen.wait(timeout=30)


def test_engine_outage_on_one_rank_checkpoints_stops_and_resumes_exactly(train, dist_run, tmp_path):
    from megapkl.cli import describe

    workers = [start_worker(tmp_path / "logs", name=f"worker{i}") for i in range(2)]
    try:
        wait_healthy(workers)
        urls = [w.url for w in workers]
        ref = tmp_path / "reference"
        dist_run(_rank, 2, _cfgs(ref, urls), timeout=300)

        run = tmp_path / "run"
        killer = _kill_after(workers[1], run, rows=2)
        with pytest.raises(WorkerError) as info:
            dist_run(_rank, 2, _cfgs(run, urls), timeout=300)
        killer.join(timeout=60)
        line = describe(info.value)  # what `megapkl train` prints after "megapkl: error: "
        assert "\n" not in line and "EnginesStopped" in line, line
        assert f"{urls[1]} (dead" in line and urls[0] not in line, line  # the failed engine only
        assert "rollout.sglang.no_engine_timeout_s" in line, line
        failed_at = int(re.search(r"update (\d+): the rollout engines failed", line).group(1))
        rows = read_metrics(run)
        assert 2 <= failed_at < STEPS and len(rows) == failed_at, (failed_at, len(rows))
        saved = ckpt.step_dir(_cfgs(run, urls)[0], failed_at)
        assert f"checkpoint {saved} holds the {failed_at} finished updates" in line, line
        assert "checkpoint.resume=true" in line
        ckpt.verify(saved)  # complete: every file its manifest lists
        assert [p.name for p in (run / "checkpoints").iterdir()] == [saved.name]

        # A fresh worker for rank 1; the run continues from the outage checkpoint.
        workers.append(start_worker(tmp_path / "logs", name="worker1b"))
        wait_healthy(workers[2:])
        dist_run(_rank, 2, _cfgs(run, [urls[0], workers[2].url], "checkpoint.resume=true"),
                 timeout=300)
        got, want = read_metrics(run), read_metrics(ref)
        assert [r["step"] for r in got] == list(range(STEPS))
        assert comparable(got) == comparable(want)
    finally:
        for w in workers:
            w.stop()
