"""Every paper experiment in configs/experiments/ loads, validates, fits 8-GPU nodes, has a parallel
layout its model architecture accepts, and dry-runs on the H100 and H200 cluster profiles."""
from __future__ import annotations

from pathlib import Path

import pytest
from job_inputs import job_inputs, visible_profile

from megapkl.config import load_config
from megapkl.launch.profile import load_profile
from megapkl.launch.submit import submit

from .conftest import TOY

ROOT = Path(__file__).resolve().parents[2] / "configs" / "experiments"
RUNS = sorted(p for p in ROOT.rglob("*.yaml") if not p.name.startswith("_"))


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_the_experiment_folders_are_populated() -> None:
    folders = {p.parent.name for p in RUNS}
    assert folders == {"pkl_periodic", "pkl_staleness", "sis_math", "sis_agent", "tetpo"}
    assert len([p for p in RUNS if p.parent.name == "sis_agent"]) == 13  # 2 x 6 + Table 7
    assert len([p for p in RUNS if p.parent.name == "pkl_periodic"]) == 16  # 4 sizes x 4 methods
    names = [load_config(p).name for p in RUNS]
    assert len(set(names)) == len(names), "run names must be unique (they name run directories)"


@pytest.mark.parametrize("path", RUNS, ids=_id)
def test_experiment_is_valid_and_fits_8_gpu_nodes(path: Path) -> None:
    from megapkl.models.spec import check_layout, load_spec

    cfg = load_config(path)
    assert cfg.slurm.gpus_per_node == 8 and cfg.slurm.nodes >= 1
    assert cfg.world_size == cfg.slurm.nodes * 8
    par = cfg.parallel
    assert par.data * par.tensor * par.pipeline * par.context == cfg.world_size
    assert par.tensor <= 8, "tensor parallelism stays inside one node (NVLink)"
    check_layout(load_spec(cfg.model.name), tp=par.tensor, pp=par.pipeline, ep=par.expert,
                 cp=par.context, vpp=par.virtual_pipeline,
                 sequence_parallel=par.sequence_parallel)
    sg = cfg.rollout.sglang
    if cfg.rollout.engine == "sglang":  # each replica's fleet fits the GPUs it is placed on
        from megapkl.launch.plan import check_fleet

        assert check_fleet(cfg).startswith("SGLang: ")
        assert par.data * sg.num_engines * sg.tp <= cfg.world_size


def test_the_1p7b_pkl_run_starts_one_server_per_gpu() -> None:
    """num_engines counts the servers of one data-parallel replica: 4 replicas (CP 2 on 8 GPUs)
    x 2 = 8 servers of 1 GPU, one on every GPU of the node."""
    from megapkl.config.layout import Layout
    from megapkl.rollout.sglang.placement import check_fleets

    cfg = load_config(ROOT / "pkl_periodic/qwen3_1p7b_pkl.yaml")
    par, sg = cfg.parallel, cfg.rollout.sglang
    lay = Layout.of(par, per_node=8)
    fleets = check_fleets(num_engines=sg.num_engines, tp=sg.tp, colocate=True, lay=lay,
                          every_node=sg.every_node)
    assert sorted(s.base_gpu for f in fleets for s in f) == list(range(8))


def test_the_32b_runs_generate_on_every_gpu_of_the_job() -> None:
    """A 32B replica (TP 8 x CP 2 x PP 2) trains on 4 nodes: its 8 servers of 4 GPUs are spread
    2 to a node, and the two replicas' 16 servers hold all 64 GPUs once."""
    from megapkl.config.layout import Layout
    from megapkl.rollout.sglang.placement import check_fleets

    cfg = load_config(ROOT / "pkl_periodic/qwen3_32b_pkl.yaml")
    par, sg = cfg.parallel, cfg.rollout.sglang
    lay = Layout.of(par, per_node=8)
    fleets = check_fleets(num_engines=sg.num_engines, tp=sg.tp, colocate=True, lay=lay,
                          every_node=sg.every_node)
    gpus = [(s.node, s.base_gpu + k) for f in fleets for s in f for k in range(sg.tp)]
    assert sorted(gpus) == [(n, g) for n in range(cfg.slurm.nodes) for g in range(8)]


