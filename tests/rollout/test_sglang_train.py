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
3. Why R3 generation bypasses the router: the pinned sglang-router drops `return_routed_experts`.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from megapkl.config import load_config
from sglang_fixtures import http, make_serve_cluster  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not os.path.isdir("configs/demo"), reason="run from the repo root")

EXPERIMENTS = Path("configs/experiments")
STEPS, WINDOW, TARGET = 36, 8, 0.30  # as tests/train/test_learning.py
LEARN = ["parallel.data=1", f"train.steps={STEPS}", "train.lr=1e-2", "rollout.max_response_len=1",
         "rollout.prompts_per_batch=10", "rollout.refresh_every=1", "reference.refresh_every=1",
         "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0"]


def serve_command(model: str) -> str:
    """rollout.sglang.server_command: `megapkl serve` with the launcher's placeholders (debug
    logging: one line per HTTP request, counted below)."""
    return json.dumps(["{python}", "-m", "megapkl.serve.serve", "--model-config", model,
                       "--host", "{host}", "--port", "{port}", "--log-level", "debug"])


def sglang_overrides(model: str, run_dir: Path, *extra_args: str) -> list[str]:
    """Two launched `megapkl serve` workers behind sglang-router (round robin: both serve)."""
    return ["rollout.engine=sglang", f"rollout.sglang.server_command={serve_command(model)}",
            f"rollout.sglang.extra_args={json.dumps(list(extra_args))}",
            "rollout.sglang.num_engines=2", "rollout.sglang.use_router=true",
            "rollout.sglang.router_policy=round_robin", "rollout.sglang.base_port=30500",
            "rollout.sglang.startup_timeout_s=240", "rollout.sglang.health_interval_s=2",
            "rollout.sglang.no_engine_timeout_s=120", f"run_dir={run_dir}"]


def tiny_overrides(model: str) -> list[str]:
    """A paper run scaled down to a tiny model on one CPU process with the demo task."""
    return [f"model.name={model}", "model.hf_checkpoint=null", "model.num_layers=null",
            "model.num_experts=null", "model.dtype=fp32", "model.recompute=none",
            "parallel.tensor=1", "parallel.pipeline=1", "parallel.context=1", "parallel.expert=1",
            "parallel.sequence_parallel=false", "parallel.data=1", "parallel.micro_batch_size=4",
            "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4",
            "rollout.max_prompt_len=16", "rollout.max_response_len=4",
            "data.train_path=null", "data.synthetic=next_mod10", "data.prompt_template=raw",
            "reward.type=synthetic", "eval.every=0", "eval.benchmarks=[]",
            "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0",
            "slurm.nodes=null", "slurm.gpus_per_node=null"]


def generate_counts(run_dir: Path, fleet: str = "sglang") -> dict[str, int]:
    """Successful /generate requests per log under the run's <fleet>/logs: what the router passed
    on (its request log) and what each launched server answered (megapkl serve's debug log)."""
    counts = {}
    for log in sorted((run_dir / fleet / "logs").glob("*.log")):
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # router: ANSI
        pattern = r"uri=/generate .*status_code=200" if log.stem == "router" else \
            r'"POST /generate HTTP/1.1" 200'
        counts[log.stem] = len(re.findall(pattern, text))
    return counts


def print_log_tails(run_dir: Path, lines: int = 40) -> None:
    for log in sorted((run_dir / "sglang" / "logs").glob("*.log")):
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")).splitlines()
        print(f"==== {log} (last {lines} of {len(text)} lines)", *text[-lines:], sep="\n")
    if (run_dir / "metrics.jsonl").exists():
        print(f"==== {run_dir / 'metrics.jsonl'}: "
              f"{len((run_dir / 'metrics.jsonl').read_text().splitlines())} updates logged")


def assert_served(run_dir: Path, *, via_router: bool = True) -> dict[str, int]:
    """Both launched workers answered /generate requests, every one through the router (or, for
    routing replay, none: the router drops `return_routed_experts`, so R3 goes direct)."""
    counts = generate_counts(run_dir)
    assert set(counts) == {"engine0", "engine1", "router"}, counts
    assert counts["engine0"] > 0 and counts["engine1"] > 0, counts  # round robin: both served
    through = counts["engine0"] + counts["engine1"] if via_router else 0
    assert counts["router"] == through, counts
    return counts


def test_demo_learns_through_router_with_launched_servers(dist_run, tmp_path):
    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    run = tmp_path / "learn"
    cfg = load_config("configs/demo/cpu_demo.yaml", [*LEARN, *sglang_overrides("tiny-qwen3", run)])
    try:
        dist_run(_rank_main, 1, cfg, timeout=400)
    except Exception:
        print_log_tails(run)  # what the servers and the router did, for a failure seen only in CI
        raise
    rows = read_metrics(run)
    acc = [r["train/accuracy"] for r in rows]
    assert len(acc) == STEPS
    assert all(r["staleness/max"] == 0 for r in rows)  # on-policy: versions as the servers stamp
    counts = assert_served(run)
    first, last = sum(acc[:WINDOW]) / WINDOW, sum(acc[-WINDOW:]) / WINDOW
    print(f"\n[learning via sglang-router] mean train/accuracy: updates 0-{WINDOW - 1}: "
          f"{first:.3f}, updates {STEPS - WINDOW}-{STEPS - 1}: {last:.3f} (target >= {TARGET}); "
          f"/generate requests {counts}")
    curve = [round(a, 2) for a in acc]
    assert last >= TARGET, f"the demo task did not learn through the router: accuracy " \
                           f"{first:.3f} -> {last:.3f} (target >= {TARGET}); curve {curve}"


