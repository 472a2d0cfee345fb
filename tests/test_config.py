"""Run config: presets load, overrides, extends layering, resolution and the dump/load round trip."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from megapkl.config import (ConfigError, ObjectiveConfig, RunConfig, config_from_dict, configs_dir,
                            dump_config, load_config, loads_config, parse_override)
from megapkl.config.yamlio import parse

CONFIGS = configs_dir()
# configs/models/ holds model-architecture files of the model room (a different schema, looked up by
# model.name); files named `_*.yaml` are fragments that experiments extend (tests/launch loads every
# experiment built on them); every other YAML under configs/ is a run config.
MODEL_YAML = sorted((CONFIGS / "models").glob("*.yaml"))
FRAGMENTS = sorted(CONFIGS.rglob("_*.yaml"))
ALL_YAML = sorted(p for p in CONFIGS.rglob("*.yaml") if p not in MODEL_YAML and p not in FRAGMENTS)


def test_every_fragment_is_extended_by_some_run():
    """A fragment that no run config extends is dead weight (or a typo in an `extends:`)."""
    texts = "\n".join(p.read_text() for p in ALL_YAML)
    for frag in FRAGMENTS:
        assert frag.name in texts, f"{_rel(frag)} is extended by no run config"


def _rel(p: Path) -> str:
    return str(p.relative_to(CONFIGS))


def _obj(name: str) -> RunConfig:
    return load_config(CONFIGS / "objectives" / name)


# ---- every shipped YAML loads, and round-trips through its dump

def test_configs_found():
    names = {_rel(p) for p in ALL_YAML}
    for need in ["base/default.yaml", "base/periodic_refresh.yaml", "base/controlled_staleness.yaml",
                 "base/uniform_stale.yaml", "demo/cpu_demo.yaml", "objectives/proximal_kl.yaml",
                 "objectives/grpo.yaml", "objectives/sis_dapo.yaml", "objectives/m2po.yaml"]:
        assert need in names


@pytest.mark.parametrize("path", ALL_YAML, ids=_rel)
def test_every_yaml_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert cfg == cfg.resolve()  # load_config returns the resolved config; resolve is idempotent
    text = dump_config(cfg)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(text)
    assert load_config(dumped) == cfg
    assert "extends" not in parse(text, "dump")[0]


@pytest.mark.parametrize("path", MODEL_YAML, ids=lambda p: p.name)
def test_model_yaml_parses(path):
    data, _ = parse(path.read_text(), str(path))
    assert isinstance(data, dict) and data


# ---- preset values (docs/spec.md section 10 and the paper tables)

def test_default_is_periodic_refresh_pkl():
    cfg = load_config(CONFIGS / "base" / "default.yaml")
    o = cfg.objective
    assert (o.name, o.horizon, o.beta, o.cost_clip, o.aggregation) == \
        ("proximal_kl", "full", 0.30, 0.05, "token_mean")
    r = cfg.rollout
    assert (r.protocol, r.refresh_every, r.prompts_per_batch, r.responses_per_prompt) == \
        ("periodic_refresh", 64, 32, 8)
    assert (r.max_prompt_len, r.max_response_len, r.temperature) == (1024, 16384, 1.0)
    assert cfg.reference.refresh_every == 16 and cfg.advantage.mode == "group_mean"
    assert (cfg.reward.correct, cfg.reward.incorrect) == (1.0, -1.0)
    assert cfg.train.lr == 1e-6 and cfg.train.grad_clip == 1.0
    assert cfg.train.seed == cfg.data.seed == cfg.seed


def test_controlled_staleness_preset():
    path = CONFIGS / "base" / "controlled_staleness.yaml"
    cfg = load_config(path)
    assert cfg.rollout.protocol == "controlled_staleness" and cfg.rollout.max_staleness == 4
    assert cfg.rollout.minibatches_per_batch == 4
    assert cfg.advantage.mode == "group_std" and cfg.reference.mode == "per_batch"
    assert cfg.reference.refresh_every is None
    assert (cfg.reward.correct, cfg.reward.incorrect) == (1.0, 0.0)
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps) == (0.9, 0.999, 1e-8)
    assert cfg.train.weight_decay == 0.0 and cfg.train.lr_schedule == "constant"
    assert path.read_text().count("# assumption:") >= 3


def test_uniform_stale_preset():
    cfg = load_config(CONFIGS / "base" / "uniform_stale.yaml")
    assert (cfg.rollout.protocol, cfg.rollout.max_staleness, cfg.rollout.snapshot_pool) == \
        ("uniform_stale", 32, 256)
    assert cfg.rollout.refresh_every is None


def test_demo_preset():
    cfg = load_config(CONFIGS / "demo" / "cpu_demo.yaml")
    assert cfg.model.name.startswith("tiny") and cfg.rollout.engine == "embedded"
    assert cfg.data.synthetic and cfg.data.train_path is None and cfg.reward.type == "synthetic"
    assert cfg.objective.name == "proximal_kl" and cfg.rollout.protocol == "periodic_refresh"
    assert cfg.parallel.data == 2


@pytest.mark.parametrize("name,expect", [
    ("proximal_kl.yaml", dict(horizon="full", beta=0.30, cost_clip=0.05)),
    ("proximal_kl_h64_b060.yaml", dict(horizon=64, beta=0.60, cost_clip=0.05)),
    ("proximal_kl_h32_tail_b025.yaml", dict(horizon=32, tail="linear", beta=0.25)),
    ("proximal_kl_h8_b025.yaml", dict(horizon=8, beta=0.25)),
    ("proximal_kl_onpolicy_b003.yaml", dict(horizon="full", beta=0.03, cost_clip=None)),
    ("grpo.yaml", dict(name="grpo", eps_clip_low=0.2, eps_clip_high=0.2)),
    ("dapo.yaml", dict(name="dapo", eps_clip_low=0.2, eps_clip_high=0.28)),
    ("pg.yaml", dict(name="pg")),
    ("cispo.yaml", dict(name="cispo", is_clip=(0.0, 5.0))),
    ("gspo.yaml", dict(name="gspo", eps_clip_low=3e-4, eps_clip_high=4e-4,
                       aggregation="seq_mean_token_mean")),
    ("seq_is.yaml", dict(name="seq_is", beta=0.30)),
    ("is_free.yaml", dict(name="is_free", beta=0.30)),
    ("tetpo.yaml", dict(name="tetpo", kappa=0.85, bisection_steps=24, eps_clip_low=0.2,
                        aggregation="seq_mean")),
    ("gepo.yaml", dict(name="gepo")),
    ("m2po.yaml", dict(name="m2po", m2_threshold=0.04)),
])
def test_objective_presets(name, expect):
    obj = _obj(name).objective
    for key, value in expect.items():
        assert getattr(obj, key) == value, key


def test_objective_presets_side_settings():
    assert _obj("grpo.yaml").reference.refresh_every == 32  # PKL Table 4
    assert _obj("proximal_kl_onpolicy_b003.yaml").reference.refresh_every == 50
    assert _obj("dapo.yaml").advantage.filter_constant_groups
    for name in ("sis_grpo.yaml", "sis_dapo.yaml", "sis_gspo.yaml"):
        cfg = _obj(name)
        assert cfg.objective.sis.enabled and cfg.objective.sis.top_k == 10
        assert cfg.rollout.topk_logprobs >= 10  # the rollout records the top-K envelope
    sis_grpo = _obj("sis_grpo.yaml")
    assert sis_grpo.objective.kl_init_coef == 1e-3 and sis_grpo.reference.kl_init is True
    assert _obj("sis_dapo.yaml").advantage.filter_constant_groups


def test_objective_preset_composes_with_protocol(tmp_path):
    """Each extended file is applied once, so grpo.yaml does not re-apply default.yaml."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"extends: [{CONFIGS}/base/controlled_staleness.yaml, "
                   f"{CONFIGS}/objectives/grpo.yaml]\nname: exp\nrollout:\n  max_staleness: 16\n")
    cfg = load_config(exp)
    assert cfg.name == "exp" and cfg.objective.name == "grpo"
    assert cfg.rollout.protocol == "controlled_staleness" and cfg.rollout.max_staleness == 16
    assert cfg.reference.mode == "per_batch" and cfg.advantage.mode == "group_std"


