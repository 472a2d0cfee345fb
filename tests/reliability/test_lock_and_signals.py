"""The run-directory lock (a second live run refused, a dead run's lock taken over) and SIGTERM /
SIGINT on a local run (checkpoint at the update boundary, clean exit, resumable)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megapkl.train import checkpointing as ckpt
from megapkl.train.metrics_log import read_metrics
from megapkl.train.runlock import RunLock, RunLockError

from .conftest import DEMO, TINY, tiny_cfg

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MEGAPKL_DEBUG", None)
    return env


def test_second_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    # A lock file left by a process that died (SIGKILL): nobody holds the kernel lock.
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys; from pathlib import Path; "
                               "from megapkl.train.runlock import RunLock; "
                               "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); "
                               "import time; time.sleep(60)", str(run)],
                              stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError, match=rf"in use by a live run \(pid {holder.pid} on "):
            RunLock(run).acquire()
        with pytest.raises(RunLockError):
            RunLock(run).check_free()
        cfg = tiny_cfg(run, "train.steps=1")
        proc = subprocess.run([sys.executable, "-m", "megapkl.cli", "train", DEMO, *TINY,
                               "parallel.data=1", f"run_dir={run}", "train.steps=1"],
                              capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"megapkl: error: run directory {run} is "
                                                       "in use by a live run"), proc.stderr
        assert cfg.run_dir == str(run)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((run / ".lock").read_text())["pid"] == holder.pid  # stale file stays
    lock = RunLock(run).acquire()  # ... and is taken over
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def _wait_rows(run: Path, n: int, proc, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and len(read_metrics(str(run))) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    raise AssertionError("the run did not start")


# One run (CI time): Ctrl-C reaches the parent of the forked ranks, which passes SIGTERM on to
# them, so both the SIGINT and the SIGTERM handlers are exercised.
@pytest.mark.parametrize("sig,world", [(signal.SIGINT, 2)])
def test_stop_signal_checkpoints_and_exits_cleanly(tmp_path, sig, world):
    run = tmp_path / "run"
    args = [*TINY, f"parallel.data={world}", f"run_dir={run}", "train.steps=200",
            "checkpoint.every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "megapkl.cli", "train", DEMO, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=ROOT)
    try:
        _wait_rows(run, 2, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    seen = "SIGTERM" if world > 1 else sig.name  # forked ranks get it from the parent
    assert f"{seen}: stopped after update" in err and "Traceback" not in err
    rows = read_metrics(str(run))
    cfg = tiny_cfg(run, "train.steps=200")
    last = ckpt.latest(cfg.checkpoint)
    assert last is not None and last.name == f"step_{len(rows):08d}"
    ckpt.verify(last)
    assert 2 <= len(rows) < 200
