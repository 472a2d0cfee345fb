"""Colocated fleets on every node of a replica (rollout.sglang.every_node), on one host.

Two trainer ranks form one replica (PP=2) and each is told it is a node of its own
(LOCAL_WORLD_SIZE=1), so the placement gives each rank a fleet of one `megapkl serve` worker
(behind its own sglang-router), refreshed by that rank from the stored policy version through
shared memory (weight_sync tensor). Each rank generates its share of the replica's prompt groups
and both ranks get all the samples. Against the same run with the leader-only fleet
(every_node false: one worker on rank 0's node):

- metrics.jsonl agrees row for row on every field but the wall-clock ones (an in-training
  evaluation included: each engine evaluates its share of the benchmark);
- both nodes' workers answered generation requests, each node's from its own logs;
- at the end every worker holds the weights of the version its engine reports, bit for bit
  against the stored version;
- node 1's server, SIGKILLed mid-run, is restarted and resynced by its fleet, changing nothing.

The same on the two-node Slurm test cluster, node by node: tests/launch/test_slurm_sglang.py.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from megapkl.config import load_config

from test_sglang_train import generate_counts, print_log_tails, serve_command

pytestmark = pytest.mark.skipif(not os.path.isdir("configs/demo"), reason="run from the repo root")

STEPS = 4
RUN = ["parallel.data=1", "parallel.pipeline=2", "parallel.micro_batch_size=8",
       f"train.steps={STEPS}",
       "rollout.prompts_per_batch=6", "rollout.responses_per_prompt=4",
       "rollout.max_response_len=4", "rollout.refresh_every=2", "eval.every=2",
       "eval.benchmarks=[{name: next_mod10, greedy: true}]",
       "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0",
       "rollout.engine=sglang", f"rollout.sglang.server_command={serve_command('tiny-qwen3')}",
       "rollout.sglang.use_router=true", "rollout.sglang.weight_sync=tensor",
       "rollout.sglang.startup_timeout_s=240", "rollout.sglang.health_interval_s=2"]


def _kill_when(trainer, update: int) -> threading.Thread:
    """SIGKILL this rank's first server once the run has reached `update`."""
    def watch() -> None:
        while trainer.loop.update < update:
            time.sleep(0.05)
        os.kill(trainer.slot.engine.fleet.workers[0].process.popen.pid, signal.SIGKILL)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def train_and_check_weights(rank, world, cfg, kill=None):
    """One trainer rank: the whole run (`kill`: (rank, update) whose first server is killed
    then), then (an engine's rank, once its workers are ready and its heartbeat stopped) each
    worker's state and what it holds, compared with the stored version the engine reports."""
    from megapkl.rollout.sglang import http
    from megapkl.train.loop import Trainer
    from megapkl.train.run_context import RunContext

    with RunContext() as context:
        trainer = Trainer(cfg, context)
        killer = _kill_when(trainer, kill[1]) if kill and kill[0] == rank else None
        trainer.run()
        if killer is not None:
            killer.join(timeout=5)
        slot = trainer.slot
        if slot.engine is None:
            return {"rank": rank, "workers": []}
        fleet = slot.engine.fleet
        settled = time.monotonic() + 120  # (a worker not ready now would be resynced first)
        while time.monotonic() < settled and {w.state for w in fleet.workers} != {"ready"}:
            time.sleep(0.1)
        fleet.stop_heartbeat()  # no resync or restart under the reads
        stored = list(trainer.versions.get(slot.engine.version).stream())
        differ = []
        for w in fleet.workers:
            for name, tensor in stored:
                held = torch.tensor(http.request(w.url, "/get_weights_by_name", {
                    "name": name, "truncate_size": tensor.shape[0]}, timeout=30))
                if not torch.equal(held.to(tensor.dtype), tensor):
                    differ.append((w.url, name))
        return {"rank": rank, "workers": [w.url for w in fleet.workers], "tensors": len(stored),
                "differ": differ, "states": [w.state for w in fleet.workers],
                "version": slot.engine.version, "events": fleet.events}


def _run(dist_run, run_dir: Path, extra: list[str], kill=None):
    from megapkl.train.metrics_log import read_metrics, wall_clock

    cfg = load_config("configs/demo/cpu_demo.yaml", [*RUN, f"run_dir={run_dir}", *extra])
    try:
        out = dist_run(train_and_check_weights, 2, cfg, kill, timeout=400)
    except Exception:
        for logs in run_dir.glob("sglang/**/logs"):
            print_log_tails(logs.parent)
        raise
    rows = [{k: v for k, v in r.items() if not wall_clock(k)} for r in read_metrics(run_dir)]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return rows, out


LEADER = ["rollout.sglang.every_node=false", "rollout.sglang.num_engines=1",
          "rollout.sglang.base_port=30850"]
NODES = ["rollout.sglang.every_node=true", "rollout.sglang.num_engines=2",
         "rollout.sglang.base_port=30850"]


@pytest.fixture(scope="module")
def leader_only(megatron_loaded, tmp_path_factory):
    """The reference: the leader-only fleet (one worker, on rank 0's node)."""
    from megapkl.parallel.forked import run_forked

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank a node of its own
    try:
        run_dir = tmp_path_factory.mktemp("leader_only")
        return run_dir, *_run(run_forked, run_dir, LEADER)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_a_fleet_on_each_node_changes_no_result_even_when_one_dies(dist_run, leader_only,
                                                                   tmp_path, monkeypatch):
    """A fleet on each node against the leader-only fleet; node 1's server is SIGKILLed after
    update 2 on the way: its fleet restarts it and resyncs it from the stored version (both
    changes of the run's course, neither of its results)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    leader_dir, leader_rows, leader = leader_only
    node_rows, nodes = _run(dist_run, tmp_path / "nodes", NODES, kill=(1, 2))

    assert [len(o["workers"]) for o in leader] == [1, 0]  # rank 1 runs no engine
    assert [len(o["workers"]) for o in nodes] == [1, 1]   # one worker per node
    assert nodes[0]["workers"] != nodes[1]["workers"]     # ports of their own on a shared host
    for o in (*leader, *nodes):  # (the events say what the fleet did, if not)
        if o["workers"]:
            assert o["tensors"] > 0 and o["differ"] == [] and set(o["states"]) == {"ready"}, repr(o)

    served = {k: generate_counts(tmp_path / "nodes", f"sglang/node{k}") for k in (0, 1)}
    assert all(c["engine0"] > 0 and c["router"] == c["engine0"] for c in served.values()), served
    assert not (leader_dir / "sglang" / "node0").exists()
    assert generate_counts(leader_dir)["engine0"] > 0
    log = (tmp_path / "nodes" / "sglang" / "node1" / "logs" / "engine0.log").read_text()
    assert len(re.findall(r"==== megapkl: starting", log)) == 2, log[-2000:]  # restarted once

    assert any("eval/micro_avg/accuracy" in r for r in node_rows)
    assert node_rows == leader_rows
