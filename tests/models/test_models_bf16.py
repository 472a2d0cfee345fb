"""BF16 optimization on CPU: bf16 parameters, fp32 main weights and gradients in megatron's
distributed optimizer, fp32 log-probs from bf16 logits, the HF export into the rollout engine;
and the validation that refuses bf16 where the GPUs have none."""

import pytest
import torch

from megapkl.config import ConfigError, config_from_dict
from megapkl.config.sections import ModelConfig, bf16_constraint_error, bf16_gpu_error
from megapkl.models.provider import check_dtype_on_this_machine

# ---------------------------------------------------------------- validation

BASE = {"data": {"synthetic": "next_mod10"}, "reward": {"type": "synthetic"}}


def _cfg(**sections):
    return config_from_dict({**BASE, **sections})


def test_bf16_gpu_capability():
    assert bf16_gpu_error(None) is None  # CPU: torch's bf16 kernels run
    assert bf16_gpu_error((8, 0)) is None and bf16_gpu_error((9, 0)) is None
    assert "model.dtype: fp32" in bf16_gpu_error((7, 0))
    assert "7.5" in bf16_gpu_error((7, 5))


def test_bf16_refused_on_this_machine_without_bf16(monkeypatch):
    check_dtype_on_this_machine(ModelConfig(dtype="bf16"))  # this CPU machine: fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))  # a V100
    with pytest.raises(ConfigError, match=r"^model.dtype: bf16 needs .*7\.0"):
        check_dtype_on_this_machine(ModelConfig(dtype="bf16"))
    check_dtype_on_this_machine(ModelConfig(dtype="fp32"))


@pytest.mark.parametrize("constraint,refused", [("v100", True), ("gpu&t4", True), ("V100-32GB", True),
                                                ("h100", False), ("a100|h200", False),
                                                ("gpu_p40", True), ("p4000", False), (None, False)])
def test_bf16_refused_for_slurm_gpus_without_bf16(constraint, refused):
    assert (bf16_constraint_error(constraint) is not None) is refused
    raw = dict(model={"dtype": "bf16"}, slurm={"constraint": constraint})
    if refused:
        with pytest.raises(ConfigError, match=r"model.dtype: bf16 needs Ampere") as exc:
            _cfg(**raw)
        assert "slurm.constraint" in exc.value.related
    else:
        _cfg(**raw)
    _cfg(model={"dtype": "fp32"}, slurm={"constraint": constraint})


def test_recompute_values_validated():
    assert _cfg(model={"recompute": "full"}).model.recompute == "full"
    with pytest.raises(ConfigError, match="model.recompute"):
        _cfg(model={"recompute": "everything"})


# ---------------------------------------------------------------- training in bf16 (DP 2, gloo)


def _bf16_worker(rank, world_size, ckpt):
    from megapkl.models.hf import export_hf_weights
    from megapkl.models.optimizer import main_params
    from megapkl.parallel.vocab import vocab_parallel_logprobs
    from megapkl.rollout.embedded import EmbeddedEngine
    from tiny_models import hf_config, positions, train_setup, train_step

    groups, model, ddp, opt, sched = train_setup(ckpt, dict(dtype="bf16"), seed=1,
                                                 distributed_optimizer=True)
    out = {"param_dtypes": {p.dtype for p in model.parameters()},
           "main_dtypes": {p.dtype for p in main_params(opt)},
           "grad_buffer_dtypes": {b.grad_dtype for c in ddp for b in c.buffers}}
    for seed in (10, 11):
        out["step"] = train_step(ddp, opt, sched, seed=seed)
    # Adam updated the fp32 main weights; the bf16 parameters are those, rounded.
    main = {id(p): p for p in main_params(opt)}
    shard_params = opt.chained_optimizers[0].shard_fp32_from_float16_groups \
        if hasattr(opt, "chained_optimizers") else opt.shard_fp32_from_float16_groups
    out["main_count"] = sum(len(g) for g in shard_params) == len(main) > 0
    model.eval()
    with torch.no_grad():
        logits = model(ckpt.ids, positions(ckpt.ids), None)
        logp = vocab_parallel_logprobs(logits, torch.roll(ckpt.ids, -1, 1))
        exact = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.roll(ckpt.ids, -1, 1).unsqueeze(-1)).squeeze(-1)
    out["logits_dtype"], out["logp_dtype"] = logits.dtype, logp.dtype
    out["logp_err"] = float((logp - exact).abs().max())
    weights = list(export_hf_weights(ddp, groups=groups))
    out["export_dtypes"] = {t.dtype for _, t in weights}
    engine = EmbeddedEngine(hf_config(moe=False).to_dict(), dtype=torch.float32)
    engine.update_weights(iter(weights), version=1)
    held = dict(engine.model.named_parameters())
    out["engine_exact"] = all(torch.equal(held[n], t.float()) for n, t in weights if n in held)
    with torch.no_grad():
        engine_logits = engine.model(ckpt.ids).logits
    out["engine_logit_err"] = float((engine_logits - logits.float()).abs().max())
    out["logits_scale"] = float(logits.float().abs().max())
    return out


def test_bf16_training_keeps_fp32_main_weights(dist_run, dense_ckpt):
    for out in dist_run(_bf16_worker, 2, dense_ckpt):
        assert out["param_dtypes"] == {torch.bfloat16}
        assert out["main_dtypes"] == {torch.float32} and out["main_count"]
        assert out["grad_buffer_dtypes"] == {torch.float32}
        assert out["step"].update_successful and out["step"].grad_norm > 0
        assert out["logits_dtype"] == torch.bfloat16 and out["logp_dtype"] == torch.float32
        assert out["logp_err"] < 1e-5  # fp32 math on the bf16 logits, not bf16 math
        assert out["export_dtypes"] == {torch.bfloat16}
        assert out["engine_exact"]  # bf16 -> fp32 engine weights upcast exactly
        # The fp32 engine vs the bf16 megatron forward: bf16 rounding of activations only.
        assert out["engine_logit_err"] < 0.05 * max(1.0, out["logits_scale"])


def test_submit_records_the_profile_constraint():
    """`megapkl submit --profile` validates the run against the profile's GPU type."""
    from types import SimpleNamespace

    from megapkl.launch.shape import shape_overrides

    prof = SimpleNamespace(constraint="v100", uses_gpus=False)
    extra = shape_overrides(SimpleNamespace(slurm_explicit={}), prof, "old_gpus")
    assert "slurm.constraint=v100" in extra
    with pytest.raises(ConfigError, match="model.dtype: bf16 needs Ampere"):
        config_from_dict({**BASE, "model": {"dtype": "bf16"}}, extra)
    assert "slurm.constraint=v100" not in shape_overrides(
        SimpleNamespace(slurm_explicit={"constraint": "a100"}), prof, "old_gpus")
