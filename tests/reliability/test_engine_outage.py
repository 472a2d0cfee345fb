"""No rollout engine can serve (rollout.sglang.no_engine_timeout_s): the run checkpoints its last
finished update on every rank, stops with one error naming the failed engine, and a resume from
that checkpoint logs the uninterrupted run's metrics.

Real processes: DP=2 trainer ranks over gloo (megatron-core learner), each rank's SGLang engine on
its own `megapkl serve` worker. In the failing run rank 1's server is launched by the trainer (its
log in the run directory) and SIGKILLed mid-run, so only one rank's engine fails and the other
must take the same decision (or the collective save would hang).
"""
from __future__ import annotations

import json
import re
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


# In the failing run, rank 1's server is launched by the trainer itself
# (rollout.sglang.server_command): `megapkl serve` under a wrapper that SIGKILLs it once a stop
# file appears, and then exits (never restarted: rollout.sglang.max_restarts=0). The server dies
# with the wrapper, as launched servers die with the trainer (launch._die_with_parent).
DOOMED = """import os, subprocess, sys, time
from megapkl.rollout.sglang.launch import _die_with_parent
host, port, stop = sys.argv[1:4]
serve = subprocess.Popen([sys.executable, "-m", "megapkl.rollout.serve", "--model-config",
                          "tiny-qwen3", "--host", host, "--port", port], preexec_fn=_die_with_parent)
while serve.poll() is None and not os.path.exists(stop):
    time.sleep(0.05)
serve.kill()
"""


def _cfgs(run_dir: Path, urls: list[str], *extra: str, doomed: Path | None = None) -> list:
    """One config per DP rank: rank r's engine talks to the test's worker urls[r]; with `doomed`
    (a stop file), rank 1 launches its own server instead, killed once that file exists."""
    ranks = [[f'rollout.sglang.urls=["{u}"]'] for u in urls]
    if doomed is not None:
        wrapper = run_dir.parent / "doomed_server.py"
        wrapper.write_text(DOOMED)
        command = json.dumps(["{python}", str(wrapper), "{host}", "{port}", str(doomed)])
        ranks[1] = [f"rollout.sglang.server_command={command}", "rollout.sglang.num_engines=1",
                    "rollout.sglang.max_restarts=0", "rollout.sglang.base_port=36700"]
    return [tiny_cfg(run_dir, *SGLANG, *mine, *extra, data=2) for mine in ranks]


def _rank(rank, world, cfgs):  # noqa: ARG001 - run_forked's signature
    from megapkl.train.loop import run

    return run(cfgs[rank])


def _touch_after(stop: Path, run_dir: Path, rows: int) -> threading.Thread:
    """Create `stop` (rank 1's server dies) once the run has logged `rows` updates."""
    def watch() -> None:
        deadline = time.monotonic() + 240
        while _rows(run_dir) < rows and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.touch()
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_engine_outage_on_one_rank_checkpoints_stops_and_resumes_exactly(dist_run, tmp_path):
    from megapkl.cli import describe

    workers = [start_worker(tmp_path / "logs", name=f"worker{i}") for i in range(2)]
    try:
        wait_healthy(workers)
        urls = [w.url for w in workers]
        ref = tmp_path / "reference"
        dist_run(_rank, 2, _cfgs(ref, urls), timeout=300)

        run, stop = tmp_path / "run", tmp_path / "stop"
        watcher = _touch_after(stop, run, rows=2)
        with pytest.raises(WorkerError) as info:
            dist_run(_rank, 2, _cfgs(run, urls, doomed=stop), timeout=300)
        watcher.join(timeout=60)
        line = describe(info.value)  # what `megapkl train` prints after "megapkl: error: "
        assert "\n" not in line and "EnginesStopped" in line, line
        log = run / "sglang" / "replica1" / "logs" / "engine0.log"  # rank 1: replica 1 of 2
        assert re.search(rf"http://127\.0\.0\.1:\d+ \(dead, log {re.escape(str(log))}\)", line), line
        assert urls[0] not in line, line  # rank 0's engine did not fail: not named
        assert "rollout.sglang.no_engine_timeout_s" in line, line
        failed_at = int(re.search(r"update (\d+): the rollout engines failed", line).group(1))
        assert 2 <= failed_at < STEPS and _rows(run) == failed_at, (failed_at, _rows(run))
        saved = run / "checkpoints" / f"step_{failed_at:08d}"
        assert f"checkpoint {saved} holds the {failed_at} finished updates" in line, line
        assert "checkpoint.resume=true" in line
        ckpt.verify(saved)  # complete: every file its manifest lists
        assert [p.name for p in (run / "checkpoints").iterdir()] == [saved.name]

        # Rank 1's engine on a working server again; the run continues from the outage checkpoint.
        dist_run(_rank, 2, _cfgs(run, urls, "checkpoint.resume=true"), timeout=300)
        got, want = read_metrics(run), read_metrics(ref)
        assert [r["step"] for r in got] == list(range(STEPS))
        assert comparable(got) == comparable(want)
    finally:
        for w in workers:
            w.stop()
