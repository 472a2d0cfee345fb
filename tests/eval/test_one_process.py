"""Every paper run directory, as configured, planned for `megapkl eval` and `megapkl diagnose` in one
process (no model built): the layout reset to one rank, the rollout fleet to what that one process
places on the machine (placement.py's own check passes on the reshaped config), or a refusal up
front with the memory figures when the model does not fit one GPU."""
from pathlib import Path

import pytest

from megapkl.analysis.eval_cli import SINGLE_PROCESS, one_gpu_bytes, one_process
from megapkl.config import load_config
from megapkl.eval.runner import EvalError
from megapkl.config.layout import Layout
from megapkl.rollout.sglang.placement import check_fleets

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(p for p in (REPO / "configs" / "experiments").rglob("*.yaml")
              if not p.name.startswith("_"))
# (GPUs, GiB each): an 8 x H100 node, an 8 x H200 node, one H100, a CPU machine
MACHINES = {"8xh100": (8, 80.0), "8xh200": (8, 141.0), "1xh100": (1, 80.0), "cpu": (0, None)}


def placed_config(path: Path, machine: str, learner: bool = False):
    """The reshaped config of run config `path` on `machine`; its fleet checked as the launcher
    checks it (this process: one trainer rank on GPU 0)."""
    gpus, gib = MACHINES[machine]
    cfg = load_config(path, list(SINGLE_PROCESS))
    placed = one_process(cfg, gpus=gpus, gpu_gib=gib, learner=learner)
    cfg = load_config(path, [*SINGLE_PROCESS, *placed.overrides])
    sg = cfg.rollout.sglang
    check_fleets(num_engines=sg.num_engines, tp=sg.tp, colocate=sg.colocate, lay=Layout(),
                 nodes=1, gpus_per_node=gpus or None)
    return cfg, placed


def test_the_paper_configs_are_all_here():
    assert len(RUNS) == 107, [p.name for p in RUNS]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_eval_and_diagnose_planning_of_every_paper_run(path):
    # eval: an 8-GPU node and a CPU machine place every run (a 32B replica's fleet of 8 x 4 GPUs
    # keeps one server of 4 GPUs beside this process's GPU)
    for machine in ("8xh100", "8xh200", "cpu"):
        cfg, placed = placed_config(path, machine)
        assert placed.says and cfg.parallel.data == 1 and cfg.slurm.nodes is None
        if machine == "cpu":
            assert cfg.rollout.sglang.num_engines == 1 and cfg.rollout.sglang.tp == 1
    big = cfg.model.name in ("qwen3-32b", "qwen3-30b-a3b")
    # one 80 GB GPU: the policy plus an engine copy of a 32B / 30B-A3B model does not fit
    if big:
        with pytest.raises(EvalError, match=rf"eval: {cfg.model.name} needs about \d+\.\d GiB on "
                                            r"one GPU \(weights \d+\.\d \+ engine copy"):
            placed_config(path, "1xh100")
    else:
        placed_config(path, "1xh100")
    # diagnose builds a Learner (gradients, optimizer, reference snapshot): 1.7B, 3B and 4B only
    rows = one_gpu_bytes(cfg, learner=True, dedicated=True)
    assert "gradients, optimizer, reference" in rows
    if cfg.model.name in ("qwen3-1.7b", "qwen3-4b", "llama3.2-3b-instruct"):
        placed_config(path, "8xh200", learner=True)
    else:
        with pytest.raises(EvalError, match="what works instead: a config of a smaller model"):
            placed_config(path, "8xh200", learner=True)


def test_the_fleet_is_kept_where_it_fits_and_said():
    path = REPO / "configs" / "experiments" / "pkl_periodic" / "qwen3_32b_pkl.yaml"
    cfg, placed = placed_config(path, "8xh100")
    assert (cfg.rollout.sglang.num_engines, cfg.rollout.sglang.tp) == (1, 4)
    assert not cfg.rollout.sglang.colocate
    assert "1 of the 8 SGLang servers of a replica of the run" in placed.says
    small = REPO / "configs" / "experiments" / "pkl_periodic" / "qwen3_4b_pkl.yaml"
    cfg, placed = placed_config(small, "8xh100")
    assert (cfg.rollout.sglang.num_engines, cfg.rollout.sglang.tp) == (4, 1)
    assert placed.says.startswith("the run's SGLang fleet (4 x 1 GPU(s)) on GPUs 1-4")
    _, placed = placed_config(small, "cpu")
    assert placed.says.startswith("one SGLang server on this process's CPU")


def test_eval_and_diagnose_take_key_value_anywhere():
    from megapkl.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["eval", "RUN", "--step", "1", "eval.n_samples=4", "--out", "o"])
    assert (args.overrides, args.step, args.out) == (["eval.n_samples=4"], 1, "o")
    args = parse(["diagnose", "correction-variance", "RUN", "--prompts", "2", "seed=3",
                  "--responses", "2"])
    assert (args.overrides, args.prompts, args.responses) == (["seed=3"], 2, 2)
    assert (args.beta, args.eps_f) == (None, None)  # the run's own, unless given