@pytest.mark.parametrize("profile", ["h100", "h200"])
def test_experiments_dry_run_on_gpu_profiles(profile: str, tmp_path: Path) -> None:
    inputs = job_inputs(tmp_path)  # h200's container also mounts tmp_path: the job sees them
    prof = visible_profile(profile, tmp_path) if load_profile(profile).container else profile
    for path in RUNS:
        sub = submit(path, prof, [f"run_dir={tmp_path}/{path.stem}", *inputs], entry=TOY,
                     dry_run=True)
        cfg = load_config(path)
        assert f"#SBATCH --nodes={cfg.slurm.nodes}" in sub.script
        assert "#SBATCH --gpus-per-node=8" in sub.script and "#SBATCH --ntasks-per-node=8" in sub.script
        assert sub.spec.use_gpus


def test_paper_settings_spot_checks() -> None:
    def cfg(rel: str):
        return load_config(ROOT / rel)

    # PKL Table 4: 32 x 8, N = 64, lr 1e-6, FP8 W/A + BF16 KV, L = 16 (PKL) / 32 (GRPO), CISPO [0, 5].
    for size in ("1p7b", "4b", "8b", "32b"):
        pkl, grpo = cfg(f"pkl_periodic/qwen3_{size}_pkl.yaml"), cfg(f"pkl_periodic/qwen3_{size}_grpo.yaml")
        for c in (pkl, grpo):
            ro = c.rollout
            assert (ro.prompts_per_batch, ro.responses_per_prompt, ro.refresh_every) == (32, 8, 64)
            assert (ro.max_prompt_len, ro.max_response_len, ro.fp8, ro.kv_cache_dtype) == \
                (1024, 16384, True, "bf16")
            assert c.train.lr == 1e-6 and c.advantage.mode == "group_mean"
        assert pkl.reference.refresh_every == 16 and grpo.reference.refresh_every == 32
        assert (pkl.objective.beta, pkl.objective.horizon, pkl.objective.cost_clip) == (0.3, "full", 0.05)
    assert tuple(cfg("pkl_periodic/qwen3_8b_cispo.yaml").objective.is_clip) == (0.0, 5.0)
    assert cfg("pkl_periodic/qwen3_32b_pkl.yaml").model.hf_checkpoint == "Qwen/Qwen3-32B"
    # PKL Table 5 variants.
    c = cfg("pkl_staleness/qwen3_1p7b_pkl_h64_b060_s16_lr1e-5.yaml")
    assert (c.objective.horizon, c.objective.beta, c.train.lr, c.rollout.max_staleness) == (64, 0.6, 1e-5, 16)
    c = cfg("pkl_staleness/qwen3_4b_pkl_h32_tail_b025_s4.yaml")
    assert (c.objective.horizon, c.objective.tail, c.objective.beta) == (32, "linear", 0.25)
    assert c.advantage.filter_constant_groups and c.rollout.minibatches_per_batch == 4
    c = cfg("pkl_staleness/qwen3_1p7b_pkl_s0.yaml")
    assert (c.objective.beta, c.objective.cost_clip, c.reference.refresh_every) == (0.03, None, 50)
    assert c.rollout.protocol == "on_policy"
    # SIS Table 4: top-K per algorithm and architecture, routing replay on the MoE.
    assert cfg("sis_math/qwen3_8b_gspo_sis.yaml").objective.sis.top_k == 50
    assert cfg("sis_math/qwen3_30b_a3b_gspo_sis.yaml").objective.sis.top_k == 30
    assert cfg("sis_math/qwen3_8b_grpo.yaml").objective.kl_init_coef == 1e-3
    assert cfg("sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml").model.routing_replay
    # TETPO: uniform staleness k = 32 from a pool of 256.
    c = cfg("tetpo/qwen3_1p7b_tetpo.yaml")
    assert (c.rollout.protocol, c.rollout.max_staleness, c.rollout.snapshot_pool) == ("uniform_stale", 32, 256)
    assert c.objective.kappa == 0.85


