"""Model architectures as data: the families megapkl builds (Qwen3, Qwen3-MoE, Llama 3.x) and
the numbers of each model, and the checks of a parallel layout against them.

A `Family` holds what distinguishes one family from another (its Hugging Face names, whether it
normalises queries and keys, the config.json flags it must have, its tiny CPU twin): the code
that builds, imports, exports and serves a model reads these fields instead of branching on the
family's name. A `ModelSpec` holds exactly the numbers that define one network (what a Hugging
Face `config.json` holds), nothing about parallelism or precision. The shipped ones live in
`configs/models/<name>.yaml` (flat keys = the fields below); `load_spec("qwen3-8b")` reads one,
`spec_from_hf_config(path)` derives one from a checkpoint's config.json, and
`check_layout(spec, ...)` says, naming the key, why a TP/PP/EP/CP layout cannot hold it.

Pure Python (yaml + json): importing this module does not import torch or megatron.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from megapkl.errors import MegapklError


@dataclasses.dataclass(frozen=True)
class Family:
    """What one model family is, as data."""

    name: str  # `family:` of a model YAML
    model_type: str  # config.json `model_type`
    architecture: str  # config.json `architectures[0]` (the transformers class)
    moe: bool  # every layer a mixture-of-experts layer
    qk_layernorm: bool  # RMSNorm over head_dim on queries and keys (HF q_norm / k_norm)
    tiny_twin: str  # configs/models/<name>.yaml of its random CPU twin (tests, `megapkl smoke`)
    # config.json flags of features megapkl does not build: an export writes these values and a
    # checkpoint with another value is refused, naming the key
    flags: tuple[tuple[str, Any], ...] = ()


FAMILY: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", moe=False, qk_layernorm=True,
           tiny_twin="tiny-qwen3",
           flags=(("attention_bias", False), ("use_sliding_window", False))),
    Family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", moe=True, qk_layernorm=True,
           tiny_twin="tiny-qwen3-moe",
           flags=(("attention_bias", False), ("use_sliding_window", False))),
    Family("llama", "llama", "LlamaForCausalLM", moe=False, qk_layernorm=False,
           tiny_twin="tiny-llama", flags=(("attention_bias", False), ("mlp_bias", False))),
)}
FAMILIES = tuple(FAMILY)
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILY.values()}
# RoPE types megapkl computes, each exactly as transformers does (megapkl.models.rope)
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor",
                "rope_original_max_position_embeddings": "original_max_position_embeddings"}


class SpecError(MegapklError, ValueError):
    """An architecture or a layout is invalid; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One architecture of a `Family`. Field names follow megatron where it has one."""

    name: str
    family: str  # a key of FAMILY: "qwen3" | "qwen3_moe" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads (GQA)
    head_dim: int  # megatron's kv_channels; Qwen3 sets it explicitly (heads*head_dim != hidden)
    ffn_hidden_size: int  # dense MLP width (unused by an all-MoE model, kept for HF round trips)
    qk_layernorm: bool = True  # the family's (Family.qk_layernorm): Qwen3 true, Llama false
    rope_theta: float = 1_000_000.0
    # RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`): "default" (none) or
    # "llama3" (Llama 3.1+: low frequencies divided by the factor, a smooth band between); the
    # four numbers below are read by llama3 only and are then all required.
    rope_type: str = "default"
    rope_scaling_factor: Optional[float] = None  # HF factor
    rope_low_freq_factor: Optional[float] = None  # HF low_freq_factor
    rope_high_freq_factor: Optional[float] = None  # HF high_freq_factor
    rope_original_max_position_embeddings: Optional[int] = None  # pre-training context
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    init_method_std: float = 0.02
    # Mixture of experts (family qwen3_moe); every layer is an MoE layer (Qwen3-MoE:
    # decoder_sparse_step 1, no mlp_only_layers).
    num_experts: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities (HF norm_topk_prob)
    moe_aux_loss_coeff: float = 0.0  # HF router_aux_loss_coef; 0 = no load-balancing loss
    # Pad the embedding/output rows to a multiple of this times TP (megatron-LM's
    # make_vocab_size_divisible_by). 1 = never pad: padded logits would enter the softmax.
    make_vocab_size_divisible_by: int = 1

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def hf_architecture(self) -> str:
        return FAMILY[self.family].architecture

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The HF `rope_parameters` mapping of this spec (transformers 5's spelling)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "llama3":
            out.update({hf: getattr(self, key) for key, hf in _LLAMA3_KEYS.items()})
        return out

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding/output layer under tensor parallelism `tp`."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def tiny_twin(self) -> str:
        """The megapkl model name of this family's random CPU twin."""
        return FAMILY[self.family].tiny_twin

    def replace(self, **changes: Any) -> "ModelSpec":
        return validate(dataclasses.replace(self, **changes))


_FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}


def validate(spec: ModelSpec) -> ModelSpec:
    """Check the architecture on its own (no layout); return it unchanged."""
    if spec.family not in FAMILY:
        raise SpecError(f"family: must be one of {FAMILIES}, got {spec.family!r}")
    family = FAMILY[spec.family]
    for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "head_dim", "ffn_hidden_size", "max_position_embeddings",
                "make_vocab_size_divisible_by"):
        value = getattr(spec, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{key}: must be a positive integer, got {value!r}")
    if spec.num_attention_heads % spec.num_query_groups:
        raise SpecError(f"num_attention_heads ({spec.num_attention_heads}) must be divisible by "
                        f"num_query_groups ({spec.num_query_groups})")
    if spec.qk_layernorm != family.qk_layernorm:
        has = "has" if family.qk_layernorm else "has no"
        raise SpecError(f"qk_layernorm: family {spec.family!r} {has} QK norm (q_norm/k_norm in "
                        f"its checkpoints), got qk_layernorm={spec.qk_layernorm}")
    _validate_rope(spec)
    if family.moe:
        for key in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            value = getattr(spec, key)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"{key}: a {spec.family} model needs a positive integer, "
                                f"got {value!r}")
        if spec.moe_router_topk > spec.num_experts:
            raise SpecError(f"moe_router_topk ({spec.moe_router_topk}) exceeds num_experts "
                            f"({spec.num_experts})")
    elif spec.num_experts:
        raise SpecError(f"num_experts: family {spec.family!r} is dense, got "
                        f"num_experts={spec.num_experts} (use family: qwen3_moe)")
    return spec


def _validate_rope(spec: ModelSpec) -> None:
    if not spec.rope_theta > 0:
        raise SpecError(f"rope_theta: must be positive, got {spec.rope_theta!r}")
    if spec.rope_type not in ROPE_TYPES:
        raise SpecError(f"rope_type: megapkl computes RoPE types {ROPE_TYPES}, got "
                        f"{spec.rope_type!r}")
    given = {key: getattr(spec, key) for key in _LLAMA3_KEYS}
    if spec.rope_type != "llama3":
        extra = sorted(k for k, v in given.items() if v is not None)
        if extra:
            raise SpecError(f"{extra[0]}: read by rope_type llama3 only, this spec has rope_type "
                            f"{spec.rope_type!r}")
        return
    for key, value in given.items():
        if value is None or isinstance(value, bool) or not value > 0:
            raise SpecError(f"{key}: rope_type llama3 needs a positive number, got {value!r}")
    if not spec.rope_high_freq_factor > spec.rope_low_freq_factor:
        raise SpecError(f"rope_high_freq_factor ({spec.rope_high_freq_factor}) must exceed "
                        f"rope_low_freq_factor ({spec.rope_low_freq_factor})")


def spec_from_mapping(data: Mapping[str, Any], *, source: str = "<mapping>") -> ModelSpec:
    """Build a spec from flat keys (a YAML file's content); unknown keys are errors."""
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise SpecError(f"{source}: unknown model key(s) {unknown}; known: {sorted(_FIELDS)}")
    missing = sorted(k for k, f in _FIELDS.items() if k not in data
                     and f.default is dataclasses.MISSING)
    if missing:
        raise SpecError(f"{source}: missing model key(s) {missing}")
    values = dict(data)
    if "rope_theta" in values:  # YAML reads "1e6" as a string
        values["rope_theta"] = float(values["rope_theta"])
    for key in ("rms_norm_eps", "init_method_std", "moe_aux_loss_coeff", "rope_scaling_factor",
                "rope_low_freq_factor", "rope_high_freq_factor"):
        if values.get(key) is not None:
            values[key] = float(values[key])
    try:
        return validate(ModelSpec(**values))
    except SpecError as exc:
        raise SpecError(f"{source}: {exc}") from None


def models_dir() -> Path:
    """Where the shipped model YAMLs live: configs/models under the configs directory."""
    from megapkl.config.shipped import configs_dir

    return configs_dir() / "models"


def available_specs() -> list[str]:
    """Names of the shipped model specs."""
    return sorted(p.stem for p in models_dir().glob("*.yaml"))