def train_and_keep_last_batch(rank, world, cfg):
    """One trainer rank: run every update, then describe the last batch's samples."""
    from megapkl.train.loop import Trainer
    from megapkl.train.run_context import RunContext

    with RunContext() as context:  # closes the engine and releases the lock, as run() does
        trainer = Trainer(cfg, context)
        trainer.run()
        return [{"version": s.version, "prompt_len": s.prompt_len, "response_len": s.response_len,
                 "topk": None if s.topk_logp is None else tuple(s.topk_logp.shape),
                 "experts": None if s.routed_experts is None else tuple(s.routed_experts.shape)}
                for s in trainer.loop.batch]


PAPER_RUNS = {
    # PKL Table 4: periodic refresh (N = 64, L = 16), Proximal KL, FP8 rollouts. The trainer
    # pushes FP8 weights; activation quantization and the BF16 KV cache are SGLang server flags
    # (--quantization, --kv-cache-dtype) that `megapkl serve` does not have.
    "pkl_t4": ("pkl_periodic/qwen3_1p7b_pkl.yaml", "tiny-qwen3", ()),
    # SIS Fig. 4: Qwen3-30B-A3B DAPO + SIS (top-K 30) + routing replay, N = 4 minibatches.
    "sis_30b_a3b_r3": ("sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml", "tiny-qwen3-moe",
                       ("--enable-return-routed-experts",)),
}


def _finite(rows, *keys):
    for r in rows:
        for k in keys:
            assert k in r and math.isfinite(r[k]), (k, r.get(k))


def check_pkl_t4(rows, batch, counts):
    """Periodic refresh, N = 64: every batch comes from version 0, so staleness grows by one per
    update, as the servers stamp it. FP8 rollouts: the servers generate from FP8-rounded weights
    (measured max |log mu - log pi| 8e-3 at the same version; 5e-7 with rollout.fp8=false)."""
    _finite(rows, "pkl/credit_mean", "pkl/cost_clip_frac", "kl/prox_k3", "is/log_dev", "coef/mean")
    assert [r["staleness/max"] for r in rows] == [0, 1, 2]
    assert {s["version"] for s in batch} == {0}
    assert 1e-4 < rows[0]["mismatch/abs_log_ratio_max"] < 0.1
    assert counts["router"] > 0  # generation through the router


def check_sis_r3(rows, batch, counts):
    """On-policy batch, N = 4 minibatches: staleness 0, 1, 2 within it. SIS logs its metrics and
    reads the servers' top-30 log-probs; every sample carries the experts it was routed through
    (P + R - 1 rows x 2 layers x top-2), and the trainer, replaying them, gets the servers'
    log-probs back. sglang-router drops `return_routed_experts`: R3 goes to the workers directly."""
    _finite(rows, "sis/accept_rate", "sis/log_dev", "sis/xi_k", "clip/frac")
    assert all(0.0 <= r["sis/accept_rate"] <= 1.0 for r in rows)
    assert [r["staleness/max"] for r in rows] == [0, 1, 2]
    assert {s["version"] for s in batch} == {0}
    for s in batch:
        assert s["topk"] == (s["response_len"], 30)
        assert s["experts"] == (s["prompt_len"] + s["response_len"] - 1, 2, 2)
    assert rows[0]["mismatch/abs_log_ratio_max"] < 1e-4
    assert counts["router"] == 0


PAPER_CHECKS = {"pkl_t4": check_pkl_t4, "sis_30b_a3b_r3": check_sis_r3}


@pytest.mark.parametrize("run", sorted(PAPER_RUNS))
def test_paper_config_runs_through_router(run, dist_run, tmp_path):
    """A paper run with tiny-model overrides, 3 updates through launched servers + sglang-router."""
    from megapkl.train.metrics_log import read_metrics

    path, model, worker_args = PAPER_RUNS[run]
    out = tmp_path / run
    cfg = load_config(EXPERIMENTS / path, [*tiny_overrides(model), "train.steps=3",
                                           *sglang_overrides(model, out, *worker_args)])
    batch = dist_run(train_and_keep_last_batch, 1, cfg, timeout=300)[0]
    rows = read_metrics(out)
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    counts = assert_served(out, via_router=not cfg.model.routing_replay)
    PAPER_CHECKS[run](rows, batch, counts)


def test_router_drops_routed_experts_so_r3_bypasses_it(make_serve_cluster):
    """Why R3 generation skips the router: the pinned sglang-router forwards /generate without
    `return_routed_experts`, so the answer through it has no routed_experts (when a router
    release keeps the field, this fails and the bypass in SGLangEngine can go)."""
    cluster = make_serve_cluster(num_workers=1, model_config="tiny-qwen3-moe",
                                 worker_args=["--enable-return-routed-experts"])
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2},
            "return_routed_experts": True}
    direct = http("POST", cluster.worker_urls[0] + "/generate", body)
    routed = http("POST", cluster.router_url + "/generate", body)
    assert direct[0] == routed[0] == 200, (direct, routed)
    assert "routed_experts" in direct[1]["meta_info"]
    assert "routed_experts" not in routed[1]["meta_info"]