# The papers' Llama-3.2-3B-Instruct runs repeat a Qwen3 block's recipe: TETPO App. B ("the same
# recipe" as Qwen3-Base-1.7B), SIS App. D.6 ("all hyperparameters identical to the Qwen3-8B-Base
# math setting"). Only the model, its layout and its SGLang fleet may differ.
LLAMA_TWINS = [(f"tetpo/llama3p2_3b_{m}.yaml", f"tetpo/qwen3_1p7b_{m}.yaml")
               for m in ("tetpo", "grpo", "gspo", "gepo", "m2po")] + \
    [(f"sis_math/llama3p2_3b_{m}{s}.yaml", f"sis_math/qwen3_8b_{m}{s}.yaml")
     for m in ("grpo", "dapo", "gspo") for s in ("", "_sis")]


@pytest.mark.parametrize("llama, qwen", LLAMA_TWINS, ids=[a for a, _ in LLAMA_TWINS])
def test_llama_runs_carry_the_qwen_blocks_values(llama: str, qwen: str) -> None:
    import dataclasses

    a, b = load_config(ROOT / llama), load_config(ROOT / qwen)
    assert a.model.name == "llama3.2-3b-instruct" and a.model.hf_checkpoint == \
        "meta-llama/Llama-3.2-3B-Instruct"
    for section in ("objective", "reference", "advantage", "reward", "train", "eval", "data"):
        assert getattr(a, section) == getattr(b, section), section
    no_dir = [dataclasses.replace(c.checkpoint, dir=None) for c in (a, b)]
    assert no_dir[0] == no_dir[1]
    ra, rb = (dataclasses.replace(c.rollout, sglang=None) for c in (a, b))
    assert ra == rb
    assert (a.slurm.nodes, a.slurm.gpus_per_node) == (b.slurm.nodes, b.slurm.gpus_per_node)
    assert a.name == b.name.replace("qwen3_1p7b", "llama3p2_3b").replace("t4_qwen3_8b",
                                                                         "t9_llama3p2_3b")


def _sweep_lines(path: Path) -> list[str]:
    """`# sweep: KEY=V1,V2 ...` header lines: the grid a run file is swept over (`megapkl sweep
    FILE --grid KEY=V1,V2`), for figures whose runs differ in one value."""
    return [ln.split(":", 1)[1].split() for ln in path.read_text().splitlines()
            if ln.startswith("# sweep:")]


SWEEPS = [p for p in RUNS if _sweep_lines(p)]


def test_the_papers_sweeps_are_declared() -> None:
    assert {_id(p) for p in SWEEPS} == {
        "pkl_staleness/qwen3_1p7b_grpo_s4.yaml", "pkl_staleness/qwen3_1p7b_pkl_s4.yaml",
        "sis_math/qwen3_8b_grpo_sis.yaml", "sis_math/qwen3_8b_dapo_sis.yaml", "sis_math/qwen3_8b_gspo_sis.yaml"}


@pytest.mark.parametrize("path", SWEEPS, ids=_id)
def test_every_sweep_element_is_a_valid_run(path: Path) -> None:
    from megapkl.config.typed import ConfigError
    from megapkl.launch.sweep import grid_elements, parse_grid

    for grid in _sweep_lines(path):
        elements = grid_elements(parse_grid(grid))
        assert len(elements) >= 2
        for _, overrides in elements:
            try:
                cfg = load_config(path, overrides)
            except ConfigError as e:  # name the element that failed
                raise AssertionError(f"{_id(path)} {overrides}: {e}") from e
            for ov in overrides:
                key, value = ov.split("=", 1)
                got = cfg
                for part in key.split("."):
                    got = getattr(got, part)
                assert str(got) == value or got == (None if value == "null" else float(value)), (ov, got)


