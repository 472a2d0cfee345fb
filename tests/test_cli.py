"""`megapkl` CLI: config show / validate, exit codes, the train/demo placeholders, the entry point."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from job_inputs import job_inputs

from megapkl.cli import EXIT_CONFIG, main
from megapkl.config import configs_dir, load_config, loads_config

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(configs_dir() / "objectives" / "grpo.yaml")
DEMO = str(configs_dir() / "demo" / "cpu_demo.yaml")


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", GRPO, "objective.eps_clip_high=0.3", "train.lr=2e-6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# megapkl resolved run config")
    cfg = loads_config(out)
    assert cfg == load_config(GRPO, ["objective.eps_clip_high=0.3", "train.lr=2e-6"])
    assert cfg.objective.name == "grpo" and cfg.objective.eps_clip_high == 0.3


def test_config_show_bad_config_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {GRPO}\nobjective:\n  bta: 0.3\n")
    assert main(["config", "show", str(bad)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "bad.yaml:3: objective.bta: unknown key 'bta'; did you mean 'beta'?" in err


def test_config_show_bad_override_exit_2(capsys):
    assert main(["config", "show", GRPO, "rollout.top_p=2"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("megapkl: error: <override>: rollout.top_p: must be <= 1.0")


def test_config_validate(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {train_path: x.jsonl}\nrollout: {protocol: uniform_stale}\n")
    # validate checks the checkpoint and the prompt files the config names from here
    weights = job_inputs(tmp_path, "dapo_math_17k.jsonl")[0]
    monkeypatch.chdir(tmp_path)
    assert main(["config", "validate", GRPO, DEMO, weights]) == 0
    assert capsys.readouterr().out.count("ok: ") == 2
    assert main(["config", "validate", GRPO, str(bad), weights]) == EXIT_CONFIG
    captured = capsys.readouterr()
    assert "ok: " in captured.out
    assert "rollout.max_staleness" in captured.err and captured.err.count("\n") == 1
    assert main(["config", "validate", GRPO, weights, "--set", "objective.name=tetpo"]) == 0
    assert main(["config", "validate", GRPO, weights, "--set", "objective.name=tetpo",
                 "--set", "objective.aggregation=token_mean"]) == EXIT_CONFIG
    assert "objective.aggregation" in capsys.readouterr().err


def test_train_validates_first(capsys):
    assert main(["train", GRPO, "train.stepz=5"]) == EXIT_CONFIG
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_demo_validates_first(capsys):
    assert main(["demo", "--compare", "objective.bta=0.1"]) == EXIT_CONFIG
    assert "did you mean 'beta'" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["config"], ["config", "show"], ["nonsense"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_entry_point_subprocess_and_no_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "megapkl.cli", "config", "show", GRPO],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert loads_config(proc.stdout).objective.name == "grpo"
    probe = ("import sys; from megapkl.cli import main; rc = main(['config', 'show', sys.argv[1]]);"
             "sys.exit(rc or (3 if 'torch' in sys.modules else 0))")
    proc = subprocess.run([sys.executable, "-c", probe, GRPO], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, "config show imported torch" if proc.returncode == 3 else proc.stderr


# ---- the error boundary: every user error is one line `megapkl: error: ...`, --debug shows more


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megapkl: error: "), err
    return lines[0]


def test_tensor_parallel_not_dividing_heads_is_a_config_error(capsys):
    """TP = 3 on tiny-qwen3 (4 attention heads): caught at validation, naming parallel.tensor."""
    assert main(["config", "validate", DEMO, "parallel.tensor=3"]) == EXIT_CONFIG
    line = _one_error_line(capsys.readouterr().err)
    assert "<override>: parallel.tensor:" in line and "num_attention_heads = 4" in line
    assert main(["train", DEMO, "parallel.tensor=3", "parallel.data=1"]) == EXIT_CONFIG
    assert "parallel.tensor" in _one_error_line(capsys.readouterr().err)
    assert main(["config", "validate", DEMO, "parallel.tensor=2"]) == 0  # 4 heads, 2 KV groups
    capsys.readouterr()


def test_model_layout_rules_from_the_model_yaml(capsys):
    moe = ["model.name=tiny-qwen3-moe", "parallel.data=1"]
    assert main(["config", "validate", DEMO, *moe, "parallel.expert=3"]) == EXIT_CONFIG
    assert "parallel.expert" in _one_error_line(capsys.readouterr().err)
    assert main(["config", "validate", DEMO, *moe, "parallel.tensor=2"]) == EXIT_CONFIG
    assert "parallel.sequence_parallel" in _one_error_line(capsys.readouterr().err)
    assert main(["config", "validate", DEMO, "model.arch={num_attention_heads: 6, "
                 "num_query_groups: 6}", "parallel.tensor=4"]) == EXIT_CONFIG
    assert "num_attention_heads = 6" in _one_error_line(capsys.readouterr().err)


def test_config_validate_takes_dotted_overrides_positionally(capsys, tmp_path, monkeypatch):
    weights = job_inputs(tmp_path, "dapo_math_17k.jsonl")[0]
    monkeypatch.chdir(tmp_path)
    assert main(["config", "validate", GRPO, weights, "objective.name=tetpo"]) == 0
    assert "ok: " in capsys.readouterr().out
    assert main(["config", "validate", GRPO, DEMO, weights, "objective.name=tetpo",
                 "objective.aggregation=token_mean"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("megapkl: error:") == 2 and "objective.aggregation" in err
    assert main(["config", "validate", "objective.beta=0.3"]) == EXIT_CONFIG
    assert "no config file" in _one_error_line(capsys.readouterr().err)


def test_resume_from_a_missing_directory_is_one_line(capsys, tmp_path):
    missing = tmp_path / "nope" / "step_00000010"
    rc = main(["train", DEMO, f"run_dir={tmp_path / 'run'}", f"checkpoint.resume={missing}"])
    assert rc == 1
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpoint.resume: {missing} does not exist" in line


def test_other_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MEGAPKL_DEBUG", None)
    argv = [sys.executable, "-m", "megapkl.cli", "plot", str(tmp_path / "no_such_run"),
            "--out", str(tmp_path / "plots")]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert "no_such_run" in line and "--debug shows the traceback" in line
    proc = subprocess.run(argv + ["--debug"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("megapkl: error: ")


def test_describe_keeps_a_forked_rank_error_to_its_last_line():
    from megapkl.cli import describe
    from megapkl.parallel.forked import WorkerError

    exc = WorkerError("rank 1 of 2 failed:\nTraceback (most recent call last):\n  File \"x.py\", "
                      "line 3, in f\n    boom()\nValueError: the real reason")
    assert describe(exc) == "rank 1 of 2 failed: ValueError: the real reason"
    assert describe(KeyError("k")) == "KeyError: 'k'"
