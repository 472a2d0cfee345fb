"""`megapkl submit` and `megapkl train` apply one rule to a run directory that holds a run
(megapkl.train.local.run_dir_action), and `submit --dry-run` says what the real submit will do
with it. No job is queued: every submit here is a dry run on the local_cpu profile."""
from __future__ import annotations

from pathlib import Path

import pytest

from megapkl.cli import main
from megapkl.launch.submit import LaunchError, submit

from .conftest import TINY, TOY


def train_run(run: Path) -> None:
    """What `megapkl train` leaves: its records and a checkpoint, no launch.json."""
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "config.yaml").write_text("name: x\n")


def dry(run: Path, if_exists: str = "error"):
    return submit(TINY, "local_cpu", [f"run_dir={run}"], entry=TOY, dry_run=True,
                  if_exists=if_exists)


def test_submit_refuses_a_directory_of_megapkl_train_as_train_does(tmp_path, capsys):
    run = tmp_path / "run"
    train_run(run)
    with pytest.raises(LaunchError) as submitted:
        dry(run)
    rc = main(["train", str(TINY), f"run_dir={run}"])
    trained = capsys.readouterr().err.strip()
    assert rc == 1
    # the same sentence from both: what the directory holds and the three ways on
    assert trained.startswith(f"megapkl: error: {submitted.value} (")
    for part in (f"run directory {run} already holds a run (metrics.jsonl, config.yaml",
                 "step_00000004", "--if-exists resume", "--if-exists overwrite"):
        assert part in str(submitted.value)
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # nothing touched


def test_a_submitted_run_names_its_last_job(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "launch.json").write_text('{"jobs": [{"job_id": "42"}]}')
    with pytest.raises(LaunchError, match=r"already holds a run \(launch.json \(last job 42\)\)"):
        dry(run)


def test_the_dry_run_says_what_the_submit_will_do(tmp_path, capsys):
    run = tmp_path / "run"
    assert dry(run).run_dir_action == "a new run in an empty run directory"
    assert not run.exists()  # a dry run makes nothing
    train_run(run)
    resumed = dry(run, "resume").run_dir_action
    assert resumed.startswith("continues the run it holds (metrics.jsonl") and \
        resumed.endswith("from its latest checkpoint")
    assert dry(run, "overwrite").run_dir_action.startswith("deletes the run it holds")
    assert (run / "metrics.jsonl").is_file()  # the dry overwrite deleted nothing
    rc = main(["submit", str(TINY), "--profile", "local_cpu", f"run_dir={run}", "--entry", TOY,
               "--if-exists", "resume", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and f"# run_dir: {run}\n# submitted, this job: continues the run it holds" in out


def test_the_config_saying_resume_needs_no_flag_in_either(tmp_path):
    run = tmp_path / "run"
    train_run(run)
    sub = submit(TINY, "local_cpu", [f"run_dir={run}", "checkpoint.resume=true"], entry=TOY,
                 dry_run=True)
    assert sub.run_dir_action.startswith("continues the run it holds")
