"""`megapkl compare`: bootstrap statistics against hand-computed intervals, per-run summaries,
the report, the Slurm grid (dry run), and a tiny real comparison through the CLI."""
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megapkl.analysis import compare_stats as st
from megapkl.analysis.compare import (Comparison, Criteria, method_overrides, plan_arms,
                                   report_markdown, run_summary, summarize)

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo" / "cpu_demo.yaml")


# ---------------------------------------------------------------- statistics by hand

def test_mean_interval_two_values_by_hand():
    # resamples of [0, 1]: (0,0) (0,1) (1,0) (1,1) -> means 0, .5, .5, 1, each 1/4
    iv = st.mean_interval([0.0, 1.0])
    assert (iv.mean, iv.low, iv.high) == (0.5, 0.0, 1.0)
    iv = st.mean_interval([0.0, 1.0], level=0.5)  # quantiles .25 and .75 of that distribution
    assert (iv.low, iv.high) == (0.0, 0.5)
    assert not iv.excludes_zero


def test_difference_interval_by_hand():
    # a-means {2, 2.5, 2.5, 3}, b-means {0, .5, .5, 1}: the 16 differences are
    # 1 (1/16), 1.5 (4/16), 2 (6/16), 2.5 (4/16), 3 (1/16); CDF .0625 .3125 .6875 .9375 1
    iv = st.difference_interval([2.0, 3.0], [0.0, 1.0])
    assert (iv.mean, iv.low, iv.high) == (2.0, 1.0, 3.0)
    assert iv.excludes_zero
    iv = st.difference_interval([2.0, 3.0], [0.0, 1.0], level=0.8)  # quantiles .1 and .9
    assert (iv.low, iv.high) == (1.5, 2.5)
    iv = st.difference_interval([0.0, 1.0], [0.5, 0.5])
    assert (iv.low, iv.high) == (-0.5, 0.5) and not iv.excludes_zero


def test_exact_interval_matches_brute_force_enumeration():
    x = [0.9, 0.2, 0.55, 0.7]
    means = sorted(sum(c) / 4 for c in itertools.product(x, repeat=4))  # 256 equally likely
    lo = means[math.ceil(0.025 * 256) - 1]
    hi = means[math.ceil(0.975 * 256) - 1]
    iv = st.mean_interval(x)
    assert iv.low == pytest.approx(lo, abs=1e-15) and iv.high == pytest.approx(hi, abs=1e-15)


def test_monte_carlo_interval_is_seeded_and_sane():
    x = [0.1, 0.4, 0.35, 0.8, 0.9, 0.2, 0.6, 0.5]  # 8^8 resamples: drawn, not enumerated
    a, b = st.mean_interval(x, seed=3), st.mean_interval(x, seed=3)
    assert a == b
    assert min(x) < a.low < np.mean(x) < a.high < max(x)
    # the normal-theory interval of the mean is close for this spread
    se = np.std(x) / math.sqrt(len(x))
    assert a.low == pytest.approx(np.mean(x) - 1.96 * se, abs=0.03)


def test_curve_band_by_hand():
    mean, low, high = st.curve_band(np.array([[0.0, 1.0, 0.2], [1.0, 1.0, 0.4]]))
    assert mean.tolist() == [0.5, 1.0, pytest.approx(0.3)]
    assert low.tolist() == [0.0, 1.0, 0.2] and high.tolist() == [1.0, 1.0, 0.4]


def test_run_summary_by_hand():
    c = Criteria(ema_alpha=1.0, threshold=0.9, final_window=0.4, collapse_drop=0.3)
    s = run_summary([0.0, 0.0, 1.0, 1.0, 1.0], c)
    assert s == {"final": 1.0, "updates_to_threshold": 3.0, "reached": 1.0, "auc": 0.6,
                 "collapses": 0.0}
    never = run_summary([0.1, 0.2, 0.3], c)
    assert never["updates_to_threshold"] == 4.0 and never["reached"] == 0.0
    assert st.collapses([0, 1, 0.5, 0.9, 0.2, 1], 0.3) == 2
    assert st.ema([1.0, 0.0, 0.0], 0.5).tolist() == [1.0, 0.5, 0.25]


# ---------------------------------------------------------------- report

def _rows(values):
    return [{"step": i, "train/accuracy": v, "reward/mean": 2 * v - 1} for i, v in enumerate(values)]


