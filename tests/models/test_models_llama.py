"""Llama 3.x on megatron-core, against transformers' own LlamaForCausalLM.

A tiny random Llama written by transformers (tied embeddings, llama3 RoPE scaling with a small
theta and original context, so that the scaled frequencies act within the 12 test positions) is
imported into the sharded megatron model at several TP/PP layouts: the log-probabilities equal
transformers' forward (fp32, within 1e-5), the rotary frequencies of every pipeline stage equal
transformers' bit for bit, the streamed export reproduces the checkpoint bit for bit, and the
checkpoint megapkl saves loads in transformers with the same weights, frequencies and logits.
The frequencies are checked against transformers for both spellings of a config.json (4.x's
`rope_scaling` + `rope_theta`, 5's `rope_parameters`), and a RoPE type megapkl does not compute
is refused in one line naming the checkpoint key.
"""
from __future__ import annotations

import json

import pytest
import torch

from tiny_models import LLAMA_ROPE, build_loaded, forward_logits, load_forward_export

LOGP_ATOL = 1e-5

# meta-llama/Llama-3.2-3B-Instruct's config.json (the Hugging Face release, transformers 4.45).
LLAMA32_3B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}


def _transformers_inv_freq(config: dict) -> torch.Tensor:
    """What transformers' LlamaRotaryEmbedding computes from a config.json mapping."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    data = {k: v for k, v in json.loads(json.dumps(config)).items() if k != "model_type"}
    return LlamaRotaryEmbedding(AutoConfig.for_model("llama", **data)).inv_freq


def _spellings() -> dict[str, dict]:
    """config.json mappings of the same or of different RoPE settings, as found in the wild."""
    tiny = {k: v for k, v in LLAMA32_3B.items() if k not in ("rope_scaling", "rope_theta")}
    tiny.update(head_dim=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512)
    scaling = {k: v for k, v in LLAMA_ROPE.items() if k != "rope_theta"}
    return {
        "llama3.2-3b release (rope_scaling + rope_theta)": LLAMA32_3B,
        "tiny, transformers 5 (rope_parameters)": {**tiny, "rope_parameters": dict(LLAMA_ROPE)},
        "tiny, transformers 4 (rope_scaling + rope_theta)":
            {**tiny, "rope_scaling": scaling, "rope_theta": 100.0},
        "tiny, legacy `type` key": {**tiny, "rope_theta": 100.0, "rope_scaling": {
            **{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "llama3"}},
        # both present and different: transformers takes rope_scaling (and theta from the top)
        "tiny, rope_scaling over rope_parameters": {
            **tiny, "rope_theta": 100.0, "rope_scaling": {**scaling, "factor": 8.0},
            "rope_parameters": {**LLAMA_ROPE, "factor": 16.0, "rope_theta": 1000.0}},
        # a top-level original_max_position_embeddings overrides the block's
        "tiny, top-level original context": {
            **tiny, "rope_parameters": dict(LLAMA_ROPE), "original_max_position_embeddings": 64},
        "tiny, no scaling (rope_parameters default)":
            {**tiny, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}},
    }


@pytest.mark.parametrize("spelling", list(_spellings()))
def test_rotary_frequencies_equal_transformers(spelling):
    """megapkl reads the checkpoint's RoPE settings as transformers does and computes the same
    frequencies, bit for bit."""
    from megapkl.models.rope import inv_freq
    from megapkl.models.spec import spec_from_hf_config

    config = _spellings()[spelling]
    ours = inv_freq(spec_from_hf_config(config))
    theirs = _transformers_inv_freq(config)
    assert torch.equal(ours, theirs), (ours, theirs)


def test_tiny_llama_scaling_acts_at_short_positions():
    """The tiny model's frequencies fall in all three llama3 bands, and the scaled ones turn the
    12 test positions by angles far from the unscaled ones (so parity means something)."""
    from megapkl.models.rope import default_inv_freq, inv_freq
    from megapkl.models.spec import load_spec

    spec = load_spec("tiny-llama")
    plain, scaled = default_inv_freq(spec.rope_theta, spec.head_dim), inv_freq(spec)
    kept = torch.isclose(scaled, plain, rtol=0, atol=0)
    divided = torch.isclose(scaled, plain / spec.rope_scaling_factor, rtol=1e-6, atol=0)
    assert kept.sum() == 1 and divided.sum() == 5 and (~kept & ~divided).sum() == 2
    assert float(((plain - scaled) * 11).abs().max()) > 1.0  # radians at position 11


def test_megatron_gets_the_scaling_factor_explicitly():
    """megatron-core's RotaryEmbedding built with megapkl's arguments computes transformers'
    frequencies for Llama 3.2 (factor 32); left to its default factor (8) it would not."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megapkl.models.rope import megatron_rope_args
    from megapkl.models.spec import load_spec, spec_from_hf_config

    spec = spec_from_hf_config(LLAMA32_3B)
    assert spec == load_spec("llama3.2-3b-instruct").replace(name="hf")
    args = megatron_rope_args(spec)
    assert args["rope_scaling"] and args["rope_scaling_factor"] == 32.0
    ours = RotaryEmbedding(spec.head_dim, args["rotary_percent"], rotary_base=args["rotary_base"],
                           rope_scaling=args["rope_scaling"],
                           rope_scaling_factor=args["rope_scaling_factor"],
                           use_cpu_initialization=True).inv_freq
    theirs = _transformers_inv_freq(LLAMA32_3B)
    assert torch.equal(ours, theirs)
    defaulted = RotaryEmbedding(spec.head_dim, 1.0, rotary_base=args["rotary_base"],
                                rope_scaling=True, use_cpu_initialization=True).inv_freq
    assert not torch.equal(defaulted, theirs)


