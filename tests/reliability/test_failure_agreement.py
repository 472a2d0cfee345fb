"""One failure agreement: whatever fails on ONE rank of DP=2 stops BOTH ranks within seconds, with
the same one-line error naming the rank and what it raised, the finished updates checkpointed.
Before, the other rank waited in a collective until the process-group timeout (here 300 s).

Each fault is real code failing on rank 1 only: a policy version file missing from its view of
the run directory (VersionStoreError), a pushed weight of the wrong shape (WeightUpdateError), a
server refusing the request with HTTP 400, the user's reward function raising, its SGLang server
killed (an engine outage; test_engine_outage.py also resumes after one). Each rank's exit,
measured from the fault, is printed."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from megapkl.train import checkpointing as ckpt
from megapkl.train.metrics_log import read_metrics

from .conftest import tiny_cfg, two_serve_workers
from .exits import assert_closed, checked_run, read_facts

EXIT_WITHIN_S = 30.0  # the process-group timeout of these ranks is 300 s


def _mark_fault(marks: Path) -> None:
    (marks / "fault").write_text(str(time.time()))


def _one_error(marks: Path) -> tuple[dict, str]:
    """Every rank's facts and the one error they all stopped with."""
    facts = read_facts(marks)
    assert sorted(facts) == [0, 1], "a rank did not leave run()"
    errors = {f["error"] for f in facts.values()}
    assert len(errors) == 1, errors  # the same error on both ranks
    return facts, errors.pop()


def _assert_prompt_exits(facts: dict, marks: Path, label: str) -> None:
    """Each rank left run() within EXIT_WITHIN_S of the fault (printed: what the note quotes)."""
    fault = float((marks / "fault").read_text())
    took = [round(f["exit"] - fault, 2) for _, f in sorted(facts.items())]
    print(f"\n{label}: ranks 0, 1 left run() {took} s after the fault")
    assert max(took) < EXIT_WITHIN_S, took


def _file_missing_on_rank_1(marks):
    def inject(rank):
        if rank != 1:
            return
        from megapkl.rollout.version_store import VersionStore

        real = VersionStore.path

        def path(self, version):  # this rank does not see version 2's file
            if version == 2 and not self.writer:
                _mark_fault(marks)
                return real(self, version).with_name("not-visible-here.safetensors")
            return real(self, version)

        VersionStore.path = path
    return inject


def _wrong_shape_on_rank_1(marks):
    def inject(rank):
        if rank != 1:
            return
        from megapkl.rollout.embedded import EmbeddedEngine

        real = EmbeddedEngine.update_weights

        def update_weights(self, named_tensors, version):
            if version == 2:
                _mark_fault(marks)
                named_tensors = ((n, t.t() if t.dim() == 2 and "embed" in n else t)
                                 for n, t in named_tensors)
            return real(self, named_tensors, version)

        EmbeddedEngine.update_weights = update_weights
    return inject


def _reward_raises_on_rank_1(marks):
    def inject(rank):
        if rank != 1:
            return
        import os

        from megapkl.rollout.bounded_verify import RewardError
        from megapkl.rollout.rewards import GroupReward

        os.environ["MEGAPKL_TEST_REWARD_FAILS_AFTER"] = "4"  # the worker inherits it: update 2
        real = GroupReward.scores

        def scores(self, samples):
            try:
                return real(self, samples)
            except RewardError:
                _mark_fault(marks)
                raise

        GroupReward.scores = scores
    return inject


CASES = [
    ("version-file", _file_missing_on_rank_1, [],
                     r"the rollout failed on rank 1: VersionStoreError: policy version 2 is "
                     r"needed but its file .*not-visible-here.safetensors is missing"),
    ("weight-shape", _wrong_shape_on_rank_1, [],
                     r"the rollout failed on rank 1: WeightUpdateError: .*shape"),
    ("reward-function", _reward_raises_on_rank_1,
                        ["reward.type=python",
                         "reward.function=tests.reliability.user_reward:fails_later"],
                        r"the rollout failed on rank 1: RewardError: reward.function "
                        r"tests.reliability.user_reward:fails_later failed on the group of "
                        r"prompt <synthetic:next_mod10>:\d+: ZeroDivisionError: call 5: the "
                        r"user's reward "
                        r"function is broken"),
]


