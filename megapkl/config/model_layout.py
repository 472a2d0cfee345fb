"""The parallel layout against the model's architecture, at config validation.

`megapkl.models.spec.check_layout` is the authority once a model is built, but it runs minutes into
a job. This rule reads the shipped model YAML (`configs/models/<name>.yaml`, plain data: no torch,
no import of `megapkl.models`) plus the config's typed and `arch` overrides, so TP = 3 on a model
with 4 attention heads fails at `megapkl config validate` / `submit`, naming `parallel.tensor`.
An unknown model name (a provider registered elsewhere) is left to the model layer.
"""
from __future__ import annotations

from typing import Any, Optional

from megapkl.config import yamlio
from megapkl.config.shipped import configs_dir

_SHARDED_BY_TP = ("num_attention_heads", "num_query_groups")


def model_arch(model) -> Optional[dict[str, Any]]:
    """The architecture keys of `model` (a ModelConfig), or None for a model without a shipped YAML."""
    path = configs_dir() / "models" / f"{model.name}.yaml"
    if not path.is_file():
        return None
    data = yamlio.load_value(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        return None
    for key in ("num_layers", "hidden_size", "num_experts"):
        if getattr(model, key, None) is not None:
            data[key] = getattr(model, key)
    arch = dict(model.arch or {})
    if "num_moe_experts" in arch:
        arch["num_experts"] = arch.pop("num_moe_experts")
    data.update(arch)
    return data


def check_model_layout(cfg, err) -> None:
    """Heads, KV heads, FFN and experts must split over the tensor / expert parallel sizes."""
    arch = model_arch(cfg.model)
    if arch is None:
        return
    par, name = cfg.parallel, cfg.model.name
    tp = par.tensor
    for key in _SHARDED_BY_TP:
        value = arch.get(key)
        if isinstance(value, int) and value % tp:
            err(f"model '{name}' has {key} = {value}, which tensor parallelism {tp} cannot split "
                f"evenly (use a divisor of {value})", "parallel.tensor", "model.name")
    ffn = arch.get("ffn_hidden_size")
    moe = bool(arch.get("num_experts"))
    if isinstance(ffn, int) and not moe and ffn % tp:
        err(f"model '{name}' has ffn_hidden_size = {ffn}, not divisible by tensor parallelism {tp}",
            "parallel.tensor", "model.name")
    experts = arch.get("num_experts")
    if isinstance(experts, int) and experts and experts % par.expert:
        err(f"model '{name}' has {experts} experts, not divisible by expert parallelism "
            f"{par.expert}", "parallel.expert", "model.name")
    if moe and tp > 1 and not par.sequence_parallel:
        err(f"megatron-core needs sequence parallelism for an MoE model ('{name}') with tensor "
            f"parallelism {tp}; set parallel.sequence_parallel: true",
            "parallel.sequence_parallel", "parallel.tensor")


def check_token_budget(cfg, err) -> None:
    """The longest prompt plus the longest response must fit the model's positions."""
    arch = model_arch(cfg.model)
    limit = arch.get("max_position_embeddings") if arch else None
    ro = cfg.rollout
    if isinstance(limit, int) and ro.max_prompt_len + ro.max_response_len > limit:
        err(f"max_prompt_len + max_response_len = {ro.max_prompt_len} + {ro.max_response_len} "
            f"exceeds the {limit} positions of model '{cfg.model.name}' (max_position_embeddings)",
            "rollout.max_response_len", "rollout.max_prompt_len", "model.name")
