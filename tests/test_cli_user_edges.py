"""What a user's command line meets at the edges: KEY=VALUE anywhere on the line, `train` into a
directory that holds a run, `plan` before any download, the Slurm keys' precedence."""
from __future__ import annotations

from pathlib import Path

import pytest

from megapkl.cli import build_parser, main
from megapkl.config import configs_dir, load_config
from megapkl.train.local import claim_run_dir

DEMO = str(configs_dir() / "demo" / "cpu_demo.yaml")
PAPER_32B = str(configs_dir() / "experiments" / "pkl_periodic" / "qwen3_32b_grpo.yaml")


# ---- KEY=VALUE anywhere on the line

@pytest.mark.parametrize("argv, field, expect", [
    (["train", DEMO, "--if-exists", "resume", "seed=3"], "if_exists", "resume"),
    (["train", "--if-exists", "overwrite", DEMO, "seed=3"], "if_exists", "overwrite"),
    (["demo", "seed=3", "--seeds", "2", "train.lr=1e-5"], "seeds", 2),
    (["demo", "--compare", "seed=3"], "compare", True),
    (["config", "show", DEMO, "seed=3"], "file", DEMO),
    (["config", "validate", "--set", "train.lr=1e-5", DEMO, "seed=3"], "set", ["train.lr=1e-5"]),
    (["plan", DEMO, "--mfu", "0.3", "seed=3"], "mfu", 0.3),
    (["submit", DEMO, "--profile", "local_cpu", "seed=3", "--dry-run"], "dry_run", True),
    (["sweep", DEMO, "seed=3", "--dry-run", "--grid", "train.lr=1e-5,2e-5"], "dry_run", True),
    (["compare", DEMO, "--methods", "grpo,pg", "seed=3", "--seeds", "2"], "seeds", 2),
])
def test_every_command_takes_overrides_anywhere_on_its_line(argv, field, expect):
    args = build_parser().parse_args(argv)
    overrides = args.files if argv[:2] == ["config", "validate"] else args.overrides
    assert "seed=3" in overrides
    assert getattr(args, field) == expect


# ---- train into a directory that holds a run

def _cfg(tmp_path: Path, *extra: str):
    return load_config(DEMO, [f"run_dir={tmp_path / 'run'}", *extra])


def test_train_into_an_empty_or_new_directory_is_allowed(tmp_path):
    cfg = _cfg(tmp_path)
    assert claim_run_dir(cfg, "error") is cfg
    (tmp_path / "run").mkdir()
    assert claim_run_dir(cfg, "error") is cfg


def test_train_refuses_a_directory_that_holds_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    rc = main(["train", DEMO, f"run_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert f"run directory {run} already holds a run (metrics.jsonl, 1 checkpoint(s)" in err
    assert "step_4" in err and "--if-exists resume" in err and "--if-exists overwrite" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # nothing touched


def test_train_if_exists_resume_continues_and_overwrite_deletes(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    cfg = _cfg(tmp_path)
    assert cfg.checkpoint.resume is False
    assert claim_run_dir(cfg, "resume").checkpoint.resume is True
    named = _cfg(tmp_path, f"checkpoint.resume={run}/checkpoints/step_4")
    assert claim_run_dir(named, "resume").checkpoint.resume == f"{run}/checkpoints/step_4"
    resumed = _cfg(tmp_path, "checkpoint.resume=true")  # the config says so: no flag needed
    assert claim_run_dir(resumed, "error") is resumed
    assert claim_run_dir(cfg, "overwrite") is cfg
    assert not run.exists()


# ---- plan before any download

def test_plan_sizes_a_paper_config_without_checkpoint_or_tokenizer(capsys):
    assert main(["plan", PAPER_32B, "model.hf_checkpoint=null", "--profile", "h200"]) == 0
    out = capsys.readouterr().out
    assert "model FLOPs per update" in out
    # training still needs the tokenizer: validation says so, naming the key
    assert main(["config", "validate", PAPER_32B, "model.hf_checkpoint=null"]) == 2
    assert "data.train_path" in capsys.readouterr().err


# ---- one precedence rule for the Slurm keys: config key set > profile > code default

def test_slurm_keys_config_set_wins_then_profile_then_code_default(tmp_path):
    from megapkl.launch.submit import submit

    from tests.launch.conftest import TINY, TOY

    unset = submit(TINY, "local_cpu", [f"run_dir={tmp_path}/a"], entry=TOY, dry_run=True)
    assert unset.sbatch_params["time"] == 15  # local_cpu.yaml's time: "00:15:00"
    assert "exclusive" not in unset.sbatch_params  # local_cpu.yaml's exclusive: false
    cfg = load_config(TINY)
    assert cfg.slurm.time is None and cfg.slurm.exclusive is None  # the reference says so
    set_ = submit(TINY, "local_cpu", [f"run_dir={tmp_path}/b", "slurm.time=00:07:00",
                                      "slurm.exclusive=true"], entry=TOY, dry_run=True)
    assert set_.sbatch_params["time"] == 7 and set_.sbatch_params["exclusive"] is True
