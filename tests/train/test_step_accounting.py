"""The step does what it says: no forward pass twice on the same weights and tokens (counted in
`train/forward_passes`), and the timers, taken where the work happens, never overlap (their sum is
at most the update's wall time `time/update_s`; tools/bench/step_timers.py measures how much of
it they cover)."""
from __future__ import annotations

import pytest

from megapkl.config import load_config
from megapkl.train.metrics_log import read_metrics

DEMO = "configs/demo/cpu_demo.yaml"
BASE = ["logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=4", "rollout.max_response_len=4", "parallel.micro_batch_size=4",
        "checkpoint.every=0", "train.steps=3"]
TIMERS = ("export", "sync", "generate", "reward", "reference", "train", "eval", "checkpoint", "log")


def _run(dist_run, tmp_path, name, *overrides):
    from megapkl.train.local import _rank_main

    cfg = load_config(DEMO, [*BASE, f"run_dir={tmp_path / name}", *overrides])
    dist_run(_rank_main, 1, cfg, timeout=300)
    return read_metrics(cfg.run_dir)


@pytest.mark.parametrize("name,overrides,forwards", [
    # reference refreshed every update: the proximal log-probs are the live weights' (one pass,
    # which the mismatch metrics reuse), then training; kl_init at update 0 shares that pass, later
    # it is the initial snapshot's own pass
    ("refresh1", ["rollout.refresh_every=1", "reference.refresh_every=1",
                  "objective.kl_init_coef=0.01"], [2, 3, 3]),
    # per_batch reference over 2 minibatches: one pass over the batch when it starts (reused by the
    # mismatch metrics of its first minibatch), then training
    ("per_batch", ["rollout.protocol=controlled_staleness", "rollout.max_staleness=1",
                   "rollout.minibatches_per_batch=2", "reference.mode=per_batch",
                   "rollout.refresh_every=null", "rollout.prompts_per_batch=8"], [2, 1, 2]),
    # on-policy under a reference snapshot 32 updates old (GRPO's L): after update 0 the
    # proximal pass is the snapshot's; the mismatch metrics of the fresh samples come from the
    # training pass, the same weights and tokens (no third pass)
    ("on_policy", ["rollout.protocol=on_policy", "rollout.refresh_every=1",
                   "reference.refresh_every=32"], [2, 2, 2]),
])
def test_forward_passes_per_update(dist_run, tmp_path, name, overrides, forwards):
    rows = _run(dist_run, tmp_path, name, *overrides)
    assert [r["train/forward_passes"] for r in rows] == forwards
    fresh = [r for r in rows if "mismatch/tokens" in r]
    assert fresh and all(r["mismatch/k3_kl"] < 1e-6 for r in fresh)  # fp32 engine: exact
    for r in rows:
        parts = [r[f"time/{t}_s"] for t in TIMERS]
        assert all(p >= 0 for p in parts)
        assert sum(parts) <= r["time/update_s"] + 1e-6, r
