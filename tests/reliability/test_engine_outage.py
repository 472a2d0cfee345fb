"""No rollout engine can serve (rollout.sglang.no_engine_timeout_s), while generating a batch or
while evaluating (eval.every): the run checkpoints its last finished update on every rank, stops
with one error naming the failed engine, and a resume from that checkpoint logs the uninterrupted
run's metrics.

Real processes: DP=2 trainer ranks over gloo (megatron-core learner), each rank's SGLang engine on
its own `megapkl serve` worker. In the failing run rank 1's server is launched by the trainer (its
log in the run directory) and SIGKILLed mid-run, so only one rank's engine fails and the other
must take the same decision (or the collective save would hang).
"""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from megapkl.parallel.forked import WorkerError
from megapkl.train import checkpointing as ckpt
from megapkl.train.metrics_log import read_metrics

from .conftest import comparable, tiny_cfg, two_serve_workers

STEPS = 8
# A killed server is known dead at once (its process is gone), so the timeouts are generous: a
# busy machine's slow health check must not look like an outage.
SGLANG = ["rollout.engine=sglang", "rollout.sglang.health_interval_s=0.3",
          "rollout.sglang.health_timeout_s=20", "rollout.sglang.no_engine_timeout_s=5",
          "rollout.sglang.max_retries=1", "rollout.sglang.startup_timeout_s=120",
          "checkpoint.every=0", f"train.steps={STEPS}"]


# In the failing run, rank 1's server is launched by the trainer itself
# (rollout.sglang.server_command): `megapkl serve` under a wrapper that SIGKILLs it once a stop
# file appears, and then exits (never restarted: rollout.sglang.max_restarts=0). The server dies
# with the wrapper, as launched servers die with the trainer (launch._die_with_parent).
DOOMED = """import os, subprocess, sys, time
from megapkl.rollout.sglang.launch import _die_with_parent
host, port, stop = sys.argv[1:4]
serve = subprocess.Popen([sys.executable, "-m", "megapkl.serve.serve", "--model-config",
                          "tiny-qwen3", "--host", host, "--port", port], preexec_fn=_die_with_parent)
while serve.poll() is None and not os.path.exists(stop):
    time.sleep(0.05)
serve.kill()
serve.wait()
open(stop + ".dead", "w").close()
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
                    "rollout.sglang.max_restarts=0", "rollout.sglang.base_port=30100"]
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


# Generation ahead of training (rollout.async_batches): the engine dies while the next batches are
# being generated; the failed batch takes the same outage path, and the resumed run equals the
# synchronous reference.
ASYNC = ["rollout.sglang.colocate=false", "rollout.async_batches=2"]


@pytest.mark.parametrize("ahead", [[], ASYNC], ids=["sync", "async"])
def test_engine_outage_on_one_rank_checkpoints_stops_and_resumes_exactly(ahead, dist_run,
                                                                          tmp_path):
    from megapkl.cli import describe

    with two_serve_workers(tmp_path) as workers:
        urls = [w.url for w in workers]
        ref = tmp_path / "reference"
        dist_run(_rank, 2, _cfgs(ref, urls), timeout=300)

        run, stop = tmp_path / "run", tmp_path / "stop"
        watcher = _touch_after(stop, run, rows=2)
        with pytest.raises(WorkerError) as info:
            dist_run(_rank, 2, _cfgs(run, urls, *ahead, doomed=stop), timeout=300)
        watcher.join(timeout=60)
        line = describe(info.value)  # what `megapkl train` prints after "megapkl: error: "
        assert "\n" not in line and "EnginesStopped" in line, line
        log = run / "sglang" / "replica1" / "logs" / "engine0.log"  # rank 1: replica 1 of 2
        assert re.search(rf"http://127\.0\.0\.1:\d+ \(dead, log {re.escape(str(log))}\)", line), line
        assert urls[0] not in line, line  # rank 0's engine did not fail: not named
        assert "rollout.sglang.no_engine_timeout_s" in line, line
        failed_at = int(re.search(r"update (\d+): the rollout's engines failed", line).group(1))
        assert 2 <= failed_at < STEPS and _rows(run) == failed_at, (failed_at, _rows(run))
        saved = run / "checkpoints" / f"step_{failed_at:08d}"
        assert f"checkpoint {saved} holds the {failed_at} finished updates" in line, line
        assert "checkpoint.resume=true" in line
        ckpt.verify(saved)  # complete: every file its manifest lists
        assert [p.name for p in (run / "checkpoints").iterdir()] == [saved.name]

        # Rank 1's engine on a working server again; the run continues from the outage checkpoint.
        dist_run(_rank, 2, _cfgs(run, urls, *ahead, "checkpoint.resume=true"), timeout=300)
        got, want = read_metrics(run), read_metrics(ref)
        assert [r["step"] for r in got] == list(range(STEPS))
        assert comparable(got) == comparable(want)


EVAL = ["eval.every=2", "eval.benchmarks=[{name: next_mod10, greedy: true}]"]


def _rank_dies_before_eval(rank, world, cfgs, stop):  # noqa: ARG001
    """Rank 1 kills its own server (the stop file) right before the evaluation after update 1 and
    waits until it is gone, so the engine fails inside that evaluation, on rank 1 only."""
    if rank == 1:
        from megapkl.train.evaluation import Evaluator

        original = Evaluator.run

        def run(self, version):
            if version == 2:
                stop.touch()
                deadline = time.monotonic() + 60
                while not Path(str(stop) + ".dead").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            return original(self, version)

        Evaluator.run = run
    return _rank(rank, world, cfgs)


def _without_eval(rows):
    return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in comparable(rows)]


def test_engine_outage_during_evaluation_checkpoints_the_finished_update(dist_run, tmp_path):
    """Before: rank 0 waited in the evaluation's gather for a rank whose engine had failed."""
    from megapkl.cli import describe

    with two_serve_workers(tmp_path) as workers:
        urls = [w.url for w in workers]
        ref = tmp_path / "reference"
        dist_run(_rank, 2, _cfgs(ref, urls, *EVAL), timeout=300)

        run, stop = tmp_path / "run", tmp_path / "stop"
        with pytest.raises(WorkerError) as info:
            dist_run(_rank_dies_before_eval, 2, _cfgs(run, urls, *EVAL, doomed=stop), stop,
                     timeout=300)
        line = describe(info.value)
        assert "\n" not in line and "EnginesStopped" in line, line
        assert "update 1: the evaluation's engines failed" in line, line
        log = run / "sglang" / "replica1" / "logs" / "engine0.log"
        assert re.search(rf"http://127\.0\.0\.1:\d+ \(dead, log {re.escape(str(log))}\)", line), line
        assert urls[0] not in line, line
        saved = run / "checkpoints" / "step_00000002"
        assert f"checkpoint {saved} holds the 2 finished updates" in line, line
        ckpt.verify(saved)
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == [0, 1]  # update 1 finished: its row, without eval/*
        assert not [k for k in rows[1] if k.startswith("eval/")]

        dist_run(_rank, 2, _cfgs(run, urls, *EVAL, "checkpoint.resume=true"), timeout=300)
        got, want = read_metrics(run), read_metrics(ref)
        assert [r["step"] for r in got] == list(range(STEPS))
        assert _without_eval(got) == _without_eval(want)
        evals = [r["step"] for r in want if any(k.startswith("eval/") for k in r)]
        assert evals == [1, 3, 5, 7]
        assert [r for r in comparable(got) if r["step"] != 1] == \
            [r for r in comparable(want) if r["step"] != 1]  # the later evaluations agree too


