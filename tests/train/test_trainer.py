"""End-to-end trainer runs on CPU: every objective, protocol schedules, exact resume, NaN skips.

Each run is a forked child of the pytest process (megatron imported once in the parent), with the
real megatron-core model, the embedded rollout engine and the distributed loss.
"""
import math

import pytest

from megapkl.config import load_config
from megapkl.train.metrics_log import read_metrics

DEMO = "configs/demo/cpu_demo.yaml"
BASE = ["logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=4", "rollout.max_response_len=4", "parallel.micro_batch_size=4",
        "checkpoint.every=0"]
COMMON = {"loss", "coef/mean", "coef/abs_max", "is/w_mean", "is/w_max", "is/w_min", "is/log_dev",
          "kl/prox_k3", "grad_norm", "reward/mean", "train/accuracy", "staleness/mean",
          "staleness/max", "response_len/mean", "tokens_per_s"}
CLIP = {"clip/frac"}
PKL = {"pkl/cost_clip_frac", "pkl/cost_clip_frac_moving", "pkl/moving_frac", "pkl/credit_mean",
       "pkl/credit_abs_max"}
SIS = {"sis/accept_rate", "sis/log_dev", "sis/xi_k", "sis/reject_outside_topk"}
TETPO = {"tetpo/alpha_mean", "tetpo/alpha_min", "tetpo/tempered_frac", "tetpo/ess_frac_before",
         "tetpo/ess_frac_after"}


def cfg_for(tmp_path, name, *overrides, data=1):
    return load_config(DEMO, [*BASE, f"parallel.data={data}", f"run_dir={tmp_path / name}", *overrides])


def train(dist_run, cfg, world=1, timeout=300):
    from megapkl.train.local import _rank_main

    return dist_run(_rank_main, world, cfg, timeout=timeout)


OBJECTIVE_RUNS = [
    ("pg", [], set()), ("grpo", [], CLIP), ("dapo", [], CLIP), ("cispo", [], CLIP),
    ("proximal_kl", [], PKL), ("proximal_kl_h2_tail", ["objective.horizon=2", "objective.tail=linear"], PKL),
    ("seq_is", [], PKL), ("is_free", [], PKL), ("gspo", [], CLIP), ("tetpo", ["objective.kappa=0.99"], CLIP | TETPO),
    ("gepo", [], CLIP), ("m2po", ["objective.m2_threshold=0.0001"], {"m2po/mask_frac"}),
    ("grpo_sis", ["objective.sis.enabled=true", "objective.sis.top_k=4"], CLIP | SIS),
    ("proximal_kl_sis", ["objective.sis.enabled=true", "objective.sis.top_k=4"], PKL | SIS),
    ("gspo_sis", ["objective.sis.enabled=true", "objective.sis.top_k=4"], CLIP | SIS),
    ("pg_entropy_kl", ["objective.entropy_coef=0.01", "objective.kl_init_coef=0.01"], {"entropy", "kl/init_k3"}),
    ("dppo_tv", ["objective.tv_delta=0.01"], CLIP | {"dppo/mask_frac", "dppo/tv"}),
    ("clip_cov", ["objective.cov_omega=0.0"], CLIP | {"clip_cov/mask_frac"}),
]


@pytest.mark.parametrize("name,extra,specific", OBJECTIVE_RUNS, ids=[r[0] for r in OBJECTIVE_RUNS])
def test_short_run_per_objective_logs_every_metric(dist_run, tmp_path, name, extra, specific):
    objective = name.split("_sis")[0].split("_h2")[0].split("_entropy")[0]
    cfg = cfg_for(tmp_path, name, f"objective.name={objective}", "train.steps=3",
                  "rollout.refresh_every=2", "reference.refresh_every=2", *extra)
    train(dist_run, cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        missing = (COMMON | specific) - set(r)
        assert not missing, f"{name}: metrics missing {sorted(missing)}"
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in COMMON | specific), r
    # update 0 is on-policy: the engine's behavior log-probs are the learner's own
    assert rows[0]["is/w_max"] == pytest.approx(1.0, abs=2e-4)
    assert rows[0]["is/w_min"] == pytest.approx(1.0, abs=2e-4)
    assert (tmp_path / name / "config.yaml").exists()


@pytest.mark.parametrize("protocol,overrides,expect", [
    # periodic refresh N=3: behavior version 3*floor(u/3), staleness u mod 3
    ("periodic_refresh", ["rollout.refresh_every=3"], [0, 1, 2, 0, 1, 2]),
    # controlled staleness k=2, 2 minibatches: batch b from version max(0, 2b-2), staleness per update
    ("controlled_staleness", ["rollout.max_staleness=2", "rollout.minibatches_per_batch=2",
                              "reference.mode=per_batch", "rollout.refresh_every=null"], [0, 1, 2, 3, 2, 3]),
    ("on_policy", ["rollout.refresh_every=null", "reference.mode=behavior"], [0, 0, 0, 0, 0, 0]),
])
def test_protocol_schedule_step_by_step(dist_run, tmp_path, protocol, overrides, expect):
    cfg = cfg_for(tmp_path, protocol, f"rollout.protocol={protocol}", "train.steps=6", *overrides)
    train(dist_run, cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["staleness/max"] for r in rows] == expect
    assert [r["staleness/mean"] for r in rows] == expect


