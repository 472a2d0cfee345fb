"""Helpers for the fault tests: tiny CPU trainer runs in forked ranks (megatron imported once), and
two `megapkl serve` workers for the tests whose ranks talk to SGLang-API servers."""
import contextlib
import sys
from pathlib import Path

import pytest

from megapkl.config import load_config
from megapkl.train.metrics_log import wall_clock

DEMO = "configs/demo/cpu_demo.yaml"
TINY = ["logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=4", "rollout.max_response_len=4",
        "parallel.micro_batch_size=4", "rollout.refresh_every=2", "reference.refresh_every=2",
        "checkpoint.every=2", "checkpoint.keep=null"]


def tiny_cfg(run_dir, *overrides, data=1):
    return load_config(DEMO, [*TINY, f"parallel.data={data}", f"run_dir={run_dir}", *overrides])


def comparable(rows):
    return [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]


@pytest.fixture
def train(dist_run):
    """train(cfg, world=1, patch=None): run the trainer on `world` forked ranks; `patch(rank)` runs
    first inside each rank (to inject a fault)."""
    def run(cfg, world=1, patch=None, timeout=300):
        return dist_run(_rank, world, cfg, patch, timeout=timeout)
    return run


def _rank(rank, world, cfg, patch):
    if patch is not None:
        patch(rank)
    from megapkl.train.loop import run

    return run(cfg)


@contextlib.contextmanager
def two_serve_workers(tmp_path: Path):
    """Two healthy `megapkl serve` workers (tests/rollout/sglang_fixtures.py: `.url`, `.proc`),
    stopped afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
    from sglang_fixtures import start_worker, wait_healthy

    workers = [start_worker(tmp_path / "logs", name=f"worker{i}") for i in range(2)]
    try:
        wait_healthy(workers)
        yield workers
    finally:
        for w in workers:
            w.stop()
