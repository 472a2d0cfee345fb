"""`logging.wandb`: W&B beside TensorBoard, tested in offline mode (no network).

wandb is in the `test` extra, so CI always runs the offline test; a local environment without it
skips that test (and fails it when CI is set, so the CI path cannot silently skip)."""
import os
import sys

import pytest

from megapkl.config import load_config
from megapkl.config.sections_train import WandbConfig
from megapkl.train.metrics_log import MetricsLogger


def _wandb():
    try:
        import wandb
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("wandb is in the test extra but not installed under CI")
        pytest.skip("wandb not installed (pip install -e .[wandb])")
    return wandb


def test_offline_run_records_the_metrics(tmp_path, monkeypatch):
    _wandb()
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(tmp_path, tensorboard=False, progress=False,
                        wandb=WandbConfig(mode="offline", project="megapkl-test"), run_name="t")
    run = log._wandb
    log.log(0, {"loss": 1.5, "reward/mean": 0.25, "bad": float("nan")})
    log.log(1, {"loss": 0.5})
    log.log(2, {"loss": 0.25})                             # a step is committed when the next begins
    assert run.summary["loss"] == 0.5 and run.summary["reward/mean"] == 0.25
    assert "bad" not in run.summary.keys()                 # non-finite values are not sent
    assert (run.project, run.name, run.id) == ("megapkl-test", "t", (tmp_path / "wandb_id").read_text().strip())
    log.close()
    records = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1 and records[0].stat().st_size > 0   # ready for `wandb sync`


def test_disabled_by_default_and_a_missing_wandb_is_a_clear_error(tmp_path, monkeypatch):
    cfg = load_config("configs/demo/cpu_demo.yaml")
    assert cfg.logging.wandb.mode == "disabled"
    log = MetricsLogger(tmp_path, tensorboard=False, progress=False, wandb=cfg.logging.wandb)
    assert log._wandb is None and not (tmp_path / "wandb").exists()
    log.close()
    monkeypatch.setitem(sys.modules, "wandb", None)        # import wandb -> ImportError
    with pytest.raises(ImportError, match="logging.wandb.mode"):
        MetricsLogger(tmp_path, tensorboard=False, progress=False, wandb=WandbConfig(mode="offline"))


def test_wandb_mode_is_validated():
    with pytest.raises(ValueError, match="logging.wandb.mode"):
        load_config("configs/demo/cpu_demo.yaml", ["logging.wandb.mode=cloud"])