def test_uniform_stale_lags_within_bound(dist_run, tmp_path):
    cfg = cfg_for(tmp_path, "us", "rollout.protocol=uniform_stale", "rollout.max_staleness=3",
                  "rollout.snapshot_pool=8", "rollout.refresh_every=null", "reference.mode=behavior",
                  "objective.name=tetpo", "train.steps=8")
    train(dist_run, cfg)
    rows = read_metrics(cfg.run_dir)
    for r in rows:
        assert 0 <= r["staleness/mean"] <= min(3, r["step"]) + 1e-9
        assert r["staleness/max"] <= 3
    assert any(r["staleness/mean"] > 0 for r in rows[3:])


def _comparable(rows):
    from megapkl.train.metrics_log import wall_clock

    return [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]


def test_resume_continues_exactly_dp2(dist_run, tmp_path):
    """2N updates == N updates + checkpoint + resume + N updates (metrics identical), DP = 2."""
    common = ["rollout.refresh_every=2", "reference.refresh_every=4"]
    full = cfg_for(tmp_path, "full", *common, "train.steps=6", data=2)
    train(dist_run, full, world=2)
    first = cfg_for(tmp_path, "part", *common, "train.steps=3", data=2)  # checkpoints at its end
    train(dist_run, first, world=2)
    assert len(read_metrics(first.run_dir)) == 3
    second = cfg_for(tmp_path, "part", *common, "train.steps=6", "checkpoint.resume=true", data=2)
    train(dist_run, second, world=2)
    a, b = _comparable(read_metrics(full.run_dir)), _comparable(read_metrics(second.run_dir))
    assert [r["step"] for r in b] == list(range(6))
    assert a == b


def test_nan_loss_skips_then_aborts(dist_run, tmp_path, monkeypatch):
    """A non-finite loss skips the update (counted); more than max_nan_skips_in_row aborts."""
    import torch

    from megapkl.parallel import megatron_loss

    real = megatron_loss.shard_policy_loss

    def poisoned(cfg, batch, ctx):
        out = real(cfg, batch, ctx)
        if batch.step in (1, 3, 4, 5, 6):
            out.loss = out.loss * torch.tensor(float("nan"))
            out.parts.totals["loss"] = float("nan")
        return out

    monkeypatch.setattr(megatron_loss, "shard_policy_loss", poisoned)
    ok = cfg_for(tmp_path, "nan_ok", "train.steps=3", "train.max_nan_skips_in_row=1")
    train(dist_run, ok)
    rows = read_metrics(ok.run_dir)
    assert [r["train/skipped_updates"] for r in rows] == [0.0, 1.0, 1.0]
    bad = cfg_for(tmp_path, "nan_bad", "train.steps=8", "train.max_nan_skips_in_row=2")
    with pytest.raises(Exception, match=r"update 5: non-finite loss .* 3 updates in a row"):
        train(dist_run, bad)


def test_context_parallel_and_thd_packing_match_plain_layout(dist_run, tmp_path):
    """The trainer at CP=2 (one-row and THD-packed layouts) logs the same loss, coefficients'
    statistics and gradient norm as at CP=1 for the same rollouts (partition invariance)."""
    keys = ("loss", "coef/mean", "coef/abs_max", "grad_norm", "pkl/credit_mean", "is/log_dev")
    runs = {}
    for name, extra, world in (("cp1", [], 1), ("cp2", ["parallel.context=2"], 2),
                               ("cp2_thd", ["parallel.context=2", "parallel.packing=thd"], 2)):
        cfg = cfg_for(tmp_path, name, "train.steps=2", "objective.horizon=3", *extra)
        train(dist_run, cfg, world=world)
        runs[name] = read_metrics(cfg.run_dir)
    for name in ("cp2", "cp2_thd"):
        for a, b in zip(runs["cp1"], runs[name]):
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (name, a["step"], k)


def test_thd_packing_at_cp1_with_token_balanced_micro_batches(dist_run, tmp_path):
    """THD packing without context parallelism (the local spec's attention refuses packed
    sequences) and token-budget micro-batches at DP = 2: the run trains and logs finite losses.
    The ranks start bare, as `megapkl train` starts them: the trainer's entry point installs the
    CPU compatibility layer itself."""
    from megapkl.train.local import _rank_main

    cfg = cfg_for(tmp_path, "thd_tokens", "parallel.packing=thd", "train.steps=2",
                  "parallel.max_tokens_per_micro_batch=24", "rollout.max_prompt_len=8", data=2)
    dist_run(_rank_main, 2, cfg, timeout=300, install_compat=False)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["loss"]) for r in rows)
