"""PKL C.3 correction variance: eq. C.4-C.5 by hand, and the command end to end on a short CPU
demo run (real megatron-core learner, embedded engine, distributed checkpoint)."""
import json
import math

import pytest
import torch

from megapkl.analysis.diagnose import (correction_variance, first_token_correction, parse_horizons,
                                    variance_table)


def test_first_token_correction_is_eq_c4():
    l = torch.tensor([0.1, -0.02, 0.03, -0.2])
    # beta * sum_{j <= min(H, T)} clip(l_j, -eps, eps), not divided by H
    assert first_token_correction(l, 1, 0.3, 0.05) == pytest.approx(0.3 * 0.05)
    assert first_token_correction(l, 3, 0.3, 0.05) == pytest.approx(0.3 * (0.05 - 0.02 + 0.03))
    assert first_token_correction(l, 64, 0.3, 0.05) == pytest.approx(0.3 * (0.05 - 0.02 + 0.03 - 0.05))
    assert first_token_correction(l, "full", 0.3, None) == pytest.approx(0.3 * (0.1 - 0.02 + 0.03 - 0.2))


def test_correction_variance_is_eq_c5_by_hand():
    # prompt 0: C = 0.3 * [0.05, -0.05] -> var (M - 1) = 2 * 0.015^2 ; prompt 1: C = 0.3 * [0.02, 0.02, 0.05]
    l = [[torch.tensor([0.2]), torch.tensor([-0.1])],
         [torch.tensor([0.02]), torch.tensor([0.02]), torch.tensor([0.07])]]
    v0 = ((0.015 - 0.0) ** 2 + (-0.015 - 0.0) ** 2) / 1
    c1 = [0.006, 0.006, 0.015]
    m1 = sum(c1) / 3
    v1 = sum((c - m1) ** 2 for c in c1) / 2
    assert correction_variance(l, 1, 0.3, 0.05) == pytest.approx((v0 + v1) / 2)
    table = variance_table(l, [1, "full"], 0.3, 0.05)
    assert table["1"] == pytest.approx((v0 + v1) / 2 / 1e-3)   # reported in 1e-3 units
    with pytest.raises(ValueError, match="at least 2 responses"):
        correction_variance([[torch.tensor([0.1])]], 1, 0.3, 0.05)


def test_variance_grows_with_the_horizon_for_independent_costs():
    """With i.i.d. per-token costs, V(H) grows with H until the responses end (why truncation helps)."""
    g = torch.Generator().manual_seed(0)
    l = [[torch.randn(40, generator=g) * 0.03 for _ in range(16)] for _ in range(16)]
    t = variance_table(l, [1, 4, 16, "full"], 0.3, 0.05)
    assert t["1"] < t["4"] < t["16"] < t["full"]


def test_parse_horizons():
    assert parse_horizons("1,8,full") == [1, 8, "full"]
    with pytest.raises(ValueError, match="--horizons"):
        parse_horizons("0,8")


def _diagnose(run_dir, out):
    from megapkl.cli import main

    return main(["diagnose", "correction-variance", str(run_dir), "--prompts", "4", "--responses", "4",
                 "--horizons", "1,2,full", "logging.progress_bar=false", "--max-response-len", "6",
                 "--out", str(out)])


def test_command_on_a_short_demo_run(dist_run, tmp_path):
    from megapkl.config import load_config
    from megapkl.train.local import _rank_main

    cfg = load_config("configs/demo/cpu_demo.yaml", [
        "parallel.data=1", "train.steps=4", f"run_dir={tmp_path / 'run'}", "checkpoint.every=0",
        "logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=4", "parallel.micro_batch_size=16", "train.lr=0.05",
        "objective.beta=0.2", "objective.cost_clip=0.1"])
    dist_run(_rank_main, 1, cfg, timeout=300)
    out = tmp_path / "cv.json"
    dist_run(lambda rank, world: _diagnose(tmp_path / "run", out), 1, timeout=300)
    res = json.loads(out.read_text())
    assert res["current"].endswith("step_00000004") and res["reference"] == "init", res
    assert (res["beta"], res["eps_F"]) == (0.2, 0.1)  # the run's objective.beta, cost_clip
    v = res["V"]
    assert set(v) == {"1", "2", "full"} and all(math.isfinite(x) and x >= 0 for x in v.values())
    assert v["1"] > 0, "the trained policy differs from its initial weights: corrections vary"
    # against the initial weights themselves every log-ratio is 0: no variance at all
    out0 = tmp_path / "cv0.json"
    from megapkl.cli import main
    dist_run(lambda rank, world: main(["diagnose", "correction-variance", str(tmp_path / "run"),
                                       "--checkpoint", "init", "--prompts", "2", "--responses", "2",
                                       "--horizons", "full", "--out", str(out0)]), 1, timeout=300)
    assert json.loads(out0.read_text())["V"] == {"full": 0.0}
