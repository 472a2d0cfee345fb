"""`megapkl smoke` as docs/experiments.md ("Smoke first") runs it, for real: paper configs on
their tiny twins through train, eval and plot, one on the embedded engine (dense, controlled
staleness), one on `megapkl serve` workers standing in for SGLang (MoE, routing replay, SIS, the
first rows of the config's own data), the search agent on the embedded engine (its own corpus,
index and retriever); then a failing stage, and the plan's arithmetic alone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from journey.workspace import REPO, megapkl

FIXTURES = REPO / "tests" / "data" / "fixtures"
PKL = "configs/experiments/pkl_staleness/qwen3_1p7b_pkl_s4.yaml"
SIS = "configs/experiments/sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml"
TETPO = "configs/experiments/tetpo/qwen3_1p7b_tetpo.yaml"
AGENT = "configs/experiments/sis_agent/qwen3_8b_grpo_sis.yaml"
STEPS = "2"


@pytest.fixture
def work(tmp_path, monkeypatch, megatron_loaded):
    """A working directory with the repository's configs, as a user has it."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def assert_smoked(smoke_dir: Path, config: str, steps: int) -> tuple:
    """The run's updates, evaluation and plots are there, and its resolved config kept the
    config's objective and protocol; (metrics rows, the run's config, the config's own)."""
    from megapkl.config import load_config

    metrics = rows(smoke_dir / "run" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))
    assert all(r["grad_norm"] > 0 for r in metrics)  # raw rewards: the weights move
    ran, own = load_config(smoke_dir / "run" / "config.yaml"), load_config(config)
    assert ran.objective == own.objective
    for key in ("protocol", "max_staleness", "minibatches_per_batch", "fp8", "async_batches"):
        assert getattr(ran.rollout, key) == getattr(own.rollout, key), key
    assert ran.reference.mode == own.reference.mode
    summary = json.loads((smoke_dir / "run" / "eval-cli" / f"step_{steps:06d}.json").read_text())
    assert sorted(summary["benchmarks"]) == sorted(b.name for b in own.eval.resolved_benchmarks())
    assert (smoke_dir / "plots" / "overview.png").is_file()
    return metrics, ran, own


def test_smoke_embedded_dense(work):
    out = megapkl("smoke", PKL, "rollout.engine=embedded", "--out", "sm", "--steps", STEPS).ok().out
    assert out.startswith(f"smoke {PKL}: ok")
    assert "training data: 8 synthetic rows (data/dapo_math_frpo_9453.jsonl is not here)" in out
    metrics, ran, own = assert_smoked(work / "sm", PKL, int(STEPS))
    assert ran.model.name == "tiny-qwen3" and own.model.name == "qwen3-1.7b"
    assert ran.rollout.engine == "embedded" and ran.parallel.context == 1
    assert ran.rollout.max_staleness == 4 and ran.rollout.minibatches_per_batch == 4


def test_smoke_sglang_moe_with_routing_replay(work):
    megapkl("data", "prepare", "dapo_math_17k", "--out", "data", "--from-file",
            FIXTURES / "dapo_math_17k.jsonl").ok()
    megapkl("data", "prepare", "amc23", "--out", "data/eval", "--from-file",
            FIXTURES / "amc23.jsonl").ok()
    # no in-training evaluation: the eval stage evaluates the same weights on the same servers
    out = megapkl("smoke", SIS, "--out", "sm", "--steps", STEPS, "eval.every=0").ok().out
    assert out.startswith(f"smoke {SIS}: ok")
    assert "training data: 3 first rows of data/dapo_math_17k.jsonl" in out
    assert "(1 from their files, 3 synthetic)" in out  # amc23 prepared, the others not
    metrics, ran, own = assert_smoked(work / "sm", SIS, int(STEPS))
    assert ran.model.name == "tiny-qwen3-moe" and ran.model.routing_replay
    assert ran.rollout.engine == "sglang" and ran.objective.sis.enabled
    assert "megapkl.serve.serve" in ran.rollout.sglang.server_command
    assert metrics[0]["mismatch/routing_tokens"] > 0  # every sample came with its experts
    assert (work / "sm" / "run" / "sglang" / "logs" / "engine0.log").is_file()


