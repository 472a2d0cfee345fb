"""Every way a run ends closes what it opened: the normal end, a NaN abort, a constructor that
fails, Ctrl-C (here: SIGINT to one rank; the terminal path is test_lock_and_signals.py), an engine
outage (test_engine_outage.py) and a Slurm preemption (tests/launch/test_slurm_trainer.py). After
each: no child process left (the reward worker, W&B's service, launched servers), TensorBoard and
W&B flushed and closed, the run-directory lock released, each checkpoint step saved once.

Real runs: the megatron-core trainer in forked gloo ranks, a user reward function (a worker
process), TensorBoard, W&B in offline mode."""
from __future__ import annotations

import json
import os
import re
import signal

from megapkl.train.metrics_log import read_metrics

from .conftest import tiny_cfg
from .exits import assert_closed, checked_run, read_facts

USER_REWARD = ["reward.type=python", "reward.function=tests.reliability.user_reward:first_char",
               "logging.tensorboard=true"]


def test_normal_end_closes_everything(dist_run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_cfg(tmp_path / "run", *USER_REWARD, "train.steps=4", "checkpoint.every=2",
                   "logging.wandb.mode=offline", "logging.wandb.project=megapkl-test")
    dist_run(checked_run, 1, cfg, tmp_path / "marks", timeout=300)
    facts = read_facts(tmp_path / "marks")
    assert facts[0]["error"] is None
    assert_closed(facts, tmp_path / "run", rows=4)
    assert facts[0]["saves"] == [2, 4]
    rows = read_metrics(tmp_path / "run")
    assert [r["reward/errors"] for r in rows] == [0.0] * 4  # the user's function scored them all
    records = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1 and records[0].stat().st_size > 0  # finished: ready for `wandb sync`


def _poison_from_update_1(rank):  # noqa: ARG001
    import torch

    from megapkl.parallel import megatron_loss

    real = megatron_loss.shard_policy_loss

    def poisoned(cfg, batch, ctx):
        out = real(cfg, batch, ctx)
        if batch.step >= 1:
            out.loss = out.loss * torch.tensor(float("nan"))
            out.parts.totals["loss"] = float("nan")
        return out

    megatron_loss.shard_policy_loss = poisoned


def test_nan_abort_closes_everything(dist_run, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", *USER_REWARD, "train.steps=6", "checkpoint.every=1",
                   "train.max_nan_skips_in_row=1")
    dist_run(checked_run, 1, cfg, tmp_path / "marks", _poison_from_update_1, timeout=300)
    facts = read_facts(tmp_path / "marks")
    assert re.match(r"TrainingError: update 2: non-finite loss .* 2 updates in a row",
                    facts[0]["error"]), facts[0]["error"]
    assert "holds the 3 finished updates" in facts[0]["error"], facts[0]["error"]
    assert_closed(facts, tmp_path / "run", rows=2)  # update 1 skipped its step, and was logged
    assert facts[0]["saves"] == [1, 2, 3]  # the aborted update 2 (skipped) is checkpointed too


def test_a_failing_constructor_closes_what_was_started(dist_run, tmp_path):
    """The evaluator's benchmark is missing: the reward worker, started before it, is stopped."""
    missing = tmp_path / "nowhere.jsonl"
    cfg = tiny_cfg(tmp_path / "run", *USER_REWARD, "train.steps=2", "eval.every=1",
                   f"eval.benchmarks=[{{name: gone, path: {missing}}}]")
    dist_run(checked_run, 2, cfg, tmp_path / "marks", timeout=300)
    facts = read_facts(tmp_path / "marks")
    assert [f["error"] for f in facts.values()] == [
        f"RanksFailed: loading the evaluation benchmarks failed on ranks 0, 1: EvalError: eval "
        f"benchmark 'gone': no prompt file at {missing} (run `megapkl data prepare gone --out "
        f"{missing.parent}` or set the benchmark's path)"] * 2
    assert_closed(facts, tmp_path / "run", rows=0)
    assert all(f["saves"] == [] for f in facts.values())


def _ctrl_c_on_rank_0_after_update_1(rank):
    """Rank 0 alone gets SIGINT while logging update 1 (a signal reaches only some ranks)."""
    if rank != 0:
        return
    from megapkl.train.metrics_log import MetricsLogger

    real = MetricsLogger.log

    def log(self, step, metrics):
        real(self, step, metrics)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    MetricsLogger.log = log


def test_ctrl_c_on_one_rank_saves_once_and_closes_everything(dist_run, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", *USER_REWARD, "train.steps=20", "checkpoint.every=2", data=2)
    dist_run(checked_run, 2, cfg, tmp_path / "marks", _ctrl_c_on_rank_0_after_update_1,
             timeout=300)
    facts = read_facts(tmp_path / "marks")
    assert [f["error"] for f in facts.values()] == [None, None]  # a clean stop
    assert_closed(facts, tmp_path / "run", rows=2)
    assert [f["saves"] for f in facts.values()] == [[2], [2]]  # due at 2 and stopping: once
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "complete")
                          .read_text())
    assert manifest["step"] == 2
