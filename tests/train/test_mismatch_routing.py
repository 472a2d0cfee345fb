"""MoE routing mismatch (mismatch/routing_disagree): the engine's routed experts against the
trainer's own routing on the real megatron-core tiny Qwen3-MoE, with the embedded engine."""
from __future__ import annotations

import pytest
import torch

from megapkl.config import load_config
from megapkl.train.mismatch import layer_differs, routing_parts

MOE = ["model.name=tiny-qwen3-moe", "model.routing_replay=true", "logging.tensorboard=false",
       "logging.progress_bar=false", "rollout.prompts_per_batch=4",
       "rollout.responses_per_prompt=4", "rollout.max_response_len=4",
       "parallel.micro_batch_size=8", "rollout.temperature=0.8", "checkpoint.every=0",
       "reference.mode=snapshot"]


def test_sets_not_order_and_counted_rows_only():
    engine = [torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([[2, 3], [0, 1], [3, 2]])]
    own = [torch.tensor([[1, 0], [2, 1], [0, 1]]), torch.tensor([[3, 2], [0, 1], [3, 1]])]
    d = layer_differs(engine, own)
    assert d.tolist() == [[False, False], [True, False], [False, True]]
    parts = routing_parts(d, torch.tensor([True, True, False]))
    assert parts.tolist() == [2.0, 1.0, 1.0, 0.0]   # tokens, any layer, layer 0, layer 1


def _perturb_routers(model, scale: float) -> None:
    from megapkl.parallel.replay import moe_routers

    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, router in moe_routers(model):
            w = router.weight
            w.add_(scale * w.abs().mean() * torch.randn(w.shape, generator=gen).to(w))


def _trainer(cfg):
    """A trainer whose run context stays open for the worker's life (the forked rank exits)."""
    from megapkl.train.loop import Trainer
    from megapkl.train.run_context import RunContext

    return Trainer(cfg, RunContext().__enter__())


def worker(rank, world, cfg):
    """Measured at a fresh version (the learner holds the weights that generated the samples):
    as is, and after perturbing the trainer's router weights; plus the routers' own choice under
    a replay of deliberately wrong experts (the first MoE layer's choice must not move)."""
    import dataclasses

    from megapkl.train.mismatch import exact_version_metrics

    t = _trainer(cfg)
    plan = t.schedule.plan(0)
    t.keep_weights(plan)
    samples = t.rollouts.collect(0, list(plan.group_versions))
    mbs = t.learner.pack(samples)
    exact = exact_version_metrics(t.learner, samples, mbs, 0)
    # R3 on wrong experts changes the forward, not what the routers would pick
    experts = t.learner.spec.num_experts
    shifted = [dataclasses.replace(s, routed_experts=(s.routed_experts + 1) % experts)
               for s in samples]
    with t.learner.own_routing() as own_right:
        t.learner.logprobs(mbs)
    with t.learner.own_routing() as own_wrong:
        t.learner.logprobs(t.learner.pack(shifted))
    # layer 0's input does not depend on any routing: its own choice must not move (later
    # layers see the hidden states the wrong experts produced)
    same_own = all(torch.equal(x[0], y[0]) for x, y in zip(own_right, own_wrong, strict=True))
    # an engine that returns no routing: the routing metrics are absent, not zero
    bare = [dataclasses.replace(s, routed_experts=None) for s in samples]
    absent = exact_version_metrics(t.learner, bare, t.learner.pack(bare), 0)
    assert "mismatch/k3_kl" in absent and not any("routing" in k for k in absent), absent
    _perturb_routers(t.learner.model, 0.3)
    perturbed = exact_version_metrics(t.learner, samples, mbs, 0)
    return exact, perturbed, same_own


def test_fresh_version_zero_and_perturbed_positive(dist_run, tmp_path):
    cfg = load_config("configs/demo/cpu_demo.yaml", [*MOE, "parallel.data=1",
                                                    f"run_dir={tmp_path / 'r'}"])
    exact, perturbed, same_own = dist_run(worker, 1, cfg, timeout=240)[0]
    print(f"routing disagreement: exact {exact.get('mismatch/routing_disagree')} "
          f"perturbed {perturbed.get('mismatch/routing_disagree')} over "
          f"{exact.get('mismatch/routing_tokens')} tokens; {perturbed}")
    assert exact["mismatch/routing_tokens"] == exact["mismatch/tokens"] > 0
    assert exact["mismatch/routing_disagree"] == 0.0
    assert same_own, "the recorded routing followed the replayed experts, not the router"
    assert perturbed["mismatch/routing_disagree"] > 0.05
    layers = [perturbed[f"mismatch/routing_disagree_layer{i}"] for i in range(2)]
    assert max(layers) <= perturbed["mismatch/routing_disagree"] <= sum(layers)


def fp8_samples_worker(rank, world, cfg):
    """One process: FP8 rollouts at version 0 and the metrics the trainer logs for them."""
    from megapkl.train.mismatch import exact_version_metrics

    t = _trainer(cfg)
    plan = t.schedule.plan(0)
    t.keep_weights(plan)
    t.new_batch(plan)
    mine = t.loop.minibatch(plan.minibatch)
    return exact_version_metrics(t.learner, mine, t.learner.pack(mine), 0), mine


