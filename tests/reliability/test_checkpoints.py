"""Crash-safe checkpoints with the real trainer (megatron-core dist checkpoint, gloo ranks):
SIGKILL during a save, a corrupted or incomplete checkpoint, a full disk, resume at another DP/TP."""
import os
import shutil
import signal
import subprocess

import pytest

from megapkl.train import checkpointing as ckpt
from megapkl.train.metrics_log import read_metrics

from .conftest import comparable, tiny_cfg


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, megatron_loaded):
    """4 updates, checkpoints after 2 and 4: the metrics every resumed run must reproduce."""
    from megapkl.parallel.forked import run_forked

    from .conftest import _rank

    cfg = tiny_cfg(tmp_path_factory.mktemp("ref") / "run", "train.steps=4")
    run_forked(_rank, 1, cfg, None, timeout=300)
    return cfg


def _kill_in_loop_state_gather(rank):
    """SIGKILL the rank in the middle of the step-4 save (model/ written, trainer state not)."""
    from megapkl.train.loop_state import LoopState

    real = LoopState.state_dict

    def state_dict(self):
        if self.update == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self)

    LoopState.state_dict = state_dict


def test_sigkill_during_save_keeps_previous_checkpoint_and_resumes(train, reference_run, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.steps=4")
    with pytest.raises(Exception, match="exit code -9"):
        train(cfg, patch=_kill_in_loop_state_gather)
    root = tmp_path / "run" / "checkpoints"
    assert ckpt.latest(cfg.checkpoint) == root / "step_00000002"
    assert (root / ".step_00000004.partial" / "model").is_dir()  # the killed save's leftovers
    assert not (root / "step_00000004").exists()
    ckpt.verify(root / "step_00000002")
    resumed = tiny_cfg(tmp_path / "run", "train.steps=4", "checkpoint.resume=true")
    train(resumed)
    assert comparable(read_metrics(resumed.run_dir)) == comparable(read_metrics(reference_run.run_dir))
    assert not (root / ".step_00000004.partial").exists()  # cleaned once a save completed
    ckpt.verify(root / "step_00000004")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_corrupted_or_incomplete_checkpoint_is_refused_naming_the_file(train, reference_run, tmp_path):
    good = ckpt.latest(reference_run.checkpoint)
    assert good.name == "step_00000004"
    manifest = ckpt.verify(good)
    assert "trainer.pt" in manifest["files"] and "model/metadata.json" in manifest["files"]
    data = sorted(p for p in (good / "model").glob("*.distcp"))[0]

    bad = _copy(good, tmp_path / "truncated")
    with open(bad / "model" / data.name, "r+b") as fh:
        fh.truncate(data.stat().st_size // 2)
    with pytest.raises(ckpt.CheckpointError, match=f"corrupted: {bad / 'model' / data.name} has"):
        ckpt.verify(bad)

    bad = _copy(good, tmp_path / "missing")
    (bad / "trainer.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match=f"incomplete: {bad / 'trainer.pt'} is missing"):
        ckpt.verify(bad)

    bad = _copy(good, tmp_path / "unmarked")
    (bad / ckpt.MARKER).unlink()
    with pytest.raises(ckpt.CheckpointError, match="no 'complete' marker"):
        ckpt.verify(bad)

    bad = _copy(good, tmp_path / "garbled")
    (bad / "trainer.pt").write_bytes(b"x" * (bad / "trainer.pt").stat().st_size)  # same size
    cfg = tiny_cfg(tmp_path / "g", "train.steps=5", f"checkpoint.resume={bad}")
    with pytest.raises(Exception, match=f"checkpoint {bad / 'trainer.pt'}: cannot be read"):
        train(cfg)


def _mount_tmpfs(path, size):
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")


def test_disk_full_during_save_fails_cleanly_and_keeps_previous(train, reference_run, tmp_path):
    one = sum(f.stat().st_size for f in ckpt.latest(reference_run.checkpoint).rglob("*") if f.is_file())
    disk = tmp_path / "small_disk"
    _mount_tmpfs(disk, f"{(one * 3 // 2) // 1024}k")  # room for one checkpoint, not two
    try:
        cfg = tiny_cfg(tmp_path / "run", "train.steps=4", f"checkpoint.dir={disk}")
        with pytest.raises(Exception) as info:
            train(cfg)
        msg = str(info.value)
        assert "CheckpointError: saving the step-4 checkpoint" in msg
        assert " kB free there)" in msg
        assert f"the previous checkpoint {disk / 'step_00000002'} is intact" in msg
        assert ckpt.latest(cfg.checkpoint) == disk / "step_00000002"
        ckpt.verify(disk / "step_00000002")
        assert not list(disk.glob(".step_*.partial"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)