def _rank_stopped_with_its_server(rank, world, cfgs, stop):  # noqa: ARG001
    """Rank 1, at its second batch: its server is killed and the rank gets SIGTERM, as a stop
    signal or a Slurm preemption reaches the servers the trainer launched too."""
    if rank == 1:
        import os
        import signal

        from megapkl.rollout.sglang.client import SGLangEngine

        original, calls = SGLangEngine.generate, []

        def generate(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                stop.touch()
                deadline = time.monotonic() + 60
                while not Path(str(stop) + ".dead").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGTERM)
            return original(self, *args, **kwargs)

        SGLangEngine.generate = generate
    return _rank(rank, world, cfgs)


def test_a_stop_signal_that_kills_the_servers_too_checkpoints_at_once(dist_run, tmp_path):
    """The run is stopping and its engine died with the same signal: the rank gives up on the
    engine at once (no no_engine_timeout_s wait, here 600 s; no restart), every rank checkpoints
    the finished updates, and the resumed run equals the uninterrupted one."""
    from megapkl.cli import describe

    patient = ["rollout.sglang.no_engine_timeout_s=600", "rollout.sglang.max_restarts=3"]
    with two_serve_workers(tmp_path) as workers:
        urls = [w.url for w in workers]
        ref = tmp_path / "reference"
        dist_run(_rank, 2, _cfgs(ref, urls), timeout=300)

        run, stop = tmp_path / "run", tmp_path / "stop"
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as info:
            dist_run(_rank_stopped_with_its_server, 2, _cfgs(run, urls, *patient, doomed=stop),
                     stop, timeout=300)
        line = describe(info.value)
        assert time.monotonic() - t0 < 200, "waited for the engine"
        m = re.search(r"SIGTERM during update (\d+), whose engines stopped with it; checkpoint "
                      r"(\S+) holds the (\d+) finished updates", line)
        assert m and m.group(1) == m.group(3) and int(m.group(1)) >= 1, line
        ckpt.verify(Path(m.group(2)))

        dist_run(_rank, 2, _cfgs(run, urls, "checkpoint.resume=true"), timeout=300)
        got, want = read_metrics(run), read_metrics(ref)
        assert [r["step"] for r in got] == list(range(STEPS))
        assert comparable(got) == comparable(want)