@pytest.mark.parametrize("change, key", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "rope_scaling.rope_type"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                "rope_theta": 5e5}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {**LLAMA32_3B["rope_scaling"], "factor": None}}, "rope_scaling.factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_unsupported_llama_features_are_refused_naming_the_key(change, key):
    from megapkl.models.spec import SpecError, spec_from_hf_config

    with pytest.raises(SpecError) as err:
        spec_from_hf_config({**LLAMA32_3B, **change})
    message = str(err.value)
    assert message.startswith(key + ":") and "\n" not in message, message


def test_spec_keys_are_checked():
    from megapkl.models.spec import SpecError, load_spec

    with pytest.raises(SpecError, match="qk_layernorm: family 'llama' has no QK norm"):
        load_spec("tiny-llama", {"qk_layernorm": True})
    with pytest.raises(SpecError, match="rope_scaling_factor: rope_type llama3 needs"):
        load_spec("tiny-llama", {"rope_scaling_factor": None})
    with pytest.raises(SpecError, match="rope_type: megapkl computes"):
        load_spec("tiny-llama", {"rope_type": "yarn"})
    with pytest.raises(SpecError, match="rope_scaling_factor: read by rope_type llama3 only"):
        load_spec("tiny-qwen3", {"rope_scaling_factor": 8.0})


