"""End to end on the CPU demo config (tiny sizes, data parallel 2 as the demo): training with
in-training evaluation writes eval files and metrics and leaves a checkpoint; `megapkl eval` of
that checkpoint (a separate process: single-rank reshard of the distributed checkpoint, HF export,
engine push) reproduces the in-training greedy numbers sample for sample."""
import json
import os
import subprocess
import sys

import pytest

from megapkl.cli import demo_config_path
from megapkl.eval.metrics import summarize
from megapkl.train.metrics_log import read_metrics

STEPS = 4
BENCHMARKS = "eval.benchmarks=[{name: next_mod10, greedy: true}, {name: add_mod10, n_samples: 4}]"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def megapkl(*args):
    """The CLI in its own process (torch.distributed state stays out of pytest's)."""
    r = subprocess.run([sys.executable, "-m", "megapkl.cli", *args], capture_output=True, text=True,
                       timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


TRAIN = [f"train.steps={STEPS}", "rollout.prompts_per_batch=8", "rollout.responses_per_prompt=4",
         "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("evalrun") / "demo"
    megapkl("train", demo_config_path(), f"run_dir={run}", *TRAIN, "eval.every=2",
            "eval.at_start=true", BENCHMARKS)
    return run


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_in_training_eval_files_and_metrics(demo_run):
    files = sorted(p.name for p in (demo_run / "eval").iterdir())
    assert files == [f"step_{v:06d}{ext}" for v in (0, 2, 4) for ext in (".json", ".samples.jsonl")]
    rows = read_metrics(demo_run)
    evals = {int(r["eval/version"]): r for r in rows if "eval/version" in r}
    assert sorted(evals) == [0, 2, 4]
    assert [r["step"] for r in rows if "eval/version" in r] == [0, 1, 3]  # the row of the update
    for v, row in evals.items():
        summary = json.loads((demo_run / "eval" / f"step_{v:06d}.json").read_text())
        samples = read_jsonl(demo_run / "eval" / f"step_{v:06d}.samples.jsonl")
        grids = {"next_mod10": {}, "add_mod10": {}}
        for s in samples:
            grids[s["benchmark"]].setdefault(s["prompt_id"], []).append(s["correct"])
            assert s["correct"] == (s["extracted"] == s["gold"])
        # ten distinct next_mod10 prompts x 1 greedy sample, 100 add_mod10 prompts x 4 samples
        assert sorted(map(len, grids["next_mod10"].values())) == [1] * 10
        assert sorted(map(len, grids["add_mod10"].values())) == [4] * 100
        # every number is recomputable from the samples file, in the summary and metrics.jsonl
        greedy = summarize(list(grids["next_mod10"].values()), greedy=True)
        sampled = summarize(list(grids["add_mod10"].values()), ks=[1, 2, 4])
        for bench, ref, keys in (("next_mod10", greedy, ["pass@1_greedy"]),
                                 ("add_mod10", sampled, ["mean@4", "pass@1", "pass@2", "pass@4"])):
            for key in keys + ["accuracy"]:
                assert summary["benchmarks"][bench][key] == pytest.approx(ref[key])
                assert row[f"eval/{bench}/{key}"] == pytest.approx(ref[key])
        micro = (greedy["num_correct"] + sampled["num_correct"]) / 410
        assert row["eval/micro_avg/accuracy"] == pytest.approx(micro)


def test_evaluation_does_not_change_training(demo_run, tmp_path):
    plain = tmp_path / "plain"
    megapkl("train", demo_config_path(), f"run_dir={plain}", *TRAIN)
    # eval pushes the live weights into the engine, so the rollout stage reloads its policy
    # version from the store afterwards: `rollout/versions_loaded` counts that load; the training
    # itself must not change at all
    skip = ("eval/", "time", "tokens_per_s", "rollout/versions_loaded")
    strip = lambda rows: [{k: v for k, v in r.items()  # noqa: E731
                           if not k.startswith(skip)} for r in rows]
    with_eval, without = strip(read_metrics(demo_run)), strip(read_metrics(plain))
    assert len(with_eval) == STEPS and with_eval == without


def test_megapkl_eval_of_the_checkpoint_matches_in_training_eval(demo_run, tmp_path):
    out = tmp_path / "cli_eval"
    stdout = megapkl("eval", str(demo_run), "--out", str(out), "--benchmarks", "next_mod10")
    assert f"(update {STEPS})" in stdout and "next_mod10" in stdout
    cli = json.loads((out / f"step_{STEPS:06d}.json").read_text())
    train = json.loads((demo_run / "eval" / f"step_{STEPS:06d}.json").read_text())
    assert cli["benchmarks"]["next_mod10"] == train["benchmarks"]["next_mod10"]
    greedy = [s for s in read_jsonl(demo_run / "eval" / f"step_{STEPS:06d}.samples.jsonl")
              if s["benchmark"] == "next_mod10"]
    assert read_jsonl(out / f"step_{STEPS:06d}.samples.jsonl") == greedy


def test_megapkl_eval_writes_beside_the_runs_own_record(demo_run):
    """Without --out: RUN_DIR/eval-cli, the run's in-training RUN_DIR/eval untouched; a KEY=VALUE
    after the options is an override."""
    own = {p.name: p.read_bytes() for p in (demo_run / "eval").iterdir()}
    stdout = megapkl("eval", str(demo_run), "--step", str(STEPS), "eval.n_samples=2",
                     "--benchmarks", "add_mod10")
    assert "rollouts: the embedded engine" in stdout
    assert {p.name: p.read_bytes() for p in (demo_run / "eval").iterdir()} == own
    cli = json.loads((demo_run / "eval-cli" / f"step_{STEPS:06d}.json").read_text())
    bench = cli["benchmarks"]["add_mod10"]
    assert list(cli["benchmarks"]) == ["add_mod10"]
    assert bench["num_samples"] == 2 * bench["num_prompts"]  # n_samples 4 in training


def test_megapkl_eval_errors_are_one_line(tmp_path, capsys):
    from megapkl.cli import main

    assert main(["eval", str(tmp_path)]) == 2
    assert "neither a megapkl run directory" in capsys.readouterr().err


def test_plot_draws_eval_curves(demo_run, tmp_path):
    from megapkl.analysis.plot import _series, plot_runs

    files = {p.name for p in plot_runs([demo_run], tmp_path / "plots", metrics=("train/accuracy",))}
    assert {"eval_add_mod10_mean@4.png", "eval_next_mod10_pass@1_greedy.png",
            "eval_micro_avg_accuracy.png", "eval_overview.png", "overview.png"} <= files
    steps, _ = _series(read_metrics(demo_run), "eval/add_mod10/mean@4")
    assert steps == [0, 2, 4]  # drawn at the number of updates applied
