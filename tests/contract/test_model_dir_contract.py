"""The model directory megapkl serves, read by SGLang's own loader code.

Executed from sglang: `ModelConfig.from_server_args` (reads the directory's config.json through
transformers, derives the EOS ids SGLang stops at under --skip-tokenizer-init),
`model_loader.weight_utils.get_quant_config` (what the default loader calls to pick the
quantization method: `Fp8Config.from_config` on the checkpoint's `quantization_config`, or the
online default when there is none), and for Llama the rotary embedding `get_rope` builds from the
config. Not executed: building the model (`Qwen3ForCausalLM`, `LlamaForCausalLM` need GPU
kernels for their FP8 linear layers).
"""
from __future__ import annotations

import pytest

from megapkl_side import launched


@pytest.mark.parametrize("name", ["default_fp8_colocated", "moe_fp8_context", "moe_r3_tp2_ep2",
                                  "llama_fp8_colocated"])
def test_fp8_rollouts_get_sglangs_block_fp8(sglang, name, tmp_path, monkeypatch):
    """SGLang resolves block FP8 from the served directory and the server's whole command line
    (no `--quantization` flag is needed; one that disagreed with the config would show here)."""
    from megapkl.rollout.fp8 import BLOCK

    run = launched(name, tmp_path, monkeypatch)
    assert run.cfg.rollout.fp8
    got = sglang.call("quant_config", run.sglang_argv())
    assert (got["quantization"], got.get("cls")) == ("fp8", "Fp8Config"), got
    assert got["checkpoint_fp8"] is True, got  # weights arrive as e4m3 + weight_scale_inv
    assert list(got["weight_block_size"]) == list(BLOCK), got
    assert got["activation_scheme"] == "dynamic", got


def test_bf16_rollouts_are_not_quantized(sglang, tmp_path, monkeypatch):
    run = launched("bf16_separate_gpus", tmp_path, monkeypatch)
    got = sglang.call("quant_config", run.sglang_argv())
    assert got["quantization"] is None, got


def test_served_config_carries_the_eos_id(sglang, tmp_path, monkeypatch):
    """A real model's served directory (no checkpoint, so a config-only directory): SGLang must
    find the run tokenizer's EOS id in it, and a run with no EOS anywhere is refused up front."""
    from megapkl.rollout.sglang.launch import ServerLaunchError

    from megapkl_side import TOKENIZER_EOS

    run = launched("default_fp8_colocated", tmp_path, monkeypatch,
                   extra=("model.name=qwen3-1.7b", "rollout.fp8=false"))
    got = sglang.call("quant_config", run.sglang_argv())
    assert got["eos_token_ids"] == [TOKENIZER_EOS], \
        f"SGLang finds {got['eos_token_ids']} as EOS in {run.model_dir}/config.json"
    with pytest.raises(ServerLaunchError, match="eos_token_id"):
        launched("default_fp8_colocated", tmp_path / "none", monkeypatch, tokenizer_eos=None)


def test_llama_served_config_gives_sglang_the_run_stop_ids_and_rope(sglang, tmp_path, monkeypatch):
    """A Llama run's served directory (FP8, so config-only): SGLang's own config loading finds
    every stop id of the run (Llama-3.2-Instruct has three) and builds its llama3 rotary
    embedding with the trainer's frequencies, bit for bit, and the same cos/sin."""
    import torch
    from transformers import AutoTokenizer

    from megapkl.models.rope import inv_freq
    from megapkl.models.spec import load_spec
    from megapkl.models.tiny import write_twin
    from megapkl.rollout.tokens import special_ids

    twin = write_twin(tmp_path / "twin", "tiny-llama")  # its tokenizer and generation config
    ids = special_ids(AutoTokenizer.from_pretrained(str(twin)), 128, [str(twin)])
    run = launched("llama_fp8_colocated", tmp_path / "run", monkeypatch,
                   token_ids=ids.hf_config())
    got = sglang.call("quant_config", run.sglang_argv())
    assert len(ids.stop) == 3 and got["eos_token_ids"] == sorted(ids.stop), got
    rope = sglang.call("llama_rope", run.sglang_argv(), 64)
    ours = inv_freq(load_spec("tiny-llama"))
    assert rope["cls"] == "Llama3RotaryEmbedding"
    assert torch.equal(torch.tensor(rope["inv_freq"]), ours), (rope["inv_freq"], ours)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * ours
    cache = torch.tensor(rope["cos_sin_cache"])
    torch.testing.assert_close(cache, torch.cat([angles.cos(), angles.sin()], dim=1),
                               rtol=0, atol=1e-6)
