"""Train-inference mismatch metrics: hand values, and the trainer's log at a fresh version (fp32
embedded engine: none; FP8 rollouts: measurable)."""
from __future__ import annotations

import math

import pytest
import torch

from megapkl.train.mismatch import mismatch_metrics, routing_differs


def test_hand_values():
    behav = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    trainer = [torch.tensor([-1.0, -1.8]), torch.tensor([-0.55])]
    d = [0.0, 0.2, -0.05]
    m = mismatch_metrics(behav, trainer)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.expm1(x) - x for x in d) / 3, rel=1e-6)
    assert m["mismatch/abs_log_ratio_mean"] == pytest.approx(0.25 / 3, rel=1e-6)
    assert m["mismatch/abs_log_ratio_max"] == pytest.approx(0.2, rel=1e-6)
    assert m["mismatch/frac_gt_0.1"] == pytest.approx(1 / 3)
    assert m["mismatch/tokens"] == 3 and "mismatch/routing_disagree" not in m
    assert mismatch_metrics([], []) == {}
    with pytest.raises(ValueError, match="response 0"):
        mismatch_metrics([torch.zeros(2)], [torch.zeros(3)])


def test_routing_disagreement_compares_expert_sets():
    e_b = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 0], [3, 2]]])  # [rows, layers, k]
    e_t = torch.tensor([[[1, 0], [2, 3]], [[0, 1], [2, 1]], [[0, 1], [2, 3]]])
    assert routing_differs(e_b, e_t).tolist() == [False, True, False]
    m = mismatch_metrics([torch.zeros(1)], [torch.zeros(1)], [e_b], [e_t])
    assert m["mismatch/routing_disagree"] == pytest.approx(1 / 3)


def test_trainer_logs_mismatch_at_fresh_versions(dist_run, tmp_path):
    from megapkl.config import load_config
    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    base = ["logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
            "rollout.responses_per_prompt=4", "rollout.max_response_len=4",
            "parallel.micro_batch_size=8", "checkpoint.every=0", "train.steps=2",
            "rollout.refresh_every=2"]
    rows = {}
    for name, extra in (("fp32", []), ("fp8", ["rollout.fp8=true"])):
        cfg = load_config("configs/demo/cpu_demo.yaml", [*base, *extra, f"run_dir={tmp_path / name}"])
        dist_run(_rank_main, 1, cfg, timeout=300)
        rows[name] = read_metrics(cfg.run_dir)
    for r in rows.values():  # refresh every 2: update 0 holds the behavior version, update 1 not
        assert "mismatch/k3_kl" in r[0] and "mismatch/k3_kl" not in r[1]
        assert r[0]["rollout/versions_loaded"] == 1.0
    exact, fp8 = rows["fp32"][0], rows["fp8"][0]
    print(f"trainer mismatch at a fresh version: fp32 k3 {exact['mismatch/k3_kl']:.3g} max |d| "
          f"{exact['mismatch/abs_log_ratio_max']:.3g}; fp8 k3 {fp8['mismatch/k3_kl']:.3g} max |d| "
          f"{fp8['mismatch/abs_log_ratio_max']:.3g}")
    assert exact["mismatch/k3_kl"] < 1e-6
    assert fp8["mismatch/k3_kl"] > 100 * max(exact["mismatch/k3_kl"], 1e-10)