def test_summary_and_report_say_what_is_resolved(tmp_path):
    cmp = Comparison(tmp_path, ["good", "bad", "noisy"], [0, 1], Criteria(threshold=0.5))
    cmp.runs = {"good": {0: _rows([0.2, 0.9, 1.0, 1.0]), 1: _rows([0.3, 0.8, 1.0, 1.0])},
                "bad": {0: _rows([0.1, 0.1, 0.2, 0.1]), 1: _rows([0.1, 0.2, 0.1, 0.1])},
                "noisy": {0: _rows([0.1, 0.1, 0.1, 0.1]), 1: _rows([0.9, 1.0, 1.0, 1.0])}}
    summary = summarize(cmp)
    pairs = {(p["a"], p["b"]): p for p in summary["metrics"]["final"]["pairs"]}
    assert pairs[("good", "bad")]["resolved"] and pairs[("good", "bad")]["diff"] == 0.9
    assert not pairs[("good", "noisy")]["resolved"]
    assert summary["metrics"]["final"]["methods"]["good"]["values"] == [1.0, 1.0]
    text = report_markdown(cmp, summary, [])
    assert "- resolved: final train/accuracy" in text and "good - bad = 0.9 [0.9, 0.9]" in text
    assert "- not resolved: final train/accuracy (mean of the last 10% of updates): good - noisy" in text


# ---------------------------------------------------------------- arms and the Slurm grid

def test_methods_take_the_whole_objective_section_of_the_preset(tmp_path):
    from megapkl.config import ConfigError, load_config

    ov = method_overrides("grpo")
    assert "objective.name=\"grpo\"" in ov and "objective.eps_clip_high=0.2" in ov
    arms = plan_arms(DEMO, ["grpo", "proximal_kl"], [0, 1], ["train.steps=2"], tmp_path)
    assert [(a.method, a.seed) for a in arms] == [("grpo", 0), ("grpo", 1), ("proximal_kl", 0),
                                                  ("proximal_kl", 1)]
    cfg = load_config(DEMO, arms[1].overrides)
    assert (cfg.objective.name, cfg.seed, cfg.train.steps) == ("grpo", 1, 2)
    assert cfg.run_dir == str(tmp_path / "grpo" / "seed-1")
    pkl = load_config(DEMO, arms[2].overrides).objective
    assert pkl == load_config(DEMO).objective  # the demo's own objective is the PKL preset's
    with pytest.raises(ConfigError, match="unknown method 'nope'.*presets: .*grpo"):
        method_overrides("nope")


def test_slurm_grid_uses_the_local_run_directories(tmp_path):
    from megapkl.launch.compare import slurm_runner

    arms = plan_arms(DEMO, ["pg", "grpo"], [3, 4], [], tmp_path)
    subs = slurm_runner("local_cpu", dry_run=True)(DEMO, arms)
    dirs = [e.run_dir.resolve() for s in subs for e in s.elements]
    assert dirs == [a.run_dir.resolve() for a in arms]
    assert [e.overrides for e in subs[0].elements] == [["seed=3"], ["seed=4"]]


def test_one_seed_is_refused():
    from megapkl.config import ConfigError
    from megapkl.analysis.compare import compare

    with pytest.raises(ConfigError, match="at least 2 seeds"):
        compare(DEMO, ["pg"], [0])


# ---------------------------------------------------------------- a tiny real comparison

def test_tiny_compare_through_the_cli(tmp_path):
    """2 methods x 2 seeds of the demo task, 3 updates each, through `megapkl compare`."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "megapkl.cli", "compare", DEMO, "--methods", "pg,grpo",
           "--seeds", "2", "--out", str(out), "train.steps=3", "rollout.prompts_per_batch=4",
           "rollout.responses_per_prompt=4", "parallel.micro_batch_size=8",
           "logging.progress_bar=false",
           "logging.tensorboard=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for m in ("pg", "grpo"):
        vals = summary["metrics"]["final"]["methods"][m]["values"]
        assert len(vals) == 2 and all(0.0 <= v <= 1.0 for v in vals)
        for s in (0, 1):
            rows = [json.loads(line) for line in (out / m / f"seed-{s}" / "metrics.jsonl").open()]
            assert len(rows) == 3
    # the two seeds are different runs
    pg = [(out / "pg" / f"seed-{s}" / "metrics.jsonl").read_text() for s in (0, 1)]
    assert pg[0] != pg[1]
    report = (out / "report.md").read_text()
    assert "pg - grpo" in report and (out / "curve_train_accuracy.png").is_file()
    assert "pg: final train/accuracy" in res.stdout
