"""Metrics JSONL/TensorBoard logging and EMA plots."""
import io

import pytest

from megapkl.train.metrics_log import MetricsLogger, progress_line, read_metrics
from megapkl.analysis.plot import ema, plot_runs


def write_run(path, slope, steps=30, tb=False):
    log = MetricsLogger(path, tensorboard=tb, progress=True, total_steps=steps, stream=io.StringIO())
    for u in range(steps):
        log.log(u, {"train/accuracy": min(1.0, 0.1 + slope * u), "reward/mean": -0.8 + 2 * slope * u,
                    "grad_norm": 1.0 / (u + 1), "loss": float("nan") if u == 3 else 0.1})
    out = log.stream.getvalue()
    log.close()
    return out


def test_jsonl_rows_tensorboard_and_progress(tmp_path):
    out = write_run(tmp_path / "a", 0.01, tb=True)
    rows = read_metrics(tmp_path / "a")
    assert [r["step"] for r in rows] == list(range(30))
    assert rows[5]["train/accuracy"] == pytest.approx(0.15)
    assert rows[3]["loss"] == "nan"  # non-finite values stay readable JSON
    assert list((tmp_path / "a" / "tensorboard").glob("events.out.tfevents.*"))
    assert "step 30/30" in out and "acc 0.390" in out


def test_malformed_metrics_line_names_file_and_line(tmp_path):
    write_run(tmp_path / "a", 0.01, steps=3)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:4: malformed"):
        read_metrics(tmp_path / "a")


def test_ema_hand_values():
    assert ema([1.0, 3.0, float("nan"), 5.0], 0.5) == [1.0, 2.0, 2.0, 3.5]


def test_plot_two_runs_writes_pngs(tmp_path):
    write_run(tmp_path / "pkl", 0.02)
    write_run(tmp_path / "grpo", 0.01)
    files = plot_runs([tmp_path / "pkl", tmp_path / "grpo"], tmp_path / "plots")
    names = {f.name for f in files}
    assert {"train_accuracy.png", "reward_mean.png", "grad_norm.png", "overview.png"} <= names
    assert all(f.stat().st_size > 5000 for f in files)


def test_progress_line_format():
    line = progress_line(11, 60, {"reward/mean": -0.41, "train/accuracy": 0.295, "tokens_per_s": 153.2})
    assert line == "step 12/60 | reward -0.410 | acc 0.295 | tok/s 153"
