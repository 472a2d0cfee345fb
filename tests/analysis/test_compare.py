"""`megapkl compare`: per-run summaries, paired tables and the report, arms that are exactly their
presets, the Slurm grid (dry run), and a tiny real paired comparison through the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megapkl.analysis import compare_stats as st
from megapkl.analysis.compare import (Arm, Comparison, Criteria, method_overrides, plan_arms,
                                      report_markdown, run_summary, smoothing, summarize)

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo" / "cpu_demo.yaml")
STUDY = str(ROOT / "configs" / "study" / "repeat_next.yaml")


# ---------------------------------------------------------------- summaries and the report

def _rows(values, eval_every=0):
    rows = [{"step": i, "train/accuracy": v, "reward/mean": 2 * v - 1} for i, v in enumerate(values)]
    if eval_every:
        for i, r in enumerate(rows):
            if (i + 1) % eval_every == 0:
                r["eval/micro_avg/accuracy"] = min(1.0, values[i] + 0.05)
                r["eval/version"] = i + 1
    return rows


def test_run_summary_by_hand():
    c = Criteria(metric="train/accuracy", ema_alpha=1.0, threshold=0.9, final_window=0.4)
    s = run_summary(_rows([0.0, 0.0, 1.0, 1.0, 1.0]), "train/accuracy", c)
    assert s == {"final": 1.0, "auc": 0.6, "updates_to_threshold": 3.0, "length": 5,
                 "collapsed": False}
    never = run_summary(_rows([0.1, 0.2, 0.3]), "train/accuracy", c)
    assert never["updates_to_threshold"] is None
    # evaluation points sit at the version they evaluated: updates 2 and 4
    ev = run_summary(_rows([0.1, 0.5, 0.7, 0.95], eval_every=2), "eval/micro_avg/accuracy", c)
    assert ev["updates_to_threshold"] == 4.0 and ev["auc"] == pytest.approx((0.55 + 1.0) / 2)
    # an evaluation every 10 updates is smoothed with the time constant of alpha per update
    assert smoothing([1, 2, 3], 0.2) == pytest.approx(0.2)
    assert smoothing([0, 10, 20, 30], 0.2) == pytest.approx(1 - 0.8 ** 10)
    slow = Criteria(metric="eval/micro_avg/accuracy", ema_alpha=0.2, threshold=0.85)
    rows = _rows([0.0] * 10 + [0.95] * 10, eval_every=10)  # points 0.05 at 10, 1.0 at 20
    assert run_summary(rows, "eval/micro_avg/accuracy", slow)["updates_to_threshold"] == 20.0


def test_summary_pairs_by_seed_adjusts_and_says_what_is_resolved(tmp_path):
    cmp = Comparison(tmp_path, ["good", "bad", "noisy"], [0, 1, 2],
                     Criteria(metric="train/accuracy", threshold=0.5))
    cmp.runs = {"good": {0: _rows([0.2, 0.9, 1.0, 1.0]), 1: _rows([0.3, 0.8, 0.9, 0.9]),
                         2: _rows([0.2, 0.6, 0.8, 0.8])},
                "bad": {0: _rows([0.1, 0.1, 0.2, 0.1]), 1: _rows([0.1, 0.2, 0.1, 0.0]),
                        2: _rows([0.1, 0.0, 0.0, 0.0])},
                "noisy": {0: _rows([0.1, 0.1, 0.1, 0.1]), 1: _rows([0.9, 1.0, 1.0, 1.0]),
                          2: _rows([0.5, 0.5, 0.5, 0.5])}}
    summary = summarize(cmp)
    block = summary["metrics"]["train/accuracy"]
    assert block["methods"]["good"]["final"]["values"] == [1.0, 0.9, 0.8]
    pairs = {(p["a"], p["b"]): p for p in block["pairs"]["final"]}
    gb = pairs[("good", "bad")]  # per seed 0.9, 0.9, 0.8: paired t on these three
    ref = st.paired_t([1.0, 0.9, 0.8], [0.1, 0.0, 0.0])
    assert gb["diff"] == pytest.approx(0.8667, abs=1e-4) and gb["p"] == pytest.approx(ref.p)
    holm = st.holm([p["p"] for p in block["pairs"]["final"]])
    assert [p["p_holm"] for p in block["pairs"]["final"]] == pytest.approx(holm)
    assert gb["resolved"] and not pairs[("good", "noisy")]["resolved"]
    reach = block["methods"]["bad"]["updates_to_threshold"]
    assert (reach["reached"], reach["median"]) == (0, None)
    text = report_markdown(cmp, summary, [])
    assert "- resolved: final train/accuracy" in text and "good - bad = 0.867" in text
    assert "| bad | 0 of 3 | - |" in text
    assert "- not resolved: final train/accuracy (mean of the last 10% of its points): good - noisy" in text


def test_primary_metric_is_the_evaluation_when_logged(tmp_path):
    from megapkl.analysis.compare import load_comparison

    for m in ("a", "b"):
        for s in (0, 1):
            d = tmp_path / m / f"seed-{s}"
            d.mkdir(parents=True)
            rows = _rows([0.1 * s, 0.5, 0.6 + 0.1 * (m == "a"), 0.9], eval_every=2)
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    arms = [Arm(m, s, [], tmp_path / m / f"seed-{s}") for m in ("a", "b") for s in (0, 1)]
    cmp = load_comparison(tmp_path, arms, Criteria())
    assert cmp.criteria.metric == "eval/micro_avg/accuracy"
    summary = summarize(cmp)
    assert summary["primary"] == "eval/micro_avg/accuracy"
    assert set(summary["metrics"]) == {"eval/micro_avg/accuracy", "train/accuracy"}
    text = report_markdown(cmp, summary, [])
    assert "(secondary: the batches trained on" in text
    (tmp_path / "b" / "seed-1" / "metrics.jsonl").write_text(json.dumps(_rows([0.5])[0]) + "\n")
    assert load_comparison(tmp_path, arms, Criteria()).criteria.metric == "train/accuracy"


# ---------------------------------------------------------------- arms and the Slurm grid

PRESETS = ROOT / "configs" / "objectives"
# the study's arms (configs/study/*.yaml presets included), and the demo's
ARMS = [(STUDY, str(PRESETS / f"{m}.yaml")) for m in ("pg", "grpo", "proximal_kl", "sis_grpo", "gspo",
                                                      "sis_gspo", "tetpo", "gepo", "m2po", "dapo")]
ARMS += [(STUDY, str(ROOT / "configs" / "study" / "proximal_kl_h4.yaml"))]
ARMS += [(DEMO, str(PRESETS / f"{m}.yaml")) for m in ("pg", "grpo", "sis_dapo")]


@pytest.mark.parametrize("base,preset", ARMS, ids=[f"{Path(b).stem}+{Path(p).stem}" for b, p in ARMS])
def test_arm_is_config_show_of_its_preset_on_the_base(base, preset, tmp_path, capsys):
    """An arm resolves exactly like `megapkl config show` of `extends: [BASE, PRESET]` with the
    comparison's overrides: every section the preset sets, nothing of default.yaml again."""
    from megapkl.cli import main
    from megapkl.config import dump_config, load_config

    user = ["train.steps=7"]
    for arm in plan_arms(base, [preset], [3], user, tmp_path / "cmp"):
        combined = tmp_path / "combined.yaml"
        combined.write_text("extends: " + json.dumps([base, preset]) + "\n")
        own = arm.overrides[arm.overrides.index(user[0]):]  # the comparison's, seed, name, run_dir
        assert main(["config", "show", str(combined), *own]) == 0
        shown = capsys.readouterr().out
        assert dump_config(load_config(base, arm.overrides)) == shown, arm.method