# ---- overrides

def test_overrides_values():
    cfg = load_config(CONFIGS / "objectives" / "proximal_kl.yaml", [
        "objective.beta=0.6", "objective.horizon=64", "objective.cost_clip=null",
        "objective.sis.enabled=true", "objective.sis.top_k=30", "train.lr=1e-5",
        "eval.benchmarks=[aime24]", "slurm.time=4:00:00", "name=pkl_h64"])
    o = cfg.objective
    assert (o.beta, o.horizon, o.cost_clip, o.sis.enabled, o.sis.top_k) == (0.6, 64, None, True, 30)
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert [b.name for b in cfg.eval.benchmarks] == ["aime24"]
    assert cfg.slurm.time == "4:00:00"  # not YAML 1.1's base-60 integer
    assert cfg.run_dir == "runs/pkl_h64" and cfg.rollout.topk_logprobs == 30


def test_override_list_and_full():
    cfg = load_config(CONFIGS / "objectives" / "cispo.yaml",
                      ["objective.is_clip=[0,2]", "objective.horizon=full"])
    assert cfg.objective.is_clip == (0.0, 2.0) and cfg.objective.horizon == "full"


def test_override_later_wins_and_creates_sections():
    cfg = config_from_dict({"data": {"train_path": "x.jsonl"}},
                           ["train.lr=1e-5", "train.lr=2e-5", "model.arch={num_heads: 4}"])
    assert cfg.train.lr == 2e-5 and cfg.model.arch == {"num_heads": 4}


