"""Bad configs: every error names the dotted key and the file (and line) that set it."""
from __future__ import annotations

import textwrap

import pytest

from megapkl.config import ConfigError, load_config

BASE = "data:\n  train_path: d.jsonl\n"

# (id, run.yaml text (extends base.yaml unless it says otherwise), overrides,
#  expected key, expected source ('run.yaml', 'base.yaml', '<override>', ...), line or None, text)
CASES = [
    ("unknown-top", "objectiv:\n  beta: 0.3\n", [], "objectiv", "run.yaml", 2,
     "did you mean 'objective'"),
    ("unknown-nested", "objective:\n  bta: 0.3\n", [], "objective.bta", "run.yaml", 3,
     "did you mean 'beta'"),
    ("unknown-deep", "rollout:\n  sglang:\n    tpp: 2\n", [], "rollout.sglang.tpp", "run.yaml", 4,
     "did you mean 'tp'"),
    ("unknown-list-item", "eval:\n  benchmarks:\n    - {name: aime24, greddy: true}\n", [],
     "eval.benchmarks[0].greddy", "run.yaml", 4, "did you mean 'greedy'"),
    ("type-number", "train:\n  lr: fast\n", [], "train.lr", "run.yaml", 3, "expected a number"),
    ("retired-at-another-value", "logging:\n  jsonl: true\n  every: 10\n", [], "logging.every",
     "run.yaml", 4, "removed key 'every' (every update is logged): it can only be 1"),
    ("retired-wrong-type", "logging:\n  jsonl: 1\n", [], "logging.jsonl", "run.yaml", 3,
     "it can only be True"),
    ("type-bool", "data:\n  shuffle: 3\n", [], "data.shuffle", "run.yaml", 3, "boolean"),
    ("type-section", "rollout: 5\n", [], "rollout", "run.yaml", 2, "expected a mapping"),
    ("range-top-p", "rollout:\n  top_p: 1.5\n", [], "rollout.top_p", "run.yaml", 3, "<= 1.0"),
    ("range-top-p-zero", "rollout:\n  top_p: 0\n", [], "rollout.top_p", "run.yaml", 3, "> 0.0"),
    ("range-group", "rollout:\n  responses_per_prompt: 0\n", [], "rollout.responses_per_prompt",
     "run.yaml", 3, ">= 1"),
    ("top-k-zero", "rollout:\n  top_k: 0\n", [], "rollout.top_k", "run.yaml", 3, "-1 (off)"),
    ("enum-advantage", "advantage:\n  mode: group_stdd\n", [], "advantage.mode", "run.yaml", 3,
     "did you mean 'group_std'"),
    ("enum-objective", "objective:\n  name: grop\n", [], "objective.name", "run.yaml", 3,
     "did you mean 'grpo'"),
    ("enum-horizon", "objective:\n  horizon: fulll\n", [], "objective.horizon", "run.yaml", 3,
     "did you mean 'full'"),
    ("staleness-missing", "rollout:\n  protocol: controlled_staleness\n", [],
     "rollout.max_staleness", "run.yaml", 3, "max_staleness >= 0"),
    ("pool-too-small", "rollout:\n  protocol: uniform_stale\n  max_staleness: 32\n"
     "  snapshot_pool: 16\n", [], "rollout.snapshot_pool", "run.yaml", 5, ">= 32"),
    ("on-policy-refresh", "rollout:\n  protocol: on_policy\n  refresh_every: 64\n", [],
     "rollout.refresh_every", "run.yaml", 4, "must be 1 or null"),
    ("periodic-staleness", "rollout:\n  max_staleness: 4\n", [], "rollout.max_staleness",
     "run.yaml", 3, "controlled_staleness and uniform_stale"),
    ("minibatches", "rollout:\n  prompts_per_batch: 30\n  minibatches_per_batch: 4\n", [],
     "rollout.minibatches_per_batch", "run.yaml", 4, "whole prompt groups"),
    ("kv-fp8-embedded", "rollout:\n  engine: embedded\n  kv_cache_dtype: fp8_e4m3\n", [],
     "rollout.kv_cache_dtype", "run.yaml", 4, "sglang"),
    ("async-embedded", "rollout:\n  engine: embedded\n  async_batches: 2\n", [],
     "rollout.async_batches", "run.yaml", 4, "colocate: false"),
    ("async-colocated", "rollout:\n  engine: sglang\n  async_batches: 1\n", [],
     "rollout.async_batches", "run.yaml", 4, "off the trainer's process and GPUs"),
    ("sglang-ep", "rollout:\n  sglang:\n    tp: 2\n    ep: 4\n", [], "rollout.sglang.ep",
     "run.yaml", 5, "must divide"),
    ("reference-refresh", "reference:\n  mode: snapshot\n  refresh_every: null\n", [],
     "reference.refresh_every", "run.yaml", 4, "needs refresh_every"),
    ("kl-init", "objective:\n  kl_init_coef: 0.001\nreference:\n  kl_init: false\n", [],
     "reference.kl_init", "run.yaml", 5, "objective.kl_init_coef"),
    ("group-std-one", "advantage:\n  mode: group_std\nrollout:\n  responses_per_prompt: 1\n", [],
     "rollout.responses_per_prompt", "run.yaml", 5, ">= 2"),
    ("norm-constant", "objective:\n  aggregation: token_sum_norm\n", [], "objective.norm_constant",
     "run.yaml", None, "norm_constant"),
    ("tail-full", "objective:\n  tail: linear\n", [], "objective.tail", "run.yaml", 3,
     "integer horizon"),
    ("sis-tetpo", "objective:\n  name: tetpo\n  sis: {enabled: true}\n", [],
     "objective.sis.enabled", "run.yaml", 4, "SIS"),
    ("dppo-no-topk", "objective:\n  name: dppo_tv\nrollout:\n  topk_logprobs: 0\n", [],
     "rollout.topk_logprobs", "run.yaml", 5, "behavior top-K"),
    ("seq-parallel", "parallel:\n  sequence_parallel: true\n", [], "parallel.sequence_parallel",
     "run.yaml", 3, "tensor > 1"),
    ("expert-dense", "parallel:\n  expert: 2\n", [], "parallel.expert", "run.yaml", 3,
     "mixture-of-experts"),
    ("world-size", "parallel:\n  data: 2\nslurm:\n  nodes: 1\n  gpus_per_node: 8\n", [],
     "parallel.data", "run.yaml", 3, "must equal the trainer world size 8"),
    ("layers-pipeline", "model:\n  num_layers: 28\nparallel:\n  pipeline: 3\n", [],
     "parallel.pipeline", "run.yaml", 5, "28 layers"),
    ("reward-data", "reward:\n  type: math\ndata:\n  train_path: null\n  synthetic: add_mod10\n", [],
     "reward.type", "run.yaml", 3, "synthetic"),
    ("data-both", "data:\n  synthetic: add_mod10\n", [], "data.synthetic", "run.yaml", 3,
     "exclusive"),
    ("data-suffix", "data:\n  train_path: prompts.csv\n", [], "data.train_path", "run.yaml", 3,
     ".jsonl"),
    ("warmup", "train:\n  steps: 10\n  warmup_steps: 10\n", [], "train.warmup_steps", "run.yaml",
     4, "< train.steps"),
    ("slurm-time", "slurm:\n  time: four hours\n", [], "slurm.time", "run.yaml", 3,
     "Slurm time"),
    ("greedy-samples", "eval:\n  greedy: true\n  benchmarks:\n    - {name: aime24, n_samples: 16}\n",
     [], "eval.benchmarks[0]", "run.yaml", 5, "greedy"),
    ("duplicate-key", "train:\n  lr: 1e-6\n  lr: 2e-6\n", [], "train.lr", "run.yaml", 4,
     "duplicate key"),
    ("override-unknown", "", ["objective.bta=0.3"], "objective.bta", "<override>", None,
     "did you mean 'beta'"),
    ("override-type", "", ["train.steps=abc"], "train.steps", "<override>", None,
     "expected an integer"),
    ("override-conflict", "", ["rollout.protocol=controlled_staleness"], "rollout.max_staleness",
     "<override>", None, "max_staleness >= 0"),
    ("override-no-equals", "", ["objective.beta"], "", "<override>", None, "KEY=VALUE"),
    ("override-bad-yaml", "", ["objective.is_clip=[0,5"], "objective.is_clip", "<override>", None,
     "cannot parse"),
    ("override-extends", "", ["extends=x.yaml"], "extends", "<override>", None, "only be set"),
    ("base-file-key", None, [], "train.lrr", "base.yaml", 5, "did you mean 'lr'"),
    ("extends-missing", "!extends: nothere.yaml\n", [], "extends", "run.yaml", 1, "nothere.yaml"),
    ("extends-type", "!extends: 3\n", [], "extends", "run.yaml", 1, "file path"),
    ("extends-cycle", "!extends: loop_a.yaml\n", [], "extends", "loop_b.yaml", 1,
     "loop_a.yaml -> loop_b.yaml -> loop_a.yaml"),
    ("yaml-syntax", "objective:\n  beta: [0.3\ntrain:\n  lr: 1\n", [], "", "run.yaml", None,
     "YAML syntax error"),
    ("top-level-list", "!- a\n- b\n", [], "", "run.yaml", 1, "must be a mapping"),
    ("bad-name", "name: my run\n", [], "name", "run.yaml", 2, "file-name-safe"),
]