def test_smoke_search_agent_on_the_embedded_engine(work):
    """An SIS agent run on its tiny twin, scripted to call the search tool: the run serves a BM25
    index of a generated corpus itself (train and eval each start and stop it), its turns get
    the retriever's passages, exact match per source is logged and the six QA sets evaluated."""
    out = megapkl("smoke", AGENT, "rollout.engine=embedded", "--out", "sm", "--steps",
                  STEPS).ok().out
    assert out.startswith(f"smoke {AGENT}: ok")
    assert "a BM25 index of 60 generated passages" in out and "scripted to write" in out
    assert "environment search (max turns 5), reward answer_em, prompt template sis_agent" in out
    metrics, ran, own = assert_smoked(work / "sm", AGENT, int(STEPS))
    assert ran.env.type == "search" and ran.env.search.index == str(work / "sm" / "data" / "index")
    assert (ran.env.max_turns, ran.env.search.topk) == (own.env.max_turns, own.env.search.topk)
    assert metrics[0]["tool/calls"] > 0 and metrics[0]["time/env_step_s"] > 0
    assert "em/nq" in metrics[0] and "eval/macro_avg/accuracy" in metrics[-1]
    rows_ = rows(work / "sm" / "run" / "eval-cli" / f"step_{int(STEPS):06d}.samples.jsonl")
    assert {r["benchmark"] for r in rows_} == {"nq", "triviaqa", "popqa", "hotpotqa", "musique",
                                               "bamboogle"}
    assert any('<information>Doc 1(Title: "King of land' in r["response"] for r in rows_)
    log = (work / "sm" / "run" / "retriever.log").read_text()
    assert log.count("serving 60 passages (bm25)") == 2  # training's, then eval's


def test_a_failed_stage_is_one_line_and_stops_the_rest(work):
    result = megapkl("smoke", PKL, "rollout.engine=embedded", "data.train_path=missing.jsonl",
                     "--out", "sm", "--steps", STEPS)
    assert result.rc == 1 and f"smoke {PKL}: FAILED" in result.out
    train = next(ln for ln in result.out.splitlines() if ln.strip().startswith("train "))
    assert "FAILED" in train and "data.train_path" in train and "missing.jsonl" in train
    assert [ln.split()[:2] for ln in result.out.splitlines()
            if ln.strip().startswith(("eval ", "plot "))] == [["eval", "-"], ["plot", "-"]]
    assert (work / "sm" / "train.log").is_file()


def test_the_plan_keeps_the_method_and_scales_the_rest(work):
    """TETPO (uniform staleness k = 32, cosine with 75 warmup updates): the smoke run's config
    keeps the objective and protocol, has its warmup inside the run, and a user's key wins."""
    from megapkl.config import load_config
    from megapkl.launch.smoke import make_plan

    plan = make_plan(TETPO, ["rollout.responses_per_prompt=3"], out_dir="sm", steps=4)
    cfg, own = load_config(TETPO, plan.overrides, workdir=work), load_config(TETPO)
    assert cfg.objective == own.objective and cfg.rollout.protocol == "uniform_stale"
    assert cfg.rollout.max_staleness == 32 and cfg.train.lr_schedule == "cosine"
    assert cfg.train.steps == 4 and cfg.train.warmup_steps == 3
    assert cfg.rollout.responses_per_prompt == 3  # the user's override, not the smoke's 2
    assert plan.given == ["rollout.responses_per_prompt=3"]
    assert cfg.model.name == "tiny-qwen3" and cfg.parallel.data == 1 and cfg.slurm.nodes is None
    assert cfg.rollout.sglang.num_engines == 1 and not cfg.rollout.sglang.use_router
    assert any("1500 updates (warmup 75) -> 2 x 2" in line for line in plan.replaced)


def test_the_sample_covers_every_paper_and_engine():
    """tools/smoke_all.py --sample: each paper folder once, each engine kind, routing replay."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("smoke_all", REPO / "tools" / "smoke_all.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    configs = tool.run_configs()
    assert len(configs) > 80 and not any(p.name.startswith("_") for p in configs)
    jobs = tool.sample(configs, [])
    assert {j.path.parent.name for j in jobs} == {p.parent.name for p in configs}
    assert {j.engine for j in jobs} == {"embedded", "sglang"}
    sis = next(j for j in jobs if j.path.parent.name == "sis_math")
    assert sis.path.name.endswith("_r3.yaml")  # the folder's routing-replay run
    # the search agent's pick (an SIS run) generates turns on every engine
    agent = [j for j in jobs if j.path.parent.name == "sis_agent"]
    assert {j.engine for j in agent} == {"embedded", "sglang"} and len({j.path for j in agent}) == 1
    assert agent[0].path.stem.endswith("_sis")
    assert len({j.slug for j in jobs}) == len(jobs)  # one output directory each
