"""A quiet terminal: `megapkl train` shows megapkl's own lines only; other libraries' warnings
(megatron's "Transformer Engine and Apex are not installed", torch's deprecations and log lines)
go to <run_dir>/megapkl.log, and `--debug` shows them on the terminal as before."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["logging.tensorboard=false", "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4",
        "rollout.max_response_len=4", "parallel.micro_batch_size=4", "train.steps=1",
        "checkpoint.every=0"]


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MEGAPKL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "megapkl.cli", *extra, "train",
                           "configs/demo/cpu_demo.yaml", *TINY, f"run_dir={run_dir}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_third_party_warnings_go_to_the_run_log_and_debug_shows_them(tmp_path):
    quiet = _train(tmp_path / "quiet")
    assert quiet.returncode == 0, quiet.stderr
    lines = [ln for ln in quiet.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith(("step 1/1 | ", "[megapkl.train] saved checkpoint "))
                         for ln in lines), quiet.stderr  # megapkl's own lines only
    log = (tmp_path / "quiet" / "megapkl.log").read_text()
    assert "Transformer Engine and Apex are not installed" in log

    loud = _train(tmp_path / "loud", "--debug")
    assert loud.returncode == 0, loud.stderr
    assert "Transformer Engine and Apex are not installed" in loud.stderr