def test_paper_values_fixed_against_the_papers() -> None:
    def cfg(rel: str):
        return load_config(ROOT / rel)

    # SIS 4.1: "Avg@1 accuracy for most tasks and Avg@32 for the smaller AMC23, AIME24, and AIME25"
    for run in ("sis_math/qwen3_8b_grpo.yaml", "sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml"):
        ev = {b.name: b for b in cfg(run).eval.resolved_benchmarks()}
        assert {n: (b.greedy, b.n_samples) for n, b in ev.items()} == {
            "math500": (False, 1), "amc23": (False, 32), "aime24": (False, 32), "aime25": (False, 32)}
        assert (cfg(run).eval.temperature, cfg(run).eval.top_p) == (1.0, 0.7)
    # SIS eq. 15: GRPO is a per-sequence mean; DAPO (eq. 34) a token mean.
    for run in ("qwen3_8b_grpo", "qwen3_8b_grpo_sis", "qwen3_30b_a3b_grpo", "qwen3_30b_a3b_grpo_sis",
                "qwen3_8b_grpo_n16", "qwen3_8b_pg", "qwen3_8b_no_is", "qwen3_8b_dppo_tv"):
        assert cfg(f"sis_math/{run}.yaml").objective.aggregation == "seq_mean_token_mean", run
    assert cfg("sis_math/qwen3_8b_dapo.yaml").objective.aggregation == "token_mean"
    # TETPO App. B: eps_lo = eps_hi = 0.2 for every method, GSPO included.
    for run in ("gspo", "grpo", "gepo", "tetpo"):
        o = cfg(f"tetpo/qwen3_1p7b_{run}.yaml").objective
        assert (o.eps_clip_low, o.eps_clip_high) == (0.2, 0.2), run
    # SIS Table 8: N minibatches of 256 prompts.
    for n in (8, 16):
        ro = cfg(f"sis_math/qwen3_8b_gspo_sis_n{n}.yaml").rollout
        assert (ro.minibatches_per_batch, ro.prompts_per_batch) == (n, 256 * n)
    # SIS Table 2 variants.
    assert cfg("sis_math/qwen3_8b_no_is.yaml").objective.beta == 0.0
    assert tuple(cfg("sis_math/qwen3_8b_cispo.yaml").objective.is_clip) == (0.0, 1.28)
    assert cfg("sis_math/qwen3_8b_dppo_tv.yaml").rollout.topk_logprobs == 10
    assert cfg("sis_math/qwen3_8b_pg_sis.yaml").objective.sis.enabled
    # PKL Table 1 / ablations.
    c = cfg("pkl_staleness/qwen3_1p7b_pkl_s0_mb4.yaml")
    assert (c.rollout.minibatches_per_batch, c.rollout.max_staleness, c.objective.beta,
            c.objective.cost_clip, c.reference.refresh_every) == (4, 0, 0.03, None, 50)
    assert cfg("pkl_staleness/qwen3_1p7b_grpo_s0_mb4.yaml").rollout.minibatches_per_batch == 4
    for run in ("grpo_s4_lr1e-5", "pkl_s4_lr1e-5", "pg_s4_lr1e-5", "pg_s16_lr1e-5"):
        assert cfg(f"pkl_staleness/qwen3_1p7b_{run}.yaml").train.lr == 1e-5, run
    assert cfg("pkl_staleness/qwen3_1p7b_pkl_s4_perturb.yaml").advantage.perturb_baseline
    assert not cfg("pkl_staleness/qwen3_1p7b_pkl_s4.yaml").advantage.perturb_baseline
    c = cfg("pkl_staleness/qwen3_1p7b_pkl_h1_b480_s4.yaml").objective
    assert (c.horizon, c.beta) == (1, 4.8)
    c = cfg("pkl_staleness/qwen3_1p7b_grpo_s4_lr1e-5_clip04.yaml")
    assert (c.objective.eps_clip_low, c.objective.eps_clip_high, c.train.lr) == (0.4, 0.4, 1e-5)
    assert cfg("pkl_staleness/qwen3_1p7b_seq_is_s16.yaml").rollout.max_staleness == 16


