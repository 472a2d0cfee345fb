"""The trainer with multi-turn trajectories (configs/demo/cpu_lookup.yaml: a tool call inserts an
observation between two turns): exact resume, and a parallel layout that changes nothing but
wall time. Each run is a forked child of the pytest process, as in test_trainer.py."""
import pytest

from megapkl.config import load_config
from megapkl.train.metrics_log import read_metrics, wall_clock

LOOKUP = "configs/demo/cpu_lookup.yaml"
BASE = ["logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=8", "parallel.micro_batch_size=8", "checkpoint.every=0",
        "rollout.refresh_every=2", "reference.refresh_every=2"]
MULTI_TURN = {"turns/mean", "tool/call_rate", "tool/calls", "tool/invalid", "tokens/action",
              "tokens/observation", "env/errors", "time/env_step_s"}


def cfg_for(tmp_path, name, *overrides, data=1):
    return load_config(LOOKUP, [*BASE, f"parallel.data={data}", f"run_dir={tmp_path / name}",
                                *overrides])


def train(dist_run, cfg, world=1, timeout=300):
    from megapkl.train.local import _rank_main

    return dist_run(_rank_main, world, cfg, timeout=timeout)


def comparable(rows):
    return [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]


def test_multi_turn_resume_continues_exactly_dp2(dist_run, tmp_path):
    full = cfg_for(tmp_path, "full", "train.steps=6", data=2)
    train(dist_run, full, world=2)
    rows = read_metrics(full.run_dir)
    assert MULTI_TURN <= set(rows[0])
    assert all(r["tokens/observation"] > 0 for r in rows)  # observations in every update
    assert sum(r["turns/mean"] for r in rows) / len(rows) > 1.0
    train(dist_run, cfg_for(tmp_path, "part", "train.steps=3", data=2), world=2)
    resumed = cfg_for(tmp_path, "part", "train.steps=6", "checkpoint.resume=true", data=2)
    train(dist_run, resumed, world=2)
    assert comparable(read_metrics(resumed.run_dir)) == comparable(rows)


def test_multi_turn_layouts_change_nothing_but_wall_time(dist_run, tmp_path):
    """CP = 2 (an observation cut by the split) and DP = 2 log what one process logs, up to
    the order of summation (TP with the same weights is the partition tests'; a random init
    differs by TP, so the trainer's runs are compared at TP 1)."""
    keys = ("loss", "coef/mean", "coef/abs_max", "grad_norm", "is/log_dev", "turns/mean",
            "tokens/observation", "train/accuracy")
    runs = {}
    for name, extra, world in (("one", [], 1), ("cp2", ["parallel.context=2"], 2),
                               ("dp2", [], 2)):
        cfg = cfg_for(tmp_path, name, "train.steps=3", *extra, data=2 if name == "dp2" else 1)
        train(dist_run, cfg, world=world)
        runs[name] = read_metrics(cfg.run_dir)
    for name in ("cp2", "dp2"):
        for a, b in zip(runs["one"], runs[name]):
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (name, a["step"], k)