def load_spec(name_or_path: str | os.PathLike, overrides: Optional[Mapping[str, Any]] = None
              ) -> ModelSpec:
    """Read `configs/models/<name>.yaml` (or a YAML path), then apply `overrides` (flat keys)."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = models_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise SpecError(f"unknown model {str(name_or_path)!r}: no {path}; "
                            f"known: {available_specs()}")
    elif not path.is_file():
        raise SpecError(f"model spec file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of model keys")
    data.setdefault("name", path.stem)
    data.update(overrides or {})
    return spec_from_mapping(data, source=str(path))


def spec_from_model_config(model_cfg: Any) -> ModelSpec:
    """The spec for a `megapkl.config.sections.ModelConfig`: name, typed overrides, then `arch`."""
    overrides: dict[str, Any] = {}
    for key in ("num_layers", "hidden_size", "num_experts"):
        value = getattr(model_cfg, key, None)
        if value is not None:
            overrides[key] = value
    arch = dict(getattr(model_cfg, "arch", {}) or {})
    if "num_moe_experts" in arch:  # megatron's spelling
        arch["num_experts"] = arch.pop("num_moe_experts")
    overrides.update(arch)
    return load_spec(model_cfg.name, overrides)


# ------------------------------------------------------------------ Hugging Face config.json


def spec_from_hf_config(config: str | os.PathLike | Mapping[str, Any], name: str = "hf"
                        ) -> ModelSpec:
    """Derive the spec from a HF config of a family in FAMILY (a dict, a config.json or its
    dir). A feature megapkl does not build (a RoPE type, biases, sliding windows) is refused with
    a SpecError naming the config.json key, never dropped."""
    if not isinstance(config, Mapping):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no Hugging Face config.json at {path}")
        config = json.loads(path.read_text())
    model_type = config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise SpecError(f"model_type: megapkl builds {sorted(_BY_MODEL_TYPE)} checkpoints, "
                        f"got {model_type!r}")
    family = _BY_MODEL_TYPE[model_type]
    _reject_unsupported_hf(config, family)
    heads = config["num_attention_heads"]
    values: dict[str, Any] = dict(
        name=name,
        family=family.name,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"],
        qk_layernorm=family.qk_layernorm,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        init_method_std=float(config.get("initializer_range", 0.02)),
        **rope_from_hf(config),
    )
    if family.moe:
        values.update(
            # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
            num_experts=config["num_experts"] if "num_experts" in config
            else config["num_local_experts"],
            moe_router_topk=config["num_experts_per_tok"],
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        )
    return validate(ModelSpec(**values))


def rope_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's rope_* fields from a config.json, read as transformers 5 reads them
    (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` / `standardize_rope_params`):
    - the block is `rope_scaling` when set (4.x's spelling, and it wins), else `rope_parameters`;
    - its type is `rope_type`, else `type`, else "default";
    - theta is the block's `rope_theta`, else the top-level `rope_theta`, else 10000;
    - llama3's pre-training context is a top-level `original_max_position_embeddings` when the
      config has one, else the block's, else `max_position_embeddings`.
    A type megapkl does not compute is refused naming the key it came from."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    block = dict(config.get(key) or {})
    if any(isinstance(v, Mapping) for v in block.values()):
        raise SpecError(f"{key}: RoPE parameters per layer type are not supported")
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise SpecError(f"{key}.rope_type: RoPE type {rope_type!r} is not supported (megapkl "
                        f"computes {', '.join(ROPE_TYPES)})")
    partial = block.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise SpecError(f"partial_rotary_factor: RoPE on part of each head ({partial}) is not "
                        "supported")
    out: dict[str, Any] = {
        "rope_theta": float(block.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rope_type": rope_type}
    if rope_type == "llama3":
        for field_name, hf in _LLAMA3_KEYS.items():
            if hf == "original_max_position_embeddings":
                value = config.get(hf, block.get(hf, config.get("max_position_embeddings")))
            else:
                value = block.get(hf)
            if value is None:
                raise SpecError(f"{key}.{hf}: RoPE type llama3 needs it")
            out[field_name] = int(value) if hf == "original_max_position_embeddings" \
                else float(value)
    return out


def _reject_unsupported_hf(config: Mapping[str, Any], family: Family) -> None:
    # Features the megatron model built here does not reproduce: refuse rather than differ.
    for key, value in family.flags:
        if config.get(key, value) != value:
            raise SpecError(f"{key}: {family.architecture} checkpoints with {key}="
                            f"{config[key]!r} are not supported (megapkl builds {key}={value})")
    if config.get("hidden_act", "silu") != "silu":
        raise SpecError(f"hidden_act: only silu is supported, got {config['hidden_act']!r}")
    if family.moe:
        if config.get("mlp_only_layers"):
            raise SpecError("mlp_only_layers: mixed dense/MoE layer stacks are not supported")
        if config.get("decoder_sparse_step", 1) != 1:
            raise SpecError("decoder_sparse_step: only 1 (every layer MoE) is supported")


def hf_config_dict(spec: ModelSpec, dtype: str = "bfloat16", **token_ids: Any) -> dict[str, Any]:
    """A HF config.json mapping for `spec` (what an exported checkpoint is saved with);
    `token_ids`: bos_token_id / eos_token_id / pad_token_id to carry (None values are dropped)."""
    family = FAMILY[spec.family]
    rope = spec.rope_parameters
    out: dict[str, Any] = dict(
        architectures=[family.architecture],
        model_type=family.model_type,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_method_std,
        rms_norm_eps=spec.rms_norm_eps,
        # transformers 5 reads rope_parameters and dtype; 4.x readers (and older tools) read
        # rope_theta, rope_scaling and torch_dtype: write both so neither falls back to a
        # default silently (transformers 5 takes a non-null rope_scaling over rope_parameters).
        rope_parameters=rope,
        rope_theta=spec.rope_theta,
        rope_scaling=None if spec.rope_type == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        attention_dropout=0.0,
        **dict(family.flags),
        tie_word_embeddings=spec.tie_word_embeddings,
        dtype=dtype,
        torch_dtype=dtype,
    )
    if spec.is_moe:
        out.update(num_experts=spec.num_experts, num_experts_per_tok=spec.moe_router_topk,
                   moe_intermediate_size=spec.moe_ffn_hidden_size,
                   norm_topk_prob=spec.moe_norm_topk_prob,
                   router_aux_loss_coef=spec.moe_aux_loss_coeff, decoder_sparse_step=1,
                   mlp_only_layers=[])
    out.update({k: v for k, v in token_ids.items() if v is not None})
    return out


# ------------------------------------------------------------------ layouts


def check_layout(spec: ModelSpec, *, tp: int = 1, pp: int = 1, ep: int = 1,
                 etp: Optional[int] = None, cp: int = 1, vpp: Optional[int] = None,
                 sequence_parallel: bool = False) -> None:
    """Raise `SpecError` naming the key when the layout cannot hold the architecture."""
    etp = tp if etp is None else etp

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise SpecError(f"{spec.name}: {msg}")

    for key, size in (("tensor", tp), ("pipeline", pp), ("expert", ep), ("expert_tensor", etp),
                      ("context", cp)):
        need(isinstance(size, int) and size >= 1, f"parallel.{key}: must be >= 1, got {size!r}")
    need(spec.num_attention_heads % tp == 0,
         f"num_attention_heads ({spec.num_attention_heads}) must be divisible by "
         f"parallel.tensor ({tp})")
    # megatron can replicate KV heads when tp > groups, but the HF mapping here shards whole
    # query groups, so the KV heads must split evenly.
    need(spec.num_query_groups % tp == 0,
         f"num_query_groups / KV heads ({spec.num_query_groups}) must be divisible by "
         f"parallel.tensor ({tp})")
    need(spec.ffn_hidden_size % tp == 0 or spec.is_moe,
         f"ffn_hidden_size ({spec.ffn_hidden_size}) must be divisible by parallel.tensor ({tp})")
    if spec.vocab_size % tp and spec.make_vocab_size_divisible_by == 1:
        raise SpecError(f"{spec.name}: vocab_size ({spec.vocab_size}) must be divisible by "
                        f"parallel.tensor ({tp}), or set make_vocab_size_divisible_by to pad it "
                        "(padded logits must then be masked by the loss)")
    stages = pp * (vpp or 1)
    need(spec.num_layers % stages == 0,
         f"num_layers ({spec.num_layers}) must be divisible by parallel.pipeline ({pp})"
         + (f" x virtual_pipeline ({vpp})" if vpp else ""))
    # Context parallelism constrains sequence lengths (multiples of 2*cp), not the architecture.
    if spec.is_moe:
        need(spec.num_experts % ep == 0,
             f"num_experts ({spec.num_experts}) must be divisible by parallel.expert ({ep})")
        need(spec.moe_ffn_hidden_size % etp == 0,
             f"moe_ffn_hidden_size ({spec.moe_ffn_hidden_size}) must be divisible by the expert "
             f"tensor parallel size ({etp})")
        # megatron-core refuses MoE with tensor parallelism unless activations are
        # sequence-parallel (its token dispatchers assume the sequence is split over TP).
        need(tp == 1 or sequence_parallel,
             f"parallel.sequence_parallel must be true for an MoE model with "
             f"parallel.tensor={tp} (megatron-core requires SP with MoE and TP)")
    elif ep > 1:
        raise SpecError(f"{spec.name}: parallel.expert ({ep}) > 1 needs an MoE model "
                        "(num_experts), this one is dense")
    need(not sequence_parallel or tp > 1,
         f"parallel.sequence_parallel needs parallel.tensor > 1, got tensor={tp}")