def test_plan_says_how_many_training_gpus_generate_and_why_not() -> None:
    """The 32B runs (2 replicas of 32 GPUs on 4 nodes each) generate on all 64 GPUs; with the
    fleet on each leader's node (every_node false) or too few servers, the line says why not."""
    from megapkl.launch.plan import check_fleet

    def line(name, *extra):
        return check_fleet(load_config(ROOT / f"pkl_periodic/{name}.yaml", list(extra)))

    assert line("qwen3_32b_pkl").endswith(
        "= 16 servers on 64 GPUs, colocated on the replicas' GPUs, fleets on 4 node(s) per "
        "replica, 2 server(s) on each; 64 of the 64 training GPUs generate")
    old = line("qwen3_32b_pkl", "rollout.sglang.every_node=false", "rollout.sglang.num_engines=2")
    assert old.endswith(
        "fleets on 1 node(s) of each replica's 4, 2 server(s) on each; 16 of the 64 training "
        "GPUs generate (48 idle: rollout.sglang.every_node false: a replica's servers only on "
        "its leader's node, 8 of its 32 GPUs)"), old
    few = line("qwen3_32b_pkl", "rollout.sglang.num_engines=2")
    assert few.endswith(
        "fleets on 2 node(s) of each replica's 4, 1 server(s) on each; 16 of the 64 training "
        "GPUs generate (48 idle: rollout.sglang.num_engines 2, where a replica's GPUs take up "
        "to 8 servers of 4 GPU(s))"), few
    assert "idle" not in line("qwen3_8b_pkl")
    assert line("qwen3_1p7b_pkl", "rollout.sglang.num_engines=1").endswith(
        "; 4 of the 8 training GPUs generate (4 idle: rollout.sglang.num_engines 1, where a "
        "replica's GPUs take up to 2 servers of 1 GPU(s))")


AGENT = {"grpo": (1e-3, 0.2, 0.2), "dapo": (0.0, 0.2, 0.28), "gspo": (0.0, 3e-4, 4e-4)}


@pytest.mark.parametrize("model", ["8b", "14b"])
@pytest.mark.parametrize("algo", list(AGENT))
@pytest.mark.parametrize("sis", [False, True])
def test_the_agent_runs_carry_sis_table_5(model: str, algo: str, sis: bool) -> None:
    """SIS Table 5 (agent): lr 1e-6, mini-batch 64 of a global batch of 256 prompts, 8 responses,
    4,096 / 4,096 tokens, 800 steps, temperature 1.0 (eval 1.0 / 1.0), KL 1e-3 (GRPO) or 0,
    top-K 50, the clip range per algorithm, 16 GPUs; Search-R1's turns, passages and budgets; the
    six QA sets at one sample each."""
    c = load_config(ROOT / f"sis_agent/qwen3_{model}_{algo}{'_sis' if sis else ''}.yaml")
    ro, o, kl_eps = c.rollout, c.objective, AGENT[algo]
    assert c.model.name == f"qwen3-{model}" and c.model.hf_checkpoint == \
        f"Qwen/Qwen3-{model.upper()}-Base"
    assert (c.train.lr, c.train.steps, ro.prompts_per_batch, ro.minibatches_per_batch,
            ro.responses_per_prompt, ro.max_prompt_len, ro.max_response_len) == \
        (1e-6, 800, 256, 4, 8, 4096, 4096)
    assert (ro.temperature, ro.top_p, c.eval.temperature, c.eval.top_p) == (1.0, 1.0, 1.0, 1.0)
    assert (o.name, o.kl_init_coef, o.eps_clip_low, o.eps_clip_high) == (algo, *kl_eps)
    assert o.sis.enabled == sis and (not sis or o.sis.top_k == 50) and o.entropy_coef == 0
    assert c.world_size == 16 and c.rollout.sglang.colocate
    assert (c.reward.type, c.data.prompt_template, c.env.type) == ("answer_em", "sis_agent", "search")
    assert (c.env.max_turns, c.env.max_turn_tokens, c.env.max_observation_tokens,
            c.env.search.topk) == (5, 500, 500, 3)
    assert {b.name: (b.greedy, b.n_samples) for b in c.eval.resolved_benchmarks()} == {
        n: (False, 1) for n in ("nq", "triviaqa", "popqa", "hotpotqa", "musique", "bamboogle")}


def test_table_7_agent_row_is_grpo_with_sis_and_no_clip() -> None:
    c = load_config(ROOT / "sis_agent/qwen3_8b_pg_sis.yaml")
    grpo = load_config(ROOT / "sis_agent/qwen3_8b_grpo_sis.yaml")
    assert c.objective.name == "pg" and c.objective.sis.enabled and c.objective.sis.top_k == 50
    assert (c.objective.kl_init_coef, c.objective.aggregation) == \
        (grpo.objective.kl_init_coef, grpo.objective.aggregation)
    assert (c.rollout, c.train, c.env, c.eval) == (grpo.rollout, grpo.train, grpo.env, grpo.eval)
