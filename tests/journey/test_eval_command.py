"""`megapkl eval`'s own rules, without a run: command-line `eval.greedy` / `eval.n_samples` reach
every benchmark of a resolved config, and FP8 runs are evaluated on FP8 weights as in training."""
import torch

from megapkl.analysis.eval_cli import apply_section_overrides, engine_weights, section_overrides
from megapkl.config import load_config
from megapkl.eval.runner import Benchmark

from .workspace import REPO

PKL = REPO / "configs" / "experiments" / "pkl_periodic" / "qwen3_1p7b_pkl.yaml"


def bench(name, greedy, n):
    return Benchmark(name, items=[], ids=[], greedy=greedy, n_samples=n, kind="math")


def test_section_overrides_reach_every_benchmark():
    assert section_overrides(["eval.n_samples=32", "eval.temperature=0.6", "seed=3"]) == \
        {"n_samples": 32}
    benches = [bench("math500", True, 1), bench("aime24", False, 16)]
    apply_section_overrides(benches, {"n_samples": 32}, 32)
    assert [(b.greedy, b.n_samples) for b in benches] == [(True, 1), (False, 32)]
    apply_section_overrides(benches, {"greedy": False}, 4)  # greedy ones now sample n_default
    assert [(b.greedy, b.n_samples) for b in benches] == [(False, 4), (False, 32)]
    apply_section_overrides(benches, {"greedy": True}, 4)
    assert [(b.greedy, b.n_samples) for b in benches] == [(True, 1), (True, 1)]
    apply_section_overrides(benches, {}, 4)  # nothing given: nothing changes
    assert [(b.greedy, b.n_samples) for b in benches] == [(True, 1), (True, 1)]


def test_fp8_runs_are_evaluated_on_fp8_weights():
    w = torch.randn(256, 128)
    weights = [("model.layers.0.mlp.down_proj.weight", w), ("model.norm.weight", torch.ones(128))]
    fp8 = load_config(PKL)
    assert fp8.rollout.fp8
    names = [(n, t.dtype) for n, t in engine_weights(fp8, iter(weights))]
    assert names == [("model.layers.0.mlp.down_proj.weight", torch.float8_e4m3fn),
                     ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.float32),
                     ("model.norm.weight", torch.float32)]
    bf16 = load_config(PKL, ["rollout.fp8=false"])
    assert list(engine_weights(bf16, iter(weights))) == weights