@pytest.mark.parametrize("case,make,extra,message", CASES, ids=[c[0] for c in CASES])
def test_a_failure_on_one_rank_stops_every_rank_at_once(dist_run, tmp_path, case, make, extra,
                                                          message):
    marks, run = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    cfg = tiny_cfg(run, *extra, "train.steps=5", "logging.tensorboard=true", data=2)
    dist_run(checked_run, 2, cfg, marks, make(marks), timeout=300)
    facts, error = _one_error(marks)
    assert re.search(message, error), error
    assert error.startswith("RunStopped: update 2: "), error
    saved = run / "checkpoints" / "step_00000002"
    assert f"checkpoint {saved} holds the 2 finished updates" in error, error
    ckpt.verify(saved)
    assert_closed(facts, run, rows=2)
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    _assert_prompt_exits(facts, marks, case)


def _mark_fault_when_generate_raises(marks: Path, error: type, before=None) -> None:
    """This rank's SGLang client marks the fault's time when generate raises `error`;
    `before(engine)` runs first on each call (the fault's trigger, if the test makes one)."""
    from megapkl.rollout.sglang.client import SGLangEngine

    real = SGLangEngine.generate

    def generate(self, *args, **kwargs):
        if before is not None:
            before(self)
        try:
            return real(self, *args, **kwargs)
        except error:
            _mark_fault(marks)
            raise

    SGLangEngine.generate = generate


# ------------------------------------------------------------------ an HTTP 4xx from a server


def _rank_with_own_config(rank, world, cfgs, marks):  # noqa: ARG001
    def inject(rank):
        if rank == 1:  # the server's 400, as the client reports it
            _mark_fault_when_generate_raises(marks, ValueError)
    return checked_run(rank, world, cfgs[rank], marks, inject)


def test_an_http_4xx_on_one_rank_stops_every_rank_at_once(dist_run, tmp_path):
    """Rank 1's requests ask the server for more top log-probs than it returns: HTTP 400."""
    marks, run = tmp_path / "marks", tmp_path / "run"
    sglang = ["rollout.engine=sglang", "rollout.sglang.startup_timeout_s=120",
              "rollout.sglang.max_retries=1", "train.steps=3", "logging.tensorboard=true"]
    with two_serve_workers(tmp_path) as workers:
        urls = [w.url for w in workers]
        cfgs = [tiny_cfg(run, *sglang, f'rollout.sglang.urls=["{urls[r]}"]',
                         *(["rollout.topk_logprobs=100000"] if r == 1 else []), data=2)
                for r in range(2)]
        dist_run(_rank_with_own_config, 2, cfgs, marks, timeout=300)
    facts, error = _one_error(marks)
    assert error.startswith("RunStopped: update 0: the rollout failed on rank 1: ValueError: "
                            "rollout.topk_logprobs (K=100000) refused by"), error
    assert "no update had finished" in error
    assert_closed(facts, run, rows=0)
    _assert_prompt_exits(facts, marks, "http-4xx")


def _rank_whose_server_dies(rank, world, cfgs, marks, victim):  # noqa: ARG001
    """Rank 1 kills its own server (SIGKILL) right before it generates update 2's batch (the
    first from policy version 2)."""
    def kill_before_update_2(engine) -> None:
        if engine.version == 2 and not (marks / "killed").exists():  # update 2's batch
            (marks / "killed").touch()
            os.kill(victim, signal.SIGKILL)

    def inject(rank):
        if rank == 1:
            from megapkl.rollout.engine import RolloutEngineError

            _mark_fault_when_generate_raises(marks, RolloutEngineError, kill_before_update_2)
    return checked_run(rank, world, cfgs[rank], marks, inject)


def test_an_engine_outage_on_one_rank_stops_every_rank_at_once(dist_run, tmp_path):
    marks, run = tmp_path / "marks", tmp_path / "run"
    sglang = ["rollout.engine=sglang", "rollout.sglang.health_interval_s=0.3",
              "rollout.sglang.health_timeout_s=20", "rollout.sglang.no_engine_timeout_s=5",
              "rollout.sglang.max_retries=1", "rollout.sglang.startup_timeout_s=120",
              "train.steps=4", "logging.tensorboard=true"]
    with two_serve_workers(tmp_path) as workers:
        cfgs = [tiny_cfg(run, *sglang, f'rollout.sglang.urls=["{w.url}"]', data=2)
                for w in workers]
        dist_run(_rank_whose_server_dies, 2, cfgs, marks, workers[1].popen.pid, timeout=300)
    facts, error = _one_error(marks)
    assert error.startswith("EnginesStopped: update 2: the rollout's engines failed: "), error
    assert workers[0].url not in error and workers[1].url in error, error
    saved = run / "checkpoints" / "step_00000002"
    assert f"checkpoint {saved} holds the 2 finished updates" in error, error
    assert_closed(facts, run, rows=2)
    _assert_prompt_exits(facts, marks, "engine-outage")
