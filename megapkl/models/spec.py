"""Qwen3 architectures as data, and the checks of a parallel layout against them.

A `ModelSpec` holds exactly the numbers that define the network (what a Hugging Face
`config.json` holds), nothing about parallelism or precision. The shipped ones live in
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

FAMILIES = ("qwen3", "qwen3_moe")
HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_HF_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


class SpecError(MegapklError, ValueError):
    """An architecture or a layout is invalid; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One Qwen3 (dense) or Qwen3-MoE architecture. Field names follow megatron where it has one."""

    name: str
    family: str  # "qwen3" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads (GQA)
    head_dim: int  # megatron's kv_channels; Qwen3 sets it explicitly (heads*head_dim != hidden)
    ffn_hidden_size: int  # dense MLP width (unused by an all-MoE model, kept for HF round trips)
    qk_layernorm: bool = True  # Qwen3: RMSNorm over head_dim on queries and keys
    rope_theta: float = 1_000_000.0
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
        return HF_ARCHITECTURES[self.family]

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding/output layer under tensor parallelism `tp`."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def replace(self, **changes: Any) -> "ModelSpec":
        return validate(dataclasses.replace(self, **changes))


_FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}


def validate(spec: ModelSpec) -> ModelSpec:
    """Check the architecture on its own (no layout); return it unchanged."""
    if spec.family not in FAMILIES:
        raise SpecError(f"family: must be one of {FAMILIES}, got {spec.family!r}")
    for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "head_dim", "ffn_hidden_size", "max_position_embeddings",
                "make_vocab_size_divisible_by"):
        value = getattr(spec, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{key}: must be a positive integer, got {value!r}")
    if spec.num_attention_heads % spec.num_query_groups:
        raise SpecError(f"num_attention_heads ({spec.num_attention_heads}) must be divisible by "
                        f"num_query_groups ({spec.num_query_groups})")
    if spec.family == "qwen3_moe":
        for key in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            value = getattr(spec, key)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"{key}: a qwen3_moe model needs a positive integer, got {value!r}")
        if spec.moe_router_topk > spec.num_experts:
            raise SpecError(f"moe_router_topk ({spec.moe_router_topk}) exceeds num_experts "
                            f"({spec.num_experts})")
    elif spec.num_experts:
        raise SpecError(f"num_experts: family 'qwen3' is dense, got num_experts={spec.num_experts}"
                        " (use family: qwen3_moe)")
    return spec


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
    for key in ("rms_norm_eps", "init_method_std", "moe_aux_loss_coeff"):
        if key in values:
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
    """Derive the spec from a HF Qwen3/Qwen3-MoE config (a dict, a config.json or its dir)."""
    if not isinstance(config, Mapping):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no Hugging Face config.json at {path}")
        config = json.loads(path.read_text())
    model_type = config.get("model_type")
    if model_type not in _HF_MODEL_TYPES.values():
        raise SpecError(f"model_type: only qwen3 / qwen3_moe checkpoints are supported, "
                        f"got {model_type!r}")
    heads = config["num_attention_heads"]
    values: dict[str, Any] = dict(
        name=name,
        family=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"],
        rope_theta=_rope_theta(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        init_method_std=float(config.get("initializer_range", 0.02)),
    )
    _reject_unsupported_hf(config)
    if model_type == "qwen3_moe":
        values.update(
            # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
            num_experts=config["num_experts"] if "num_experts" in config else config["num_local_experts"],
            moe_router_topk=config["num_experts_per_tok"],
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        )
    return validate(ModelSpec(**values))


def _rope_theta(config: Mapping[str, Any]) -> float:
    """transformers 5 writes `rope_parameters: {rope_type, rope_theta}`; 4.x wrote `rope_theta`."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise SpecError(f"rope_parameters: RoPE type {rope['rope_type']!r} is not supported")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _reject_unsupported_hf(config: Mapping[str, Any]) -> None:
    # Features the megatron model built here does not reproduce: refuse rather than differ.
    if config.get("attention_bias"):
        raise SpecError("attention_bias: Qwen3 checkpoints with attention biases are not supported")
    if config.get("use_sliding_window"):
        raise SpecError("use_sliding_window: sliding-window attention is not supported")
    if config.get("rope_scaling"):
        raise SpecError(f"rope_scaling: RoPE scaling {config['rope_scaling']!r} is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise SpecError(f"hidden_act: only silu is supported, got {config['hidden_act']!r}")
    if config.get("model_type") == "qwen3_moe":
        if config.get("mlp_only_layers"):
            raise SpecError("mlp_only_layers: mixed dense/MoE layer stacks are not supported")
        if config.get("decoder_sparse_step", 1) != 1:
            raise SpecError("decoder_sparse_step: only 1 (every layer MoE) is supported")


def hf_config_dict(spec: ModelSpec, dtype: str = "bfloat16") -> dict[str, Any]:
    """A HF config.json mapping for `spec` (what an exported checkpoint is saved with)."""
    out: dict[str, Any] = dict(
        architectures=[spec.hf_architecture],
        model_type=_HF_MODEL_TYPES[spec.family],
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
        # rope_theta and torch_dtype: write both so neither falls back to a default silently.
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rope_theta=spec.rope_theta,
        rope_scaling=None,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
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
