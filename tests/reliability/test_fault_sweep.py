"""Fault injection at call sites, the CI sample of tools/fault_sweep.py (which tries every site):
a traced megapkl function raising RuntimeError("injected fault") at its first call of update 2,
on rank 1 (rank 0 where rank 0 alone calls it), of a DP=2 tiny run, stops both ranks within 30 s
with one line naming the rank and the error, the finished updates in a checkpoint that verifies,
no child process or megapkl thread left and the run directory's lock free (tests/reliability/
sweep.py says how sites are traced and judged).

The sample holds a site of every package on update 2's path (config code is not called during an
update), the rank-local steps between agreements (the metrics log, the evaluation's result write, a
checkpoint's files) and the rollout producer's unit of work, synchronous (the trainer's thread) and
asynchronous (rollout.async_batches: the producer thread, against two `megapkl serve` workers).
"""
from __future__ import annotations

import pytest

from . import sweep
from .conftest import two_serve_workers

SAMPLE = [  # (target, what it stands for), each passing
    ("megapkl.train.metrics_log:MetricsLogger.log", "the metrics log (carried to the update's end)"),
    ("megapkl.eval.runner:write_results", "eval: the evaluation's result files (rank 0)"),
    ("megapkl.train.checkpointing:_commit", "a checkpoint's rename into place (rank 0)"),
    ("megapkl.train.checkpointing:_fsync_mine", "a checkpoint's files flushed (rank 1)"),
    ("megapkl.train.rollouts:RolloutStage._work", "the synchronous producer's unit of work"),
    ("megapkl.rollout.embedded:EmbeddedEngine.generate", "rollout: the engine"),
    ("megapkl.rollout.rewards:Reward.scores", "rollout: the reward"),
    ("megapkl.parallel.compat:_is_cuda_device", "parallel: the CPU shim, in generation"),
    ("megapkl.objectives.sis:mix64_int", "objectives: the sampling seeds"),
]
# A rank raising inside collective work (the training step, the weight export that a reference
# snapshot takes) leaves its peer in a collective: the failure is told out of band
# (megapkl.train.failure_notice), and every rank stops with its line and the newest checkpoint.
OUT_OF_BAND = [
    ("megapkl.parallel.megatron_loss:forward_backward", "parallel: the training step, told"),
    ("megapkl.models.snapshot:SnapshotStore.save", "models: the reference snapshot, told"),
]
PACKAGES = {"train", "rollout", "eval", "models", "parallel", "objectives"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, megatron_loaded):  # noqa: ARG001 - megatron imported before forks
    from megapkl.parallel.forked import run_forked

    sites, _ = sweep.trace(run_forked, tmp_path_factory.mktemp("trace") / "run")
    return {s.target: s for s in sites}


def test_the_sample_covers_every_package_on_the_path(traced):
    on_path = {t.split(":")[0].split(".")[1] for t in traced}
    assert on_path == PACKAGES, f"update 2 now calls code of {sorted(on_path)}: update the sample"
    sampled = {t.split(":")[0].split(".")[1] for t, _ in SAMPLE + OUT_OF_BAND}
    assert sampled == on_path
    missing = [t for t, _ in SAMPLE + OUT_OF_BAND if t not in traced]
    assert not missing, f"no longer called in update 2 (or not injectable): {missing}"


CASES = [*SAMPLE, *OUT_OF_BAND]


@pytest.mark.parametrize("target,why", CASES, ids=[c[0].split(":")[1] for c in CASES])
def test_a_fault_at_this_site_stops_every_rank_at_once(traced, dist_run, tmp_path, target,
                                                       why):  # noqa: ARG001 - the case's label
    site = traced[target]
    result = sweep.try_site(dist_run, site, tmp_path)
    print(f"\n{target} (rank {site.rank}, call {site.call}): {result.outcome}, the last rank out "
          f"{result.exit_s} s after the fault; {result.checkpoint}")
    assert result.outcome == "pass", f"{result.outcome}; the error: {result.error}"
    assert f"rank {site.rank}" in result.error and sweep.ERROR in result.error, result.error
    assert result.exit_s < sweep.EXIT_WITHIN_S


ASYNC = ["rollout.engine=sglang", "rollout.sglang.colocate=false", "rollout.sglang.use_router=false",
         "rollout.sglang.startup_timeout_s=120", "rollout.sglang.max_retries=1",
         "rollout.async_batches=2", "train.steps=6"]  # 6: the producer works on in update 2


def test_a_fault_in_the_asynchronous_producers_work_stops_every_rank_at_once(megatron_loaded,
                                                                             dist_run, tmp_path):
    """rollout.async_batches: during update 2 the producer thread generates a later batch; its
    failure reaches the trainer when that batch is taken, and stops both ranks alike."""
    with two_serve_workers(tmp_path) as workers:
        urls = [[f'rollout.sglang.urls=["{w.url}"]'] for w in workers]
        sites, _ = sweep.trace(dist_run, tmp_path / "trace" / "run", *ASYNC, per_rank=urls)
        site, = [s for s in sites if s.target == "megapkl.train.rollouts:RolloutStage._work"]
        assert site.thread == "megapkl-rollout-producer", site
        result = sweep.try_site(dist_run, site, tmp_path / "fault", *ASYNC, per_rank=urls)
    print(f"\nasync {site.target} (rank {site.rank}, call {site.call}): {result.outcome}, "
          f"{result.exit_s} s; {result.checkpoint}")
    assert result.outcome == "pass", f"{result.outcome}; the error: {result.error}"


MULTI_TURN = ["data.synthetic=lookup_kv", "env.type=lookup", "env.max_turns=2",
              "env.max_turn_tokens=1", "env.max_observation_tokens=2",
              "rollout.max_response_len=4"]
# One site on each thread a multi-turn rollout runs on: the driver between the engine's turns (the
# rank's main thread, where the turn loop and the trajectory's sample run too) and the
# environment's step (a tool thread). A fault in the turn loop or in the trajectory's sample takes
# the same path as one in the driver; all four passed, 0.07-0.71 s, when this test tried them all.
MULTI_TURN_SITES = ["megapkl.rollout.turns:TurnDriver.react", "megapkl.envs.lookup:LookupEnv.step"]


def test_a_fault_at_a_multi_turn_site_stops_every_rank_at_once(megatron_loaded, dist_run,
                                                                tmp_path):
    """Multi-turn rollouts (the lookup tool task): a fault in the turn driver or in the
    environment's step on a tool thread stops both ranks alike, with the run's tool threads
    closed."""
    sites, _ = sweep.trace(dist_run, tmp_path / "trace" / "run", *MULTI_TURN)
    by = {s.target: s for s in sites}
    missing = [t for t in MULTI_TURN_SITES if t not in by]
    assert not missing, f"no longer called in update 2: {missing}"
    for i, target in enumerate(MULTI_TURN_SITES):
        result = sweep.try_site(dist_run, by[target], tmp_path / f"fault{i}", *MULTI_TURN)
        print(f"\n{target} (rank {by[target].rank}, call {by[target].call}): {result.outcome}, "
              f"{result.exit_s} s; {result.checkpoint}")
        assert result.outcome == "pass", f"{target}: {result.outcome}; the error: {result.error}"
        assert sweep.ERROR in result.error and result.exit_s < sweep.EXIT_WITHIN_S
