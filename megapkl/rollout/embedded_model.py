"""The Hugging Face model side of the embedded engine (megapkl/rollout/embedded.py): its config
and safetensors loading, the fused MoE experts unfused into per-expert modules so FP8 and weight
updates see one weight per expert, the recorder of each fed token's routed experts (routing
replay), and the KV cache rounded to rollout.kv_cache_dtype."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from megapkl.rollout import fp8 as FP8

ConfigLike = Union[str, os.PathLike, dict, Any]

def load_hf_config(config: ConfigLike):
    """A transformers config from a PretrainedConfig, a config.json mapping, a config.json path or a
    checkpoint directory. Never downloads: a hub id that is not a local path is an error."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError("HF config mapping needs 'model_type' (e.g. 'qwen3', 'qwen3_moe')")
        return AutoConfig.for_model(model_type, **data)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at '{config}' (expected a directory with config.json "
                                "or a config.json file; the embedded engine never downloads)")
    return load_hf_config(json.loads(path.read_text()))


def iter_safetensors(directory: Union[str, os.PathLike]) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) from every *.safetensors file of a local HF checkpoint directory."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in '{directory}'")
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """A transformers model's weights under its checkpoint's names and shapes: transformers 5 keeps
    a Qwen3-MoE block's experts fused in memory (`experts.gate_up_proj` [E, 2I, H] with the gate
    rows first, `experts.down_proj` [E, H, I]) and splits them only when it saves. A tied lm_head
    is left out, as a saved checkpoint leaves it out."""
    for name, t in model.named_parameters():
        t = t.detach()
        base, _, leaf = name.rpartition(".")
        if base.endswith("mlp.experts") and leaf == "gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}.{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}.{e}.up_proj.weight", t[e, inter:]
        elif base.endswith("mlp.experts") and leaf == "down_proj":
            for e in range(t.shape[0]):
                yield f"{base}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


class _Experts(nn.ModuleList):
    """A sparse block's experts as one SwiGLU MLP per expert, in the checkpoint's layout.

    transformers 5 fuses a Qwen3-MoE block's experts into 3-D parameters (`gate_up_proj`,
    `down_proj`) and converts checkpoint names only inside `from_pretrained`. The engine's weights
    arrive by the checkpoint's names (`mlp.experts.<e>.gate_proj.weight`, ...), FP8 quantizes each
    expert's linear layers block by block and W8A8 quantizes each linear layer's input, so the
    engine keeps one `nn.Linear` per projection and computes what the fused module does: for every
    expert hit, down(act(gate(x)) * up(x)) weighted by its routing score."""

    def __init__(self, fused: nn.Module):
        hidden, inter = fused.hidden_dim, fused.intermediate_dim
        super().__init__(_ExpertMLP(hidden, inter) for _ in range(fused.num_experts))
        self.act_fn = fused.act_fn

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            mlp, x = self[e], hidden[token]
            y = mlp.down_proj(self.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class _ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


def _unfuse_experts(model: nn.Module) -> None:
    """Replace every fused experts module (transformers 5) by `_Experts`."""
    for name, module in list(model.named_modules()):
        fused = getattr(module, "experts", None)
        if name.endswith("mlp") and fused is not None and hasattr(fused, "gate_up_proj"):
            module.experts = _Experts(fused)


class _ExpertRecorder:
    """Captures the MoE routers' top-k choices, one [B, S, layers, k] int32 tensor per forward.

    Hooks sit on each sparse block's `gate` (the router), which returns (logits, scores, expert
    indices): the indices recorded are the ones the block routes with."""

    def __init__(self, gates: list[nn.Module], top_k: int):
        self.top_k = top_k
        self.active = False
        self._pending: list[Tensor] = []
        self.forwards: list[Tensor] = []
        self._handles = [g.register_forward_hook(self._hook) for g in gates]

    def _hook(self, module, inputs, output) -> None:
        if self.active:
            self._pending.append(output[2].to(torch.int32))

    def end_forward(self, batch: int, seq: int) -> None:
        if self.active:
            layers = torch.stack(self._pending, dim=1)  # [B*S, layers, k]
            self.forwards.append(layers.view(batch, seq, len(self._pending), self.top_k).cpu())
        self._pending = []

    def reset(self, active: bool) -> None:
        self.active, self._pending, self.forwards = active, [], []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _kv_dtype(name: str) -> Optional[torch.dtype]:
    """rollout.kv_cache_dtype -> the dtype K/V are rounded to (None: the engine's own dtype)."""
    if name == "auto":
        return None
    if name == "bf16":
        return torch.bfloat16
    raise ValueError(f"rollout.kv_cache_dtype: {name!r} is not available in the embedded engine "
                     "(auto or bf16; FP8 KV caches need rollout.engine: sglang)")


def _rounded_cache_class():
    from transformers import DynamicCache

    class RoundedCache(DynamicCache):
        """A DynamicCache whose keys and values are rounded to `kv_dtype` as they are written, so
        attention reads them (the current token's too) at the cache's precision."""

        def __init__(self, kv_dtype: torch.dtype):
            super().__init__()
            self.kv_dtype = kv_dtype

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k = key_states.to(self.kv_dtype).to(key_states.dtype)
            v = value_states.to(self.kv_dtype).to(value_states.dtype)
            return super().update(k, v, layer_idx, *args, **kwargs)

    return RoundedCache


def _RoundedCache(kv_dtype: torch.dtype):
    global _ROUNDED
    if _ROUNDED is None:
        _ROUNDED = _rounded_cache_class()
    return _ROUNDED(kv_dtype)


_ROUNDED = None