def test_single_override_string():
    cfg = config_from_dict({"data": {"train_path": "x.jsonl"}}, "train.steps=3")
    assert cfg.train.steps == 3


def test_parse_override():
    assert parse_override("objective.is_clip=[0,5]") == ("objective.is_clip", [0, 5])
    assert parse_override("objective.cost_clip=null") == ("objective.cost_clip", None)
    assert parse_override("a.b= full ") == ("a.b", "full")
    assert parse_override("train.lr=1e-6") == ("train.lr", 1e-6)
    with pytest.raises(ConfigError):
        parse_override("a..b=1")


# ---- extends

def _files(tmp_path, **files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_extends_deep_merge_order(tmp_path):
    _files(tmp_path,
           **{"a.yaml": "data: {train_path: a.jsonl}\nobjective: {beta: 0.1, horizon: 8}\n"
                        "train: {lr: 1.0e-5, steps: 7}\n",
              "b.yaml": "objective: {beta: 0.2}\ntrain: {steps: 9}\n",
              "run.yaml": "extends: [a.yaml, b.yaml]\ntrain: {steps: 11}\n"})
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.objective.beta == 0.2 and cfg.objective.horizon == 8  # b over a, a's other keys kept
    assert cfg.train.lr == 1e-5 and cfg.train.steps == 11  # the file itself wins over its parents


def test_extends_relative_to_file_and_diamond(tmp_path):
    _files(tmp_path, **{
        "base/root.yaml": "data: {train_path: r.jsonl}\nrollout: {protocol: periodic_refresh}\n",
        "base/stale.yaml": "extends: root.yaml\nrollout: {protocol: uniform_stale, "
                           "max_staleness: 8, snapshot_pool: 8}\n",
        "obj/grpo.yaml": "extends: ../base/root.yaml\nobjective: {name: grpo}\n",
        "exp/run.yaml": "extends: [../base/stale.yaml, ../obj/grpo.yaml]\n"})
    cfg = load_config(tmp_path / "exp" / "run.yaml")
    assert cfg.rollout.protocol == "uniform_stale" and cfg.objective.name == "grpo"


def test_null_and_empty_sections(tmp_path):
    _files(tmp_path, **{"a.yaml": "data: {train_path: a.jsonl}\nobjective: {beta: 0.1}\n",
                        "run.yaml": "extends: a.yaml\nobjective:\ntrain:\n  grad_clip: null\n"})
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.objective.beta == 0.1  # an empty section header changes nothing
    assert cfg.train.grad_clip is None  # null is a value


def test_loads_config_text(tmp_path):
    _files(tmp_path, **{"a.yaml": "data: {train_path: a.jsonl}\n"})
    cfg = loads_config("extends: a.yaml\nobjective: {name: pg}\n", base_dir=tmp_path)
    assert cfg.objective.name == "pg" and cfg.data.train_path == "a.jsonl"


# ---- resolution and the typed core

def test_yaml_numbers():
    data, lines = parse("lr: 1e-6\neps: 1.0e-8\nn: 12\nt: 4:00:00\nh: 0x10\ninf: .inf\n", "t")
    assert data == {"lr": 1e-6, "eps": 1e-8, "n": 12, "t": "4:00:00", "h": 16, "inf": float("inf")}
    assert lines == {"lr": 1, "eps": 2, "n": 3, "t": 4, "h": 5, "inf": 6}


def test_resolution_fills_derived_defaults():
    cfg = config_from_dict({
        "name": "r", "seed": 7, "data": {"train_path": "x.jsonl"},
        "objective": {"name": "gspo"},
        "reference": {"mode": "behavior"},
        "rollout": {"protocol": "on_policy"},
        "slurm": {"nodes": 2, "gpus_per_node": 8},
        "parallel": {"tensor": 2},
        "eval": {"benchmarks": ["aime24", {"name": "math500", "greedy": True}]},
    })
    assert cfg.objective.eps_clip_low == 3e-4 and cfg.objective.aggregation == "seq_mean_token_mean"
    assert cfg.reference.refresh_every is None and cfg.reference.kl_init is False
    assert (cfg.rollout.refresh_every, cfg.rollout.max_staleness) == (1, 0)
    assert cfg.parallel.data == 8  # 16 GPUs / tensor 2
    assert cfg.train.seed == 7 and cfg.data.seed == 7
    assert cfg.checkpoint.dir == "runs/r/checkpoints" and cfg.slurm.job_name == "r"
    bench = {b.name: (b.greedy, b.n_samples) for b in cfg.eval.benchmarks}
    assert bench == {"aime24": (False, 16), "math500": (True, 1)}


def test_world_size_with_dedicated_sglang_gpus():
    """colocate false: every data-parallel replica has num_engines x tp GPUs of its own."""
    def cfg(sg, **par):
        return config_from_dict({"data": {"train_path": "x.jsonl"}, "parallel": par,
                                 "slurm": {"nodes": 1, "gpus_per_node": 8},
                                 "rollout": {"engine": "sglang",
                                             "sglang": {"colocate": False, **sg}}})

    c = cfg({"tp": 1, "num_engines": 1})
    assert c.world_size == 4 and c.parallel.data == 4
    c = cfg({"tp": 2, "num_engines": 1}, tensor=2)
    assert c.world_size == 4 and c.parallel.data == 2
    with pytest.raises(ConfigError, match="rollout.sglang.num_engines.*do not add up"):
        cfg({"tp": 2, "num_engines": 2})


def test_moe_detection():
    moe = config_from_dict({"data": {"train_path": "x.jsonl"}, "model": {"name": "qwen3-30b-a3b"},
                            "parallel": {"expert": 2}})
    assert moe.model.is_moe
    assert config_from_dict({"data": {"train_path": "x.jsonl"},
                             "model": {"name": "custom", "num_experts": 8}}).model.is_moe
    assert not config_from_dict({"data": {"train_path": "x.jsonl"}}).model.is_moe


def test_objective_from_dict_unchanged():
    obj = ObjectiveConfig.from_dict({"name": "dapo"})
    assert obj.eps_clip_high == 0.28 and obj.aggregation == "token_mean"


def test_run_config_sections_are_dataclasses():
    cfg = RunConfig()
    names = [f.name for f in dataclasses.fields(cfg)]
    for section in ["model", "parallel", "objective", "advantage", "reference", "rollout", "train",
                    "data", "reward", "eval", "logging", "checkpoint", "slurm", "seed", "name",
                    "run_dir"]:
        assert section in names


def test_config_does_not_import_torch():
    assert "megapkl.config" in sys.modules
    mods = [m for m in sys.modules if m.startswith("megapkl.config")]
    for name in mods:
        src = Path(sys.modules[name].__file__).read_text()
        assert "import torch" not in src, name
