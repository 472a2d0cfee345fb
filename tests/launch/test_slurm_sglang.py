"""`rollout.engine: sglang` inside a two-node Slurm allocation: the real trainer (one task on each
of mpn1 and mpn2, DP=2 over gloo) launches `megapkl serve` workers through rollout.sglang's own
launcher (server_command) and sglang-router, in both placements:

- colocated (the default): each data-parallel leader runs its fleet on its own node, on loopback,
  under <run_dir>/sglang/replica<r>/ with ports of its own;
- spread (colocate false, host 0.0.0.0): each leader's engines go one per node through
  `srun --overlap`, are addressed by node name, and take their weights over a gloo broadcast group
  whose rendezvous is the leader's node;
- a replica across both nodes (PP=2, one stage per node), colocated with a fleet on each node
  (rollout.sglang.every_node): each node's worker launched on loopback by that node's rank and fed
  by it from the stored version, with metrics.jsonl equal to the leader-only fleet's.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megapkl.launch.submit import read_metrics, submit

from .conftest import TINY, wait_done

pytestmark = pytest.mark.usefixtures("slurm_cluster")
TWO_NODES = "local_cpu_2nodes"  # mpn1, mpn2: slurmd in two network namespaces
STEPS = 4
SERVE = [sys.executable, "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3",
         "--host", "{host}", "--port", "{port}"]


def _run(run_dir: Path, extra: list[str], what: str) -> list[dict]:
    sub = submit(TINY, TWO_NODES, [
        f"run_dir={run_dir}", f"train.steps={STEPS}", "rollout.engine=sglang",
        f"rollout.sglang.server_command={json.dumps(SERVE)}", "rollout.sglang.startup_timeout_s=240",
        "rollout.sglang.health_interval_s=1", *extra])  # a later server_command replaces SERVE
    wait_done(sub.job, 420, what)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert [r["staleness/max"] for r in rows] == [0, 1, 0, 1]  # refresh_every 2: versions served
    return rows


def _starts(log: Path) -> list[str]:
    return re.findall(r"==== megapkl: starting (.*)", log.read_text())


def test_colocated_fleets_one_per_leader_on_its_own_node(launch_tmp: Path) -> None:
    run_dir = launch_tmp / "sglang_colocated"
    _run(run_dir, ["rollout.sglang.num_engines=1", "rollout.sglang.base_port=30600",
                   "rollout.sglang.weight_sync=tensor"], "two-node colocated SGLang job")
    ports = []
    for r in (0, 1):
        logs = run_dir / "sglang" / f"replica{r}" / "logs"
        (start,) = _starts(logs / "engine0.log")
        assert "srun" not in start and "--host 127.0.0.1" in start, start
        ports.append(int(re.search(r"--port (\d+)", start).group(1)))
        assert "http://127.0.0.1:" in _starts(logs / "router.log")[0]
    assert ports == [30600, 30601]  # each replica's own ports


def test_spread_fleets_over_the_nodes_sync_by_broadcast(launch_tmp: Path) -> None:
    run_dir = launch_tmp / "sglang_spread"
    _run(run_dir, ["rollout.sglang.num_engines=2", "rollout.sglang.base_port=30700",
                   "rollout.sglang.colocate=false", "rollout.sglang.host=0.0.0.0",
                   "rollout.sglang.weight_sync=distributed"], "two-node spread SGLang job")
    for r in (0, 1):
        logs = run_dir / "sglang" / f"replica{r}" / "logs"
        for i, node in enumerate(("mpn1", "mpn2")):
            (start,) = _starts(logs / f"engine{i}.log")
            assert f"srun --overlap --nodes=1 --ntasks=1 --nodelist={node}" in start, start
            assert f"--port {30700 + 2 * r + i}" in start and "--host 0.0.0.0" in start
        router = _starts(logs / "router.log")[0]
        assert f"http://mpn1:{30700 + 2 * r}" in router and f"http://mpn2:{30701 + 2 * r}" in router


def _kill_when_logged(run_dir: Path, rows: int, log: Path) -> threading.Thread:
    """SIGKILL the `megapkl serve` worker whose start line is in `log` once metrics.jsonl holds
    `rows` rows (from outside the job: the nodes' processes are this host's)."""
    def watch() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if len(read_metrics(run_dir)) >= rows and log.exists() and _starts(log):
                port = re.search(r"--port (\d+)", _starts(log)[0]).group(1)
                for pid in _serve_pids(port):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                return
            time.sleep(0.1)
    killed: list[int] = []
    thread = threading.Thread(target=watch, daemon=True)
    thread.killed = killed  # type: ignore[attr-defined]
    thread.start()
    return thread


def _serve_pids(port: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megapkl.serve.serve" in argv and f"{port}".encode() in argv:
            pids.append(int(proc.name))
    return pids


def test_a_replica_across_both_nodes_has_a_fleet_on_each(launch_tmp: Path) -> None:
    """A replica across mpn1 and mpn2 (PP=2, one stage per node) against the leader-only fleet:
    each node's worker launched on its loopback by that node's rank; node 1's worker SIGKILLed
    after the first update is restarted and resynced by its fleet; metrics.jsonl equals the
    leader-only run's; and each worker's weights (SHA-256 of every tensor, written by the worker
    when a version is set) equal the stored version it was last set to, byte for byte."""
    from megapkl.rollout.version_store import VersionStore
    from megapkl.train.metrics_log import wall_clock

    one_replica = ["parallel.data=1", "parallel.pipeline=2", "rollout.sglang.weight_sync=tensor",
                   "rollout.sglang.base_port=30950"]
    digests = launch_tmp / "digests"
    digests.mkdir()
    serve = [*SERVE, "--weight-digest-file", str(digests / "port{port}.json")]
    nodes = launch_tmp / "sglang_nodes"
    killer = _kill_when_logged(nodes, 1, nodes / "sglang" / "node1" / "logs" / "engine0.log")
    rows = {}
    for name, extra in (("nodes", ["rollout.sglang.num_engines=2",
                                   f"rollout.sglang.server_command={json.dumps(serve)}"]),
                        ("leader", ["rollout.sglang.every_node=false",
                                    "rollout.sglang.num_engines=1"])):
        got = _run(launch_tmp / f"sglang_{name}", [*one_replica, *extra], f"two-node {name} fleet")
        rows[name] = [{k: v for k, v in r.items() if not wall_clock(k)} for r in got]
    killer.join(timeout=5)
    assert killer.killed, "node 1's worker was never killed"  # type: ignore[attr-defined]
    for k in (0, 1):  # each node's worker: launched there, on its loopback, by that node's rank
        starts = _starts(nodes / "sglang" / f"node{k}" / "logs" / "engine0.log")
        assert len(starts) == 1 + k, starts  # node 1's: once more, after the kill
        assert all("srun" not in s and "--host 127.0.0.1" in s for s in starts), starts
    assert not (launch_tmp / "sglang_leader" / "sglang" / "node0").exists()
    (ckpt,) = sorted((nodes / "checkpoints").glob("step_*"))[-1:]
    stored = VersionStore(ckpt / "policy_versions", writer=False)
    held = [json.loads(p.read_text()) for p in sorted(digests.glob("port*.json"))]
    assert len(held) == 2, sorted(digests.iterdir())
    for worker in held:
        tensors = list(stored.get(int(worker["version"])).stream())
        assert tensors
        differ = [n for n, t in tensors if worker["weights"].get(n) !=
                  hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()]
        assert not differ, (worker["version"], differ[:5])
    assert rows["nodes"] == rows["leader"]
