"""Kernel choice (TE / torch SDPA / CPU) and activation recompute, all checked on CPU.

The decision is a pure function of (CUDA present, TE importable, options), so every row of the
table is tested here; the GPU-without-TE plan is also *built and run* on CPU (its SDPA attention
and jit-fused SwiGLU run there too) and must give the CPU model's logits and gradients.
"""

import pytest
import torch

from megapkl.models.provider import (ModelOptions, ParallelSizes, config_kwargs, kernel_plan,
                                     recompute_flags)
from megapkl.models.spec import SpecError, load_spec

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")


def test_decision_table():
    te = kernel_plan(cuda=True, te=True)
    assert (te.layer_spec, te.attention, te.use_te) == ("te", "te", True)
    assert te.apply_rope_fusion and te.bias_activation_fusion and te.bias_dropout_fusion
    assert te.moe_grouped_gemm and te.cp_comm_type is None
    assert not te.gradient_accumulation_fusion  # needs apex's wgrad kernel besides TE
    assert kernel_plan(cuda=True, te=True, fused_wgrad=True).gradient_accumulation_fusion
    assert kernel_plan(cuda=True, te=True, cp=2).cp_comm_type == "p2p"  # TE's ring attention

    gpu = kernel_plan(cuda=True, te=False)
    assert (gpu.layer_spec, gpu.attention) == ("local", "sdpa")
    assert gpu.bias_activation_fusion and gpu.bias_dropout_fusion
    assert not (gpu.apply_rope_fusion or gpu.gradient_accumulation_fusion or gpu.moe_grouped_gemm)
    # TE present but switched off: the same plan as without TE.
    assert kernel_plan(cuda=True, te=True, use_te=False) == gpu

    for te_importable in (False, True):  # TE kernels are CUDA-only
        cpu = kernel_plan(cuda=False, te=te_importable)
        assert (cpu.layer_spec, cpu.attention) == ("local", "megatron_or_allgather")
        assert not any(getattr(cpu, f) for f in FUSIONS) and not cpu.moe_grouped_gemm
    assert kernel_plan(cuda=False, te=False, cp=2).attention == "megatron_or_allgather"


def test_refused_plans_name_the_key():
    with pytest.raises(SpecError, match="use_te"):
        kernel_plan(cuda=False, te=False, use_te=True)
    with pytest.raises(SpecError, match="use_te"):
        kernel_plan(cuda=True, te=False, use_te=True)
    with pytest.raises(SpecError, match=r"parallel.context \(2\)"):
        kernel_plan(cuda=True, te=False, cp=2)


@pytest.mark.parametrize("cuda,te", [(True, True), (True, False), (False, False)])
def test_transformer_config_flags(cuda, te):
    """The flags each plan writes into megatron's TransformerConfig (bf16, MoE, CP 2 under TE)."""
    spec = load_spec("tiny-qwen3-moe")
    cp = 2 if te else 1
    plan = kernel_plan(cuda=cuda, te=te, cp=cp)
    kw = config_kwargs(spec, ModelOptions(dtype="bf16", recompute="selective"),
                       ParallelSizes(cp=cp), plan, on_gpu=cuda)
    assert {f: kw[f] for f in FUSIONS} == {f: getattr(plan, f) for f in FUSIONS}
    assert kw["moe_grouped_gemm"] is te
    assert kw["cp_comm_type"] == ("p2p" if te else None)
    assert kw["bf16"] and kw["params_dtype"] == torch.bfloat16
    assert kw["masked_softmax_fusion"] is False and kw["recompute_granularity"] == "selective"
    if not te:  # TE's fused RoPE cannot be constructed without TE; the others can, here on CPU
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(**kw)
        assert config.bias_activation_fusion is cuda and config.bf16