def test_release_spelling_of_the_checkpoint_is_accepted(llama_ckpt, tmp_path):
    """The tiny checkpoint (transformers 5 wrote `rope_parameters`), its config.json rewritten in
    the release's 4.x spelling, matches the same model config."""
    import shutil

    from megapkl.models.hf import HFCheckpoint, check_checkpoint
    from megapkl.models.spec import load_spec

    old = tmp_path / "release"
    shutil.copytree(llama_ckpt.path, old)
    config = json.loads((old / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (old / "config.json").write_text(json.dumps(config))
    check_checkpoint(load_spec("tiny-llama"), HFCheckpoint(old))
    check_checkpoint(load_spec("tiny-llama"), HFCheckpoint(llama_ckpt.path))


# ---------------------------------------------------------------- the model, at several layouts


def _import_export(rank, world_size, ckpt, layout):
    model, logits, exported = load_forward_export(ckpt, layout)
    return logits, model.rotary_pos_emb.inv_freq.clone(), exported


LAYOUTS = {"tp1": (1, {}), "tp2": (2, dict(tp=2)), "pp2": (2, dict(pp=2)),
           "tp2pp2": (4, dict(tp=2, pp=2))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_import_logprobs_frequencies_and_export(dist_run, llama_ckpt, layout):
    from transformers import AutoModelForCausalLM

    world, kw = LAYOUTS[layout]
    reference = AutoModelForCausalLM.from_pretrained(llama_ckpt.path, dtype=torch.float32)
    hf_freq = reference.model.rotary_emb.inv_freq
    hf_logp = torch.log_softmax(llama_ckpt.logits, dim=-1)
    assert "lm_head.weight" not in llama_ckpt.state_dict  # tied: the checkpoint has none
    worst = 0.0
    for logits, freq, exported in dist_run(_import_export, world, llama_ckpt, kw):
        assert torch.equal(freq, hf_freq), (freq, hf_freq)  # every rank, every stage
        if logits is not None:
            diff = float((torch.log_softmax(logits, dim=-1) - hf_logp).abs().max())
            assert diff <= LOGP_ATOL, diff
            worst = max(worst, diff)
        assert sorted(exported) == sorted(llama_ckpt.state_dict)
        for name, tensor in llama_ckpt.state_dict.items():
            assert torch.equal(exported[name], tensor), name
    print(f"\n[llama parity] {layout}: max |log-prob diff| {worst:.2e}, rotary frequencies "
          "equal, export equal bit for bit")


def _save(rank, world_size, ckpt, out):
    from megapkl.models.hf import save_hf_checkpoint

    groups, model = build_loaded(ckpt.path, ckpt.name, tp=2, pp=2)
    save_hf_checkpoint(model, out, groups=groups, shard_bytes=32 << 10, source=ckpt.path)


def test_saved_llama_loads_in_transformers_bit_for_bit(dist_run, llama_ckpt, tmp_path):
    """save_hf_checkpoint at TP 2 x PP 2 (the tie spans the first and last stages): transformers
    loads it as a LlamaForCausalLM with every weight, the frequencies, the logits and the stop
    ids of the original."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    dist_run(_save, 4, llama_ckpt, str(out))
    files = sorted(out.glob("*.safetensors"))
    saved = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert len(files) > 1 and saved.keys() == llama_ckpt.state_dict.keys()
    assert all(torch.equal(saved[n], t) for n, t in llama_ckpt.state_dict.items())
    original = AutoModelForCausalLM.from_pretrained(llama_ckpt.path, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM" and reloaded.config.tie_word_embeddings
    mine, theirs = reloaded.state_dict(), original.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, original.model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(reloaded(llama_ckpt.ids).logits, llama_ckpt.logits)
    assert (reloaded.config.bos_token_id, reloaded.config.eos_token_id) == (0, [1, 4, 5])
    assert reloaded.generation_config.eos_token_id == [1, 4, 5]


# ---------------------------------------------------------------- trainer and engine agree


def _trainer_logp(rank, world_size, ckpt, sequences):
    groups, model = build_loaded(ckpt.path, ckpt.name)
    model.eval()
    with torch.no_grad():
        return [torch.log_softmax(forward_logits(model, groups, seq[None])[0], dim=-1)
                for seq in sequences]


def test_embedded_engine_and_trainer_agree_on_llama_samples(dist_run, llama_ckpt):
    """Responses the embedded engine samples from the tiny Llama (left-padded prompts of three
    lengths, each row's positions counted from its own first token, the tied output layer from
    the embedding) get, from the megatron trainer, the log-probabilities the engine reported:
    the train-inference gap the llama3 scaling would open if the two rotated differently."""
    from megapkl.rollout.embedded import EmbeddedEngine
    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.sample import PromptItem

    engine = EmbeddedEngine.from_pretrained(llama_ckpt.path, seed=0)
    try:
        prompts = [PromptItem(llama_ckpt.ids[0, :n]) for n in (3, 7, 12)]
        samples = engine.generate(prompts, 2, SamplingParams(max_new_tokens=16, ignore_eos=True))
    finally:
        engine.close()
    sequences = [torch.cat([s.prompt_ids, s.response_ids]) for s in samples]
    (logps,) = dist_run(_trainer_logp, 1, llama_ckpt, sequences)
    worst = 0.0
    for s, logp in zip(samples, logps):
        p = s.prompt_ids.numel()
        mine = logp[p - 1:-1].gather(1, s.response_ids[:, None])[:, 0]
        worst = max(worst, float((mine - s.logp_behav).abs().max()))
    assert worst <= LOGP_ATOL, worst
    print(f"\n[llama engine vs trainer] 6 responses of 16 tokens at positions up to 27: max "
          f"|log-prob diff| {worst:.2e}")
