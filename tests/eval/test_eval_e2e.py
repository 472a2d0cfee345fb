"""End to end on the CPU demo config (tiny sizes): training with in-training evaluation writes
eval files and metrics, leaves the checkpoint, and `megapkl eval` of that checkpoint (a separate
process: checkpoint load, HF export, engine push) reproduces the in-training numbers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megapkl.cli import demo_config_path
from megapkl.eval.metrics import summarize
from megapkl.train.metrics_log import read_metrics

STEPS = 4


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("evalrun") / "demo"
    overrides = [f"run_dir={run}", f"train.steps={STEPS}", "parallel.data=1",
                 "rollout.prompts_per_batch=8", "rollout.responses_per_prompt=4",
                 "logging.progress_bar=false", "logging.tensorboard=false",
                 "eval.every=2", "eval.at_start=true", "eval.benchmarks=[next_mod10]",
                 "eval.n_samples=4"]
    # the trainer runs in its own process (torch.distributed state stays out of pytest's)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megapkl.cli", "train", demo_config_path(), *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_in_training_eval_files_and_metrics(demo_run):
    files = sorted(p.name for p in (demo_run / "eval").iterdir())
    assert files == [f"step_{v:06d}{ext}" for v in (0, 2, 4) for ext in (".json", ".samples.jsonl")]
    rows = read_metrics(demo_run)
    evals = {int(r["eval/version"]): r for r in rows if "eval/version" in r}
    assert sorted(evals) == [0, 2, 4]
    assert [r["step"] for r in rows if "eval/version" in r] == [0, 1, 3]  # the row of the update
    for v, row in evals.items():
        summary = json.loads((demo_run / "eval" / f"step_{v:06d}.json").read_text())
        samples = [json.loads(x) for x in
                   (demo_run / "eval" / f"step_{v:06d}.samples.jsonl").read_text().splitlines()]
        assert len(samples) == 40  # next_mod10 has ten distinct prompts, 4 samples each
        # every number is recomputable from the samples file
        grid = {}
        for s in samples:
            grid.setdefault(s["prompt_id"], []).append(s["correct"])
        recomputed = summarize(list(grid.values()), ks=[1, 2, 4])
        bench = summary["benchmarks"]["next_mod10"]
        for key in ("mean@4", "pass@1", "pass@2", "pass@4", "accuracy"):
            assert bench[key] == pytest.approx(recomputed[key])
            assert row[f"eval/next_mod10/{key}"] == pytest.approx(recomputed[key])
        assert row["eval/micro_avg/accuracy"] == pytest.approx(recomputed["accuracy"])
        for s in samples:
            gold = str((int(s["prompt_id"]) + 1) % 10)
            assert s["gold"] == gold and s["correct"] == (s["extracted"] == gold)


def test_megapkl_eval_of_the_checkpoint_matches_in_training_eval(demo_run, tmp_path):
    out = tmp_path / "cli_eval"
    cmd = [sys.executable, "-m", "megapkl.cli", "eval", str(demo_run), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"(update {STEPS})" in r.stdout and "next_mod10" in r.stdout
    cli = json.loads((out / f"step_{STEPS:06d}.json").read_text())
    train = json.loads((demo_run / "eval" / f"step_{STEPS:06d}.json").read_text())
    assert cli["benchmarks"] == train["benchmarks"]
    lines = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    assert lines(out / f"step_{STEPS:06d}.samples.jsonl") == \
        lines(demo_run / "eval" / f"step_{STEPS:06d}.samples.jsonl")


def test_megapkl_eval_errors_are_one_line(tmp_path):
    from megapkl.cli import main

    assert main(["eval", str(tmp_path)]) == 2


def test_plot_draws_eval_curves(demo_run, tmp_path):
    from megapkl.train.plot import _series, plot_runs

    files = {p.name for p in plot_runs([demo_run], tmp_path / "plots")}
    assert {"eval_next_mod10_mean@4.png", "eval_micro_avg_accuracy.png", "eval_overview.png",
            "overview.png"} <= files
    steps, _ = _series(read_metrics(demo_run), "eval/next_mod10/mean@4")
    assert steps == [0, 2, 4]  # drawn at the number of updates applied