def test_recompute_flags():
    assert recompute_flags("none", 4) == {}
    assert recompute_flags("selective", 4) == {"recompute_granularity": "selective"}
    assert recompute_flags("full", 4) == {"recompute_granularity": "full",
                                          "recompute_method": "uniform", "recompute_num_layers": 1}
    with pytest.raises(SpecError, match="recompute"):
        recompute_flags("everything", 4)


# ---------------------------------------------------------------- built and run on CPU


def _logits_and_grads(ckpt, opts: ModelOptions, plan=None):
    from megapkl.models.hf import load_hf_weights
    from megapkl.models.provider import build_model, transformer_config
    from megapkl.models.spec import load_spec as spec_of
    from tiny_models import positions

    spec = spec_of(ckpt.name)
    config = transformer_config(spec, opts, plan=plan) if plan else None
    model = build_model(spec, opts, config=config, plan=plan)
    load_hf_weights(model, ckpt.path)
    model.train()
    ids = ckpt.ids
    logits = model(ids, positions(ids), None)
    labels = torch.roll(ids, -1, dims=1)
    logits.float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    attn = {type(m.core_attention).__name__ for m in model.modules() if hasattr(m, "core_attention")}
    return logits.detach(), grads, attn


def _plans_worker(rank, world_size, ckpt):
    import torch._dynamo

    from megapkl.parallel.groups import init_parallel

    # megatron wraps its fused SwiGLU / bias-dropout in torch.compile: the same functions run
    # eagerly here (compiling them with the CPU C++ backend would take a minute of CI).
    torch._dynamo.config.disable = True
    init_parallel(seed=1)
    cpu = _logits_and_grads(ckpt, ModelOptions())
    gpu_plan = _logits_and_grads(ckpt, ModelOptions(), plan=kernel_plan(cuda=True, te=False))
    return cpu, gpu_plan


def test_gpu_without_te_plan_runs_and_matches_cpu(dist_run, dense_ckpt):
    """SDPA attention + jit-fused SwiGLU/bias-dropout (the CUDA-without-TE plan) on CPU: same
    logits and gradients as the CPU plan (megatron's unfused attention), and HF's logits."""
    (cpu_logits, cpu_grads, cpu_attn), (gpu_logits, gpu_grads, gpu_attn) = \
        dist_run(_plans_worker, 1, dense_ckpt)[0]
    assert gpu_attn == {"SDPAttention"} and cpu_attn == {"LeanDotProductAttention"}
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu_logits, dense_ckpt.logits, rtol=1e-4, atol=1e-4)
    assert cpu_grads.keys() == gpu_grads.keys()
    for name in cpu_grads:
        torch.testing.assert_close(gpu_grads[name], cpu_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=name)


def _recompute_worker(rank, world_size, ckpt):
    from megatron.core import tensor_parallel

    from megapkl.parallel.groups import init_parallel

    init_parallel(seed=1)
    original, calls = tensor_parallel.checkpoint, []

    def counting(fn, *args, **kwargs):  # megatron's block and attention call it by module path
        calls.append(fn)
        return original(fn, *args, **kwargs)

    tensor_parallel.checkpoint = counting
    grads, counts = {}, {}
    for mode in ("none", "selective", "full"):
        calls.clear()
        grads[mode] = _logits_and_grads(ckpt, ModelOptions(recompute=mode))[1]
        counts[mode] = len(calls)
    tensor_parallel.checkpoint = original
    return grads, counts


def test_recompute_gives_identical_gradients(dist_run, dense_ckpt):
    grads, counts = dist_run(_recompute_worker, 1, dense_ckpt)[0]
    # Recompute really ran: one checkpoint per layer (2 layers) for both granularities.
    assert counts == {"none": 0, "selective": 2, "full": 2}
    assert any(g.abs().sum() > 0 for g in grads["none"].values())
    for mode in ("selective", "full"):
        assert grads[mode].keys() == grads["none"].keys()
        for name, g in grads["none"].items():
            assert torch.equal(grads[mode][name], g), (mode, name)
