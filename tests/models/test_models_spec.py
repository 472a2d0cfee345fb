"""Architecture specs (configs/models/*.yaml) and layout validation: pure Python, no megatron."""

import pytest

from megapkl.models.spec import (SpecError, available_specs, check_layout,
                                 hf_config_dict, load_spec, spec_from_hf_config,
                                 spec_from_mapping)

REAL = {  # name: (layers, hidden, heads, kv heads, ffn, tied)
    "qwen3-1.7b": (28, 2048, 16, 8, 6144, True),
    "qwen3-4b": (36, 2560, 32, 8, 9728, True),
    "qwen3-8b": (36, 4096, 32, 8, 12288, False),
    "qwen3-14b": (40, 5120, 40, 8, 17408, False),
    "qwen3-32b": (64, 5120, 64, 8, 25600, False),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 6144, False),
}


def test_shipped_specs_exist():
    assert set(REAL) | {"tiny-qwen3", "tiny-qwen3-moe"} <= set(available_specs())


@pytest.mark.parametrize("name", list(REAL))
def test_real_architectures(name):
    spec = load_spec(name)
    layers, hidden, heads, kv, ffn, tied = REAL[name]
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_query_groups,
            spec.ffn_hidden_size, spec.tie_word_embeddings) == (layers, hidden, heads, kv, ffn,
                                                                tied)
    assert spec.vocab_size == 151936 and spec.head_dim == 128 and spec.qk_layernorm
    assert spec.rope_theta == 1e6 and spec.rms_norm_eps == 1e-6
    assert spec.padded_vocab_size(8) == 151936  # no padding needed up to TP 8


def test_moe_architecture():
    spec = load_spec("qwen3-30b-a3b")
    assert spec.is_moe and spec.family == "qwen3_moe"
    assert (spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == (128, 8, 768)
    assert spec.moe_norm_topk_prob
    assert not load_spec("qwen3-8b").is_moe


@pytest.mark.parametrize("moe", [False, True])
def test_tiny_spec_matches_the_tiny_hf_config(moe):
    from tiny_models import hf_config

    name = "tiny-qwen3-moe" if moe else "tiny-qwen3"
    derived = spec_from_hf_config(hf_config(moe).to_dict(), name=name)
    shipped = load_spec(name)
    for key in ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "head_dim", "ffn_hidden_size", "tie_word_embeddings",
                "rope_theta", "rms_norm_eps", "num_experts", "moe_router_topk",
                "moe_ffn_hidden_size", "moe_norm_topk_prob"):
        assert getattr(derived, key) == getattr(shipped, key), key


def test_hf_config_round_trip():
    spec = load_spec("qwen3-30b-a3b")
    back = spec_from_hf_config(hf_config_dict(spec), name=spec.name)
    assert back == spec


def test_rope_theta_from_a_transformers_5_config(tmp_path):
    """transformers 5 saves `rope_parameters` instead of `rope_theta`; a spec read from such a
    config.json keeps the checkpoint's theta (a silent fallback to 10000 would change every
    position), and the config megapkl writes reads back in transformers with the same theta."""
    from transformers import AutoConfig, Qwen3Config

    spec = load_spec("qwen3-8b")
    Qwen3Config(**{k: v for k, v in hf_config_dict(spec).items()
                   if k not in ("architectures", "model_type")}).save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    assert '"rope_parameters"' in saved
    assert spec_from_hf_config(tmp_path / "config.json", name=spec.name).rope_theta == 1e6
    assert AutoConfig.for_model(**hf_config_dict(spec)).rope_parameters["rope_theta"] == 1e6
    scaled = {**hf_config_dict(spec), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}
    with pytest.raises(SpecError, match="rope_parameters"):
        spec_from_hf_config(scaled, name=spec.name)


def test_overrides_and_unknown_keys():
    assert load_spec("tiny-qwen3", {"num_layers": 4}).num_layers == 4
    with pytest.raises(SpecError, match="unknown model key.*num_heads"):
        load_spec("tiny-qwen3", {"num_heads": 4})
    with pytest.raises(SpecError, match="unknown model 'qwen9'"):
        load_spec("qwen9")
    with pytest.raises(SpecError, match="num_attention_heads.*num_query_groups"):
        load_spec("tiny-qwen3", {"num_query_groups": 3})
    with pytest.raises(SpecError, match="num_experts"):
        spec_from_mapping({**_tiny_dict(), "family": "qwen3_moe"})


def test_spec_from_model_config():
    from megapkl.config.sections import ModelConfig
    from megapkl.models.spec import spec_from_model_config

    spec = spec_from_model_config(ModelConfig(name="tiny-qwen3-moe", num_layers=4,
                                              arch={"num_moe_experts": 8}))
    assert (spec.num_layers, spec.num_experts) == (4, 8)


def _tiny_dict():
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(load_spec("tiny-qwen3")).items()}


@pytest.mark.parametrize("layout, key", [
    (dict(tp=3), "num_attention_heads"),
    (dict(tp=4), "num_query_groups"),
    (dict(pp=3), "num_layers"),
    (dict(ep=2), "parallel.expert"),
    (dict(tp=2, sequence_parallel=False, moe=True), "sequence_parallel"),
    (dict(ep=3, moe=True), "num_experts"),
    (dict(sequence_parallel=True), "sequence_parallel"),
    (dict(tp=0), "parallel.tensor"),
])
def test_incompatible_layouts_name_the_key(layout, key):
    layout = dict(layout)
    spec = load_spec("tiny-qwen3-moe" if layout.pop("moe", False) else "tiny-qwen3")
    if layout.get("tp") == 3:
        spec = spec.replace(num_attention_heads=4, num_query_groups=1)
    with pytest.raises(SpecError, match=key):
        check_layout(spec, **layout)


def test_vocab_padding():
    spec = load_spec("tiny-qwen3", {"vocab_size": 127})
    with pytest.raises(SpecError, match="vocab_size.*make_vocab_size_divisible_by"):
        check_layout(spec, tp=2)
    padded = spec.replace(make_vocab_size_divisible_by=8)
    check_layout(padded, tp=2)
    assert padded.padded_vocab_size(2) == 128


def test_valid_layouts_pass():
    check_layout(load_spec("qwen3-32b"), tp=8, pp=4)
    check_layout(load_spec("qwen3-30b-a3b"), tp=4, ep=8, etp=1, pp=2, sequence_parallel=True)
    check_layout(load_spec("qwen3-1.7b"), tp=2, cp=2, sequence_parallel=True)


def test_options_from_run_config():
    from megapkl.config.sections import ModelConfig, ParallelConfig
    from megapkl.models.provider import ModelOptions, options_from_config

    opts = options_from_config(ModelConfig(name="tiny-qwen3-moe", routing_replay=True),
                               ParallelConfig(tensor=2, sequence_parallel=True))
    assert opts == ModelOptions(dtype="bf16", sequence_parallel=True, routing_replay=True,
                                per_token_loss=True)  # the trainer's policy loss semantics
    with pytest.raises(SpecError, match="dtype"):
        ModelOptions(dtype="fp16")
