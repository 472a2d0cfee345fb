"""`megapkl` CLI: config show / validate, exit codes, the train/demo placeholders, the entry point."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_config_validate(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {train_path: x.jsonl}\nrollout: {protocol: uniform_stale}\n")
    assert main(["config", "validate", GRPO, DEMO]) == 0
    assert capsys.readouterr().out.count("ok: ") == 2
    assert main(["config", "validate", GRPO, str(bad)]) == EXIT_CONFIG
    captured = capsys.readouterr()
    assert "ok: " in captured.out
    assert "rollout.max_staleness" in captured.err and captured.err.count("\n") == 1
    assert main(["config", "validate", GRPO, "--set", "objective.name=tetpo"]) == 0
    assert main(["config", "validate", GRPO, "--set", "objective.name=tetpo",
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