def layout_worker(rank, world, cfg, samples):
    """The same samples measured at another layout: each data-parallel rank takes a contiguous
    share (other micro-batches than on one process)."""
    from megapkl.train.mismatch import exact_version_metrics

    t = _trainer(cfg)
    per = len(samples) // t.groups.dp_size
    mine = samples[t.groups.dp_rank * per:(t.groups.dp_rank + 1) * per]
    return exact_version_metrics(t.learner, mine, t.learner.pack(mine), 0)


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory, megatron_loaded):
    """A tiny HF Qwen3-MoE checkpoint (identical weights at every layout), FP8 rollouts from it
    on one process, and the routing mismatch measured there."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from megapkl.parallel.forked import run_forked
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("fp8_routing")
    ckpt = make_checkpoint(str(root / "hf"), moe=True, seed=0)
    fp8 = [*MOE, "rollout.fp8=true", "rollout.prompts_per_batch=8", "rollout.max_response_len=8",
           f"model.hf_checkpoint={ckpt.path}"]
    cfg = load_config("configs/demo/cpu_demo.yaml",
                      [*fp8, "parallel.data=1", f"run_dir={root / 'one'}"])
    metrics, samples = run_forked(fp8_samples_worker, 1, cfg, timeout=240)[0]
    return fp8, root, metrics, samples


@pytest.mark.parametrize("layout", [["parallel.data=2", "parallel.expert=2"],
                                    ["parallel.data=1", "parallel.tensor=2",
                                     "parallel.sequence_parallel=true"],
                                    ["parallel.data=1", "parallel.context=2",
                                     "parallel.packing=thd"],
                                    ["parallel.data=1", "parallel.pipeline=2"]],
                         ids=["dp2-ep2", "tp2-sp", "cp2-thd", "pp2"])
def test_fp8_routing_mismatch_is_layout_invariant(dist_run, fp8_reference, layout):
    """FP8 rollouts move the engine's routing; the same samples give the same value on one
    process and on two: DP2 x EP2, TP2 with sequence parallelism (tokens split over TP), CP2 with
    THD packing, PP2 (one MoE layer per stage, merged per token)."""
    fp8, root, ref, samples = fp8_reference
    name = "-".join(x.split("=")[0].split(".")[-1] for x in layout)
    cfg = load_config("configs/demo/cpu_demo.yaml", [*fp8, *layout, f"run_dir={root / name}"])
    got = dist_run(layout_worker, 2, cfg, samples, timeout=240)
    print(f"fp8 routing disagreement: one process {ref.get('mismatch/routing_disagree')}, "
          f"{layout}: {[g.get('mismatch/routing_disagree') for g in got]}; {ref}")
    assert ref["mismatch/routing_disagree"] > 0.03
    for g in got:
        assert g["mismatch/routing_tokens"] == ref["mismatch/routing_tokens"] > 0
        for key, value in ref.items():
            if "routing" in key:
                assert g[key] == pytest.approx(value, abs=1e-12), key


def test_train_loop_logs_routing_mismatch(dist_run, tmp_path):
    """Through the train loop: the logged row of update 0 carries the routing metrics (per_batch
    reference: the log-prob metrics reuse logp_prox, the routing still needs its forward)."""
    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    cfg = load_config("configs/demo/cpu_demo.yaml", [*MOE, "parallel.data=1", "train.steps=1",
                                                    "reference.mode=per_batch",
                                                    f"run_dir={tmp_path / 'loop'}"])
    dist_run(_rank_main, 1, cfg, timeout=240)
    row = read_metrics(cfg.run_dir)[0]
    assert row["mismatch/routing_tokens"] == row["mismatch/tokens"] > 0
    assert row["mismatch/routing_disagree"] == 0.0
    assert {"mismatch/routing_disagree_layer0", "mismatch/routing_disagree_layer1"} <= set(row)


def test_routing_mismatch_through_sglang_wire_format(dist_run, tmp_path):
    """`rollout.engine: sglang` against a launched `megapkl serve` worker (SGLang's HTTP API and
    base64 `meta_info.routed_experts`): the decoded routing feeds the same metric, 0 at update 0.
    Straight to the worker (use_router=false): the installed sglang-router does not pass
    `return_routed_experts` through."""
    import json

    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    serve = ["{python}", "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3-moe",
             "--host", "{host}", "--port", "{port}", "--enable-return-routed-experts"]
    cfg = load_config("configs/demo/cpu_demo.yaml", [
        *MOE, "parallel.data=1", "train.steps=1", f"run_dir={tmp_path / 'sg'}",
        "rollout.engine=sglang", f"rollout.sglang.server_command={json.dumps(serve)}",
        "rollout.sglang.num_engines=1", "rollout.sglang.base_port=30450",
        "rollout.sglang.startup_timeout_s=240", "rollout.sglang.use_router=false"])
    dist_run(_rank_main, 1, cfg, timeout=300)
    row = read_metrics(cfg.run_dir)[0]
    print(f"sglang wire format: {row.get('mismatch/routing_disagree')} over "
          f"{row.get('mismatch/routing_tokens')} tokens, k3 {row.get('mismatch/k3_kl')}")
    assert row["mismatch/routing_tokens"] == row["mismatch/tokens"] > 0
    assert row["mismatch/routing_disagree"] == 0.0
