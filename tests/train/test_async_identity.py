"""Asynchronous rollouts change wall time, never the result (rollout.async_batches).

Each test trains the same tiny config twice against real `megapkl serve` worker processes (the
embedded engine behind SGLang's HTTP API, in processes of their own, as `rollout.sglang.urls`):
once synchronously, once with upcoming batches generated while the trainer trains. The two
metrics.jsonl files must agree row for row on every field but the wall-clock ones, for each
staleness protocol, with an evaluation every few updates, and through sglang-router in front of two
workers. The timeline fields prove the asynchronous run did generate ahead: some batch's generation
began before the previous update's training ended (ordering, not speed).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))

from sglang_fixtures import launch_cluster  # noqa: E402

from megapkl.config import load_config  # noqa: E402
from megapkl.train.metrics_log import read_metrics, wall_clock  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("configs/demo"), reason="run from the repo root")

TINY = ["model.name=tiny-qwen3", "model.hf_checkpoint=null", "model.dtype=fp32",
        "parallel.data=1", "parallel.micro_batch_size=8", "rollout.engine=sglang",
        "rollout.sglang.colocate=false", "rollout.sglang.use_router=false",
        "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4",
        "rollout.max_response_len=2", "train.lr=1e-2", "logging.progress_bar=false",
        "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.keep=1"]

PROTOCOLS = {
    "periodic_refresh": ["train.steps=6", "rollout.refresh_every=3", "reference.refresh_every=3"],
    "controlled_staleness": ["train.steps=6", "rollout.protocol=controlled_staleness",
                             "rollout.refresh_every=null", "rollout.max_staleness=2",
                             "rollout.minibatches_per_batch=2", "reference.refresh_every=2"],
    "uniform_stale": ["train.steps=6", "rollout.protocol=uniform_stale",
                      "rollout.refresh_every=null", "rollout.max_staleness=3",
                      "rollout.snapshot_pool=8", "reference.refresh_every=2"],
}
EVAL = ["eval.every=2", "eval.benchmarks=[{name: next_mod10, greedy: true}]"]
# The multi-turn toy (configs/demo/cpu_lookup.yaml's task and env section): a tool call, then an
# observation, then the answer; on the SGLang engine one request per turn and trajectory.
LOOKUP = ["data.synthetic=lookup_kv", "env.type=lookup", "env.max_turns=2",
          "env.max_turn_tokens=1", "env.max_observation_tokens=2", "rollout.max_response_len=4"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two tiny-qwen3 `megapkl serve` workers behind a round-robin sglang-router."""
    c = launch_cluster(tmp_path_factory.mktemp("async_cluster"))
    yield c
    c.close()


def servers(cluster, router: bool) -> list[str]:
    """One worker alone, or both behind the router."""
    if not router:
        return [f"rollout.sglang.urls={json.dumps(cluster.worker_urls[:1])}"]
    return [f"rollout.sglang.urls={json.dumps(cluster.worker_urls)}",
            f"rollout.sglang.router_url={cluster.router_url}", "rollout.sglang.use_router=true"]


def train(dist_run, run_dir: Path, overrides: list[str]) -> list[dict]:
    from megapkl.train.local import _rank_main

    cfg = load_config("configs/demo/cpu_demo.yaml", [*TINY, *overrides, f"run_dir={run_dir}"])
    dist_run(_rank_main, 1, cfg, timeout=300)
    return read_metrics(run_dir)


def result(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]


def generated_ahead(rows: list[dict]) -> int:
    """Updates whose batch's generation began before the previous update's training ended."""
    return sum(1 for prev, row in zip(rows, rows[1:])
               if "time/generate_from_s" in row and "time/train_to_s" in prev
               and row["time/generate_from_s"] < prev["time/train_to_s"])


def check_identity(dist_run, tmp_path, overrides: list[str], ahead: int = 2) -> list[dict]:
    sync = train(dist_run, tmp_path / "sync", overrides)
    asyn = train(dist_run, tmp_path / "async", [*overrides, f"rollout.async_batches={ahead}"])
    assert len(sync) == len(asyn) > 0
    for u, (a, b) in enumerate(zip(result(sync), result(asyn))):
        assert a == b, f"update {u}: " + ", ".join(
            f"{k}: {a.get(k)} != {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
    assert generated_ahead(asyn) > 0, "the asynchronous run never generated ahead of training"
    assert generated_ahead(sync) == 0
    return sync


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_async_equals_sync(protocol, cluster, dist_run, tmp_path):
    check_identity(dist_run, tmp_path, [*PROTOCOLS[protocol], *servers(cluster, router=False)])


def test_async_equals_sync_with_evaluation(cluster, dist_run, tmp_path):
    check_identity(dist_run, tmp_path, [*PROTOCOLS["controlled_staleness"], *EVAL,
                                        *servers(cluster, router=False)])


def test_async_equals_sync_through_router(cluster, dist_run, tmp_path):
    check_identity(dist_run, tmp_path, [*PROTOCOLS["periodic_refresh"], *servers(cluster, True)],
                   ahead=1)


def test_async_equals_sync_with_multi_turn_trajectories(cluster, dist_run, tmp_path):
    """Trajectories at their own pace on two workers behind the router (a trajectory's turns may
    go to either): the asynchronous run's metrics are the synchronous run's."""
    rows = check_identity(dist_run, tmp_path, [*PROTOCOLS["controlled_staleness"], *LOOKUP,
                                               *servers(cluster, router=True)])
    assert all(r["tokens/observation"] > 0 for r in rows)  # tool calls in every update
    assert sum(r["turns/mean"] for r in rows) / len(rows) > 1.0


def test_async_resume_with_queued_batches(cluster, dist_run, tmp_path):
    """A checkpoint taken while the next batch is already generated (queued, not saved; the
    engine already at that batch's version) resumes to the same run: the resumed run generates that batch again, from the same prompts, versions
    and seeds."""
    run = [*PROTOCOLS["controlled_staleness"], *servers(cluster, router=False),
           "rollout.async_batches=2", "checkpoint.every=2", "checkpoint.keep=3"]
    full = train(dist_run, tmp_path / "full", run)
    assert generated_ahead(full) > 0
    # A checkpoint (every 2 updates, 3 kept) taken while the next batch was already generated;
    # on a loaded machine the producer may not be ahead at every one of them.
    queued = [s for s in (4, 2)
              if full[s]["time/generate_from_s"] < full[s - 1]["time/train_to_s"]]
    step = queued[0] if queued else 4
    ckpt = tmp_path / "full" / "checkpoints" / f"step_{step:08d}"
    resumed = train(dist_run, tmp_path / "resumed", [*run, f"checkpoint.resume={ckpt}",
                                                     f"checkpoint.dir={tmp_path}/resumed/ckpt"])
    assert [r["step"] for r in resumed] == list(range(step, 6))
    assert result(resumed) == result(full)[step:]


def test_async_equals_sync_with_refill_rounds(cluster, dist_run, tmp_path):
    """Dynamic sampling draws refill rounds: the forecast of the next batch's prompts is then
    wrong, the units generated ahead for it are dropped and the trainer generates them itself."""
    check_identity(dist_run, tmp_path, [*PROTOCOLS["uniform_stale"], *servers(cluster, False),
                                        "advantage.filter_constant_groups=true",
                                        "advantage.max_fill_rounds=8"])
