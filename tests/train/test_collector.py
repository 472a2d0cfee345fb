"""The train loop's updates run with the setup's objects frozen and a large young generation
(`loop.settled_collector`) and on `parallel.cpu_threads` torch threads (`torch_threads`);
the collector's settings and the thread count come back after the run."""
from __future__ import annotations

import gc

import pytest
import torch

from megapkl.config import load_config
from megapkl.train import loop

SMALL = ["logging.tensorboard=false", "logging.progress_bar=false", "parallel.data=1",
         "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4",
         "rollout.max_response_len=2", "parallel.micro_batch_size=4", "train.steps=2",
         "checkpoint.every=0", "eval.every=0"]


def test_settled_collector_freezes_and_restores():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert frozen == 0  # nothing in this process froze its objects
    with loop.settled_collector(young=12_345):
        assert gc.get_threshold() == (12_345, *before[1:]) and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with pytest.raises(KeyError), loop.settled_collector():
        raise KeyError
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own frozen objects stay frozen
    try:
        held = gc.get_freeze_count()
        with loop.settled_collector():
            pass
        assert gc.get_freeze_count() >= held > 0
    finally:
        gc.unfreeze()


def _observed_run(rank, world_size, cfg):
    seen = []
    train = loop.Trainer.run

    def observed(self):
        seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0))
        return train(self)

    loop.Trainer.run = observed
    before = gc.get_threshold()
    loop.run(cfg)
    return seen, gc.get_threshold() == before


def test_a_run_trains_under_the_settled_collector(dist_run, tmp_path):
    cfg = load_config("configs/demo/cpu_demo.yaml", [*SMALL, f"run_dir={tmp_path}"])
    (result,) = dist_run(_observed_run, 1, cfg, timeout=300)
    assert result == ([(50_000, True)], True)


class _Recorder:
    """Stands in for the Trainer: records torch's thread count while the run is under way. It
    runs no operator: a rank forked from a test process whose OpenMP pool is alive must not
    start a team of its own (GNU OpenMP is not fork-safe)."""
    seen: list = []

    def __init__(self, cfg, context):
        _Recorder.seen.append(torch.get_num_threads())

    def run(self):
        _Recorder.seen.append(torch.get_num_threads())
        return {}


def _threads_run(rank, world_size, cfg):
    loop.Trainer = _Recorder
    loop.run(cfg)
    return _Recorder.seen, torch.get_num_threads()


@pytest.mark.parametrize("setting, during", [("3", 3), ("null", 1)])
def test_a_run_takes_parallel_cpu_threads(dist_run, tmp_path, setting, during):
    """parallel.cpu_threads sets torch's threads for the run (null: the launcher's, here 1), and
    the rank's own count comes back after it."""
    cfg = load_config("configs/demo/cpu_demo.yaml",
                      [*SMALL, f"run_dir={tmp_path}", f"parallel.cpu_threads={setting}"])
    (result,) = dist_run(_threads_run, 1, cfg, timeout=120, threads=1)
    assert result == ([during, during], 1)


def test_parallel_cpu_threads_must_be_positive(tmp_path):
    with pytest.raises(Exception, match="parallel.cpu_threads"):
        load_config("configs/demo/cpu_demo.yaml", [*SMALL, "parallel.cpu_threads=0"])
