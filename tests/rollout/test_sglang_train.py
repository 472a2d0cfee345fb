"""`rollout.engine: sglang` in the real trainer, with the servers launched by the trainer itself.

Every run here goes the way a cluster run does: the trainer's rollout stage launches
`rollout.sglang.num_engines` rollout servers through `rollout.sglang.server_command` (here
`megapkl serve`, the embedded engine behind SGLang's HTTP API, since SGLang needs CUDA) and the real
sglang-router in front of them, waits for their health, pushes every policy version over HTTP, and
stops them all when the run ends.

1. Learning: the demo task through the router learns like the embedded default
   (tests/train/test_learning.py: same overrides, seed, 36 updates and threshold >= 0.30 mean
   train/accuracy over updates 28-35). Measured through the router: 0.098 over updates 0-7 ->
   0.386 over updates 28-35 (the embedded engine: 0.534), 180 /generate requests to each worker,
   all 360 through the router, about 20 s. With the advantage sign flipped in the rollout stage
   (train/rollouts.py `_advantages`) the same run measured 0.094 -> 0.014 and fails.
2. Paper configs, scaled down: one PKL Table 4 run (periodic refresh, Proximal KL, FP8 rollouts
   with a BF16 KV cache) and the SIS Qwen3-30B-A3B DAPO + SIS + routing-replay run, each with
   tiny-model overrides, for a few updates: finite losses, the method's metrics, staleness as the
   servers stamp it, and (R3) the experts each sample was generated with.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from megapkl.config import load_config

pytestmark = pytest.mark.skipif(not os.path.isdir("configs/demo"), reason="run from the repo root")

EXPERIMENTS = Path("configs/experiments")
STEPS, WINDOW, TARGET = 36, 8, 0.30  # as tests/train/test_learning.py
LEARN = ["parallel.data=1", f"train.steps={STEPS}", "train.lr=1e-2", "rollout.max_response_len=1",
         "rollout.prompts_per_batch=10", "rollout.refresh_every=1", "reference.refresh_every=1",
         "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0"]


def serve_command(model: str) -> str:
    """rollout.sglang.server_command: `megapkl serve` with the launcher's placeholders (debug
    logging: one line per HTTP request, counted below)."""
    return json.dumps(["{python}", "-m", "megapkl.rollout.serve", "--model-config", model,
                       "--host", "{host}", "--port", "{port}", "--log-level", "debug"])


def sglang_overrides(model: str, run_dir: Path, *extra_args: str) -> list[str]:
    """Two launched `megapkl serve` workers behind sglang-router (round robin: both serve)."""
    return ["rollout.engine=sglang", f"rollout.sglang.server_command={serve_command(model)}",
            f"rollout.sglang.extra_args={json.dumps(list(extra_args))}",
            "rollout.sglang.num_engines=2", "rollout.sglang.use_router=true",
            "rollout.sglang.router_policy=round_robin", "rollout.sglang.base_port=37100",
            "rollout.sglang.startup_timeout_s=240", "rollout.sglang.health_interval_s=2",
            "rollout.sglang.no_engine_timeout_s=120", f"run_dir={run_dir}"]


def tiny_overrides(model: str) -> list[str]:
    """A paper run scaled down to a tiny model on one CPU process with the demo task."""
    return [f"model.name={model}", "model.hf_checkpoint=null", "model.num_layers=null",
            "model.num_experts=null", "model.dtype=fp32", "model.recompute=none",
            "parallel.tensor=1", "parallel.pipeline=1", "parallel.context=1", "parallel.expert=1",
            "parallel.sequence_parallel=false", "parallel.data=1", "parallel.micro_batch_size=8",
            "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4",
            "rollout.max_prompt_len=16", "rollout.max_response_len=4",
            "data.train_path=null", "data.synthetic=next_mod10", "data.prompt_template=raw",
            "reward.type=synthetic", "eval.every=0", "eval.benchmarks=[]",
            "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0"]


def generate_counts(run_dir: Path) -> dict[str, int]:
    """Successful /generate requests per log under the run's sglang/logs: what the router passed
    on (its request log) and what each launched server answered (megapkl serve's debug log)."""
    counts = {}
    for log in sorted((run_dir / "sglang" / "logs").glob("*.log")):
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # router: ANSI
        pattern = r"uri=/generate .*status_code=200" if log.stem == "router" else \
            r'"POST /generate HTTP/1.1" 200'
        counts[log.stem] = len(re.findall(pattern, text))
    return counts


def assert_served_through_router(run_dir: Path) -> dict[str, int]:
    counts = generate_counts(run_dir)
    assert set(counts) == {"engine0", "engine1", "router"}, counts
    assert counts["engine0"] > 0 and counts["engine1"] > 0, counts  # round robin: both served
    assert counts["router"] == counts["engine0"] + counts["engine1"], counts  # all via the router
    return counts


def test_demo_learns_through_router_with_launched_servers(dist_run, tmp_path):
    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    run = tmp_path / "learn"
    cfg = load_config("configs/demo/cpu_demo.yaml", [*LEARN, *sglang_overrides("tiny-qwen3", run)])
    dist_run(_rank_main, 1, cfg, timeout=400)
    rows = read_metrics(run)
    acc = [r["train/accuracy"] for r in rows]
    assert len(acc) == STEPS
    assert all(r["staleness/max"] == 0 for r in rows)  # on-policy: versions as the servers stamp
    counts = assert_served_through_router(run)
    first, last = sum(acc[:WINDOW]) / WINDOW, sum(acc[-WINDOW:]) / WINDOW
    print(f"\n[learning via sglang-router] mean train/accuracy: updates 0-{WINDOW - 1}: "
          f"{first:.3f}, updates {STEPS - WINDOW}-{STEPS - 1}: {last:.3f} (target >= {TARGET}); /generate requests {counts}")
    assert last >= TARGET, f"the demo task did not learn through the router: accuracy {first:.3f}" \
                           f" -> {last:.3f} (target >= {TARGET}); curve {[round(a, 2) for a in acc]}"
