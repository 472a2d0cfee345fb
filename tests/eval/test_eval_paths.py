"""How `megapkl eval` finds the run and the checkpoint from the path it is given."""
import json
from types import SimpleNamespace

import pytest

from megapkl.analysis.eval_cli import find_run, resolve_checkpoint


def make_run(tmp_path, steps, complete=True):
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: r\n")
    for s in steps:
        d = run / "checkpoints" / f"step_{s:08d}"
        d.mkdir()
        if complete:
            (d / "complete").write_text(json.dumps({"step": s, "world_size": 2}))
    return run


def test_run_dir_latest_and_step(tmp_path, monkeypatch):
    run = make_run(tmp_path, [10, 20])
    (run / "checkpoints" / "step_00000030").mkdir()  # cut short: no marker, never picked
    monkeypatch.chdir(tmp_path / "runs")  # the config's relative checkpoint.dir does not resolve here
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir="runs/r/checkpoints"))
    found, ckpt = find_run(run, None)
    assert found == run.resolve() and ckpt is None
    assert resolve_checkpoint(cfg, found, None, None).name == "step_00000020"
    assert resolve_checkpoint(cfg, found, None, 10).name == "step_00000010"
    with pytest.raises(FileNotFoundError, match="--step 30: no complete checkpoint"):
        resolve_checkpoint(cfg, found, None, 30)


def test_checkpoint_dir_given(tmp_path):
    run = make_run(tmp_path, [5])
    found, ckpt = find_run(run / "checkpoints" / "step_00000005", None)
    assert found == run.resolve() and ckpt.name == "step_00000005"
    (run / "checkpoints" / "step_00000009").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete megapkl checkpoint"):
        find_run(run / "checkpoints" / "step_00000009", None)


def test_run_without_checkpoints(tmp_path):
    run = make_run(tmp_path, [])
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(run / "checkpoints")))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        resolve_checkpoint(cfg, run, None, None)