def _write(tmp_path, text):
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "loop_a.yaml").write_text("extends: loop_b.yaml\n")
    (tmp_path / "loop_b.yaml").write_text("extends: loop_a.yaml\n")
    if text is None:  # a bad key in the extended file
        (tmp_path / "base.yaml").write_text(BASE + "train:\n  steps: 5\n  lrr: 1.0\n")
        text = ""
    if text.startswith("!"):  # no implicit `extends: base.yaml`
        body = text[1:]
    else:
        body = "extends: base.yaml\n" + text
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return path


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_config(tmp_path, monkeypatch, case):
    _, text, overrides, key, source, line, fragment = case
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    exc = info.value
    msg = str(exc)
    assert exc.key == key, msg
    assert exc.source.endswith(source), msg
    if line is not None:
        assert exc.line == line, msg
        assert f"{source}:{line}:" in msg
    if key:
        assert f"{key}:" in msg
    assert fragment in msg
    assert "\n" not in msg


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_related_key_location_is_reported(tmp_path, monkeypatch):
    """A cross-file conflict names where the other key was set."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.yaml").write_text(BASE + "rollout:\n  protocol: uniform_stale\n"
                                        "  max_staleness: 32\n")
    (tmp_path / "run.yaml").write_text("extends: base.yaml\nrollout:\n  snapshot_pool: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "run.yaml")
    msg = str(info.value)
    assert msg.startswith("run.yaml:3: rollout.snapshot_pool:")
    assert "rollout.max_staleness is set in base.yaml:5" in msg


def test_missing_top_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_syntax_error_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(textwrap.dedent("""\
        data:
          train_path: d.jsonl
        objective:
          beta: 0.3
            horizon: 8
        """))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "run.yaml")
    assert info.value.source == "run.yaml"
    assert info.value.line == 5
    assert str(info.value).startswith("run.yaml:5: YAML syntax error")


def test_a_run_config_written_by_an_older_version_still_loads(tmp_path):
    """<run_dir>/config.yaml of runs made before logging.jsonl and logging.every were removed
    holds them at the values that are now always the behaviour: it loads as the same config."""
    from megapkl.config import dump_config

    cfg = load_config("configs/demo/cpu_demo.yaml", [f"run_dir={tmp_path}"])
    text = dump_config(cfg)
    old = text.replace("logging:\n", "logging:\n  jsonl: true\n  every: 1\n", 1)
    assert old != text
    (tmp_path / "config.yaml").write_text(old)
    assert dump_config(load_config(str(tmp_path / "config.yaml"))) == text