def test_arms_carry_every_section_and_command_line_overrides_win(tmp_path):
    from megapkl.config import ConfigError, load_config

    def arm(method, *over):
        a = plan_arms(STUDY, [method], [0, 1], list(over), tmp_path)[0]
        return load_config(STUDY, a.overrides)

    assert arm("dapo").advantage.filter_constant_groups          # dynamic sampling comes along
    assert not arm("grpo").advantage.filter_constant_groups
    assert (arm("sis_grpo").objective.kl_init_coef, arm("grpo").objective.kl_init_coef) == (1e-3, 0.0)
    matched = arm("sis_grpo", "objective.kl_init_coef=0.0")       # one setting for every arm
    assert matched.objective.kl_init_coef == 0.0 and matched.objective.sis.enabled
    ov = method_overrides("grpo", STUDY)
    assert 'objective.name="grpo"' in ov and not any(o.startswith("name=") for o in ov)
    arms = plan_arms(DEMO, ["grpo", "proximal_kl"], [0, 1], ["train.steps=2"], tmp_path)
    assert [(a.method, a.seed) for a in arms] == [("grpo", 0), ("grpo", 1), ("proximal_kl", 0),
                                                  ("proximal_kl", 1)]
    cfg = load_config(DEMO, arms[1].overrides)
    assert (cfg.objective.name, cfg.seed, cfg.train.steps) == ("grpo", 1, 2)
    assert cfg.run_dir == str(tmp_path / "grpo" / "seed-1")
    with pytest.raises(ConfigError, match="unknown method 'nope'.*presets: .*grpo"):
        method_overrides("nope", DEMO)


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

def test_tiny_paired_compare_through_the_cli(tmp_path):
    """2 methods x 2 seeds of the study task, 3 updates each with an evaluation of the current
    policy every update, through `megapkl compare`: the evaluation is the primary metric, the
    differences are paired by seed, and the report and summary agree with the runs."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "megapkl.cli", "compare", STUDY, "--methods", "pg,grpo",
           "--seeds", "2", "--out", str(out), "train.steps=3", "rollout.prompts_per_batch=4",
           "rollout.minibatches_per_batch=1", "rollout.responses_per_prompt=4",
           "parallel.micro_batch_size=8", "eval.every=1", "eval.at_start=false",
           "eval.benchmarks=[{name: repeat_next_8, greedy: false, n_samples: 2}]"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["primary"] == "eval/micro_avg/accuracy"
    block = summary["metrics"]["eval/micro_avg/accuracy"]
    for m in ("pg", "grpo"):
        for s in (0, 1):
            rows = [json.loads(line) for line in (out / m / f"seed-{s}" / "metrics.jsonl").open()]
            assert len(rows) == 3 and [r["eval/version"] for r in rows] == [1, 2, 3]
            evals = [r["eval/micro_avg/accuracy"] for r in rows]
            assert block["methods"][m]["auc"]["values"][s] == pytest.approx(sum(evals) / 3)
    pair = block["pairs"]["auc"][0]
    ref = st.paired_t(block["methods"]["pg"]["auc"]["values"], block["methods"]["grpo"]["auc"]["values"])
    assert (pair["a"], pair["b"], pair["diff"], pair["p_holm"]) == ("pg", "grpo", ref.diff, ref.p)
    # the two seeds are different runs
    pg = [(out / "pg" / f"seed-{s}" / "metrics.jsonl").read_text() for s in (0, 1)]
    assert pg[0] != pg[1]
    report = (out / "report.md").read_text()
    assert "pg - grpo" in report and "paired by seed" in report
    assert (out / "curve_eval_micro_avg_accuracy.png").is_file()
    assert "pg: final eval/micro_avg/accuracy" in res.stdout
