"""Names and layouts: megatron-core GPTModel parameters <-> Hugging Face tensors.

Qwen3, Qwen3-MoE and Llama share the Hugging Face names below (`model.layers.N.self_attn.q_proj`,
...); Llama has no q_norm / k_norm (`spec.qk_layernorm`), and a tied model has no `lm_head`.

Pure functions on names and tensors (no torch.distributed): which HF tensors one megatron
parameter is made of, which slice of them a TP rank holds, and how megatron fuses them.

megatron layouts (checked against megatron-core 0.16 attention.py / mlp.py):
- `linear_qkv.weight` is grouped by KV head ("query group"): for each group g the rows are
  [q heads of g (heads_per_group * head_dim) | k_g (head_dim) | v_g (head_dim)]. HF's GQA gives
  query head h to KV head h // heads_per_group, so group g's query rows are the contiguous HF
  q_proj rows [g*hpg*hd, (g+1)*hpg*hd). A TP rank holds whole groups, contiguous.
- `linear_fc1.weight` (SwiGLU) is [gate; up] *per TP shard*: megatron chunks the local output
  in two, so rank r holds cat(gate[rows_r], up[rows_r]), not a slice of cat(gate, up).
- column-parallel (qkv, fc1, embedding, output layer) split rows; row-parallel (linear_proj,
  fc2) split columns; norms and the router are replicated.
- The embedding/output rows are padded to `spec.padded_vocab_size(tp)` with zeros.
- Transformer Engine names: norms fused into the next linear (`linear_qkv.layer_norm_weight`,
  `mlp.linear_fc1.layer_norm_weight`), grouped experts as `experts.linear_fc1.weight<j>`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Optional

import torch

from megapkl.models.spec import ModelSpec

# Kinds of megatron parameters.
EMBED, OUTPUT, FINAL_NORM = "embed", "output", "final_norm"
INPUT_NORM, POST_NORM, QKV, Q_NORM, K_NORM, PROJ = (
    "input_norm", "post_norm", "qkv", "q_norm", "k_norm", "proj")
FC1, FC2, ROUTER, EXPERT_FC1, EXPERT_FC2 = "fc1", "fc2", "router", "expert_fc1", "expert_fc2"

_LAYER = r"decoder\.layers\.(?P<layer>\d+)\."
_PATTERNS = [
    (EMBED, r"embedding\.word_embeddings\.weight"),
    (OUTPUT, r"output_layer\.weight"),
    (FINAL_NORM, r"decoder\.final_layernorm\.weight"),
    (INPUT_NORM, _LAYER + r"input_layernorm\.weight"),
    (INPUT_NORM, _LAYER + r"self_attention\.linear_qkv\.layer_norm_weight"),
    (QKV, _LAYER + r"self_attention\.linear_qkv\.weight"),
    (Q_NORM, _LAYER + r"self_attention\.q_layernorm\.weight"),
    (K_NORM, _LAYER + r"self_attention\.k_layernorm\.weight"),
    (PROJ, _LAYER + r"self_attention\.linear_proj\.weight"),
    (POST_NORM, _LAYER + r"pre_mlp_layernorm\.weight"),
    (POST_NORM, _LAYER + r"mlp\.linear_fc1\.layer_norm_weight"),
    (FC1, _LAYER + r"mlp\.linear_fc1\.weight"),
    (FC2, _LAYER + r"mlp\.linear_fc2\.weight"),
    (ROUTER, _LAYER + r"mlp\.router\.weight"),
    (EXPERT_FC1, _LAYER + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc1\.weight"),
    (EXPERT_FC2, _LAYER + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc2\.weight"),
    (EXPERT_FC1, _LAYER + r"mlp\.experts\.linear_fc1\.weight(?P<expert>\d+)"),
    (EXPERT_FC2, _LAYER + r"mlp\.experts\.linear_fc2\.weight(?P<expert>\d+)"),
]
_COMPILED = [(kind, re.compile(pattern + r"$")) for kind, pattern in _PATTERNS]

# Kinds whose tensor is split over the (expert) tensor-parallel group, and along which dim.
SPLIT_DIM = {EMBED: 0, OUTPUT: 0, QKV: 0, FC1: 0, EXPERT_FC1: 0, PROJ: 1, FC2: 1, EXPERT_FC2: 1}
EXPERT_KINDS = (EXPERT_FC1, EXPERT_FC2)


@dataclasses.dataclass(frozen=True)
class ParamKind:
    """What a megatron parameter is: its kind, local layer index, local expert index."""

    kind: str
    layer: Optional[int] = None  # index into this chunk's decoder.layers
    expert: Optional[int] = None  # index among this rank's local experts


def classify(name: str) -> ParamKind:
    """Kind of a megatron GPTModel parameter name (with any `module.` wrapper prefixes removed)."""
    while name.startswith("module."):
        name = name[len("module."):]
    for kind, pattern in _COMPILED:
        match = pattern.match(name)
        if match:
            groups = match.groupdict()
            layer = int(groups["layer"]) if groups.get("layer") is not None else None
            expert = int(groups["expert"]) if groups.get("expert") is not None else None
            return ParamKind(kind, layer, expert)
    raise KeyError(f"megatron parameter {name!r} has no Hugging Face counterpart")


# ------------------------------------------------------------------ HF names and shapes


def hf_names(spec: ModelSpec, kind: str, layer: Optional[int] = None,
             expert: Optional[int] = None) -> list[str]:
    """HF tensor names making up one megatron parameter (global layer / expert indices)."""
    pre = f"model.layers.{layer}."
    table = {
        EMBED: ["model.embed_tokens.weight"],
        OUTPUT: ["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"],
        FINAL_NORM: ["model.norm.weight"],
        INPUT_NORM: [pre + "input_layernorm.weight"],
        POST_NORM: [pre + "post_attention_layernorm.weight"],
        QKV: [pre + f"self_attn.{p}_proj.weight" for p in "qkv"],
        Q_NORM: [pre + "self_attn.q_norm.weight"],
        K_NORM: [pre + "self_attn.k_norm.weight"],
        PROJ: [pre + "self_attn.o_proj.weight"],
        FC1: [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"],
        FC2: [pre + "mlp.down_proj.weight"],
        ROUTER: [pre + "mlp.gate.weight"],
        EXPERT_FC1: [pre + f"mlp.experts.{expert}.gate_proj.weight",
                     pre + f"mlp.experts.{expert}.up_proj.weight"],
        EXPERT_FC2: [pre + f"mlp.experts.{expert}.down_proj.weight"],
    }
    return table[kind]


def layer_kinds(spec: ModelSpec) -> list[str]:
    """Parameter kinds of one decoder layer, in HF export order."""
    mlp = [ROUTER, EXPERT_FC1, EXPERT_FC2] if spec.is_moe else [FC1, FC2]
    norms = [Q_NORM, K_NORM] if spec.qk_layernorm else []
    return [INPUT_NORM, QKV, *norms, PROJ, POST_NORM, *mlp]


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of `spec` holds, with its shape, in export order."""
    h, hd = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * hd, spec.num_query_groups * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        pre = f"model.layers.{layer}."
        out[pre + "input_layernorm.weight"] = (h,)
        out[pre + "self_attn.q_proj.weight"] = (q_rows, h)
        out[pre + "self_attn.k_proj.weight"] = (kv_rows, h)
        out[pre + "self_attn.v_proj.weight"] = (kv_rows, h)
        if spec.qk_layernorm:
            out[pre + "self_attn.q_norm.weight"] = (hd,)
            out[pre + "self_attn.k_norm.weight"] = (hd,)
        out[pre + "self_attn.o_proj.weight"] = (h, q_rows)
        out[pre + "post_attention_layernorm.weight"] = (h,)
        if spec.is_moe:
            out[pre + "mlp.gate.weight"] = (spec.num_experts, h)
            f = spec.moe_ffn_hidden_size
            for e in range(spec.num_experts):
                out[pre + f"mlp.experts.{e}.gate_proj.weight"] = (f, h)
                out[pre + f"mlp.experts.{e}.up_proj.weight"] = (f, h)
                out[pre + f"mlp.experts.{e}.down_proj.weight"] = (h, f)
        else:
            f = spec.ffn_hidden_size
            out[pre + "mlp.gate_proj.weight"] = (f, h)
            out[pre + "mlp.up_proj.weight"] = (f, h)
            out[pre + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


# ------------------------------------------------------------------ shards


def shard_range(length: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous equal part of `length` (must divide)."""
    if length % size:
        raise ValueError(f"cannot split {length} into {size} equal parts")
    part = length // size
    return rank * part, (rank + 1) * part


@dataclasses.dataclass(frozen=True)
class Piece:
    """A slice [start, stop) along `dim` of HF tensor `name`."""

    name: str
    dim: Optional[int] = None  # None: the whole tensor
    start: int = 0
    stop: int = 0


def local_pieces(spec: ModelSpec, kind: str, names: list[str], rank: int, size: int,
                 padded_vocab: int) -> list[Piece]:
    """The HF slices TP rank `rank` of `size` needs for one parameter (before fusing).

    For embedding/output the slice may run past the real vocabulary: the caller zero-pads.
    """
    if kind in (EMBED, OUTPUT):
        start, stop = shard_range(padded_vocab, rank, size)
        return [Piece(names[0], 0, min(start, spec.vocab_size), min(stop, spec.vocab_size))]
    if kind == QKV:
        g0, g1 = shard_range(spec.num_query_groups, rank, size)
        hpg = spec.num_attention_heads // spec.num_query_groups
        hd = spec.head_dim
        return [Piece(names[0], 0, g0 * hpg * hd, g1 * hpg * hd),
                Piece(names[1], 0, g0 * hd, g1 * hd), Piece(names[2], 0, g0 * hd, g1 * hd)]
    if kind in (FC1, EXPERT_FC1):
        rows = spec.ffn_hidden_size if kind == FC1 else spec.moe_ffn_hidden_size
        start, stop = shard_range(rows, rank, size)
        return [Piece(n, 0, start, stop) for n in names]
    if kind in (PROJ, FC2, EXPERT_FC2):
        cols = {PROJ: spec.num_attention_heads * spec.head_dim, FC2: spec.ffn_hidden_size,
                EXPERT_FC2: spec.moe_ffn_hidden_size}[kind]
        start, stop = shard_range(cols, rank, size)
        return [Piece(names[0], 1, start, stop)]
    return [Piece(n) for n in names]  # replicated


def fuse(spec: ModelSpec, kind: str, parts: list[torch.Tensor], local_rows: int) -> torch.Tensor:
    """Combine the slices of `local_pieces` into the local megatron tensor."""
    if kind in (EMBED, OUTPUT):
        (part,) = parts
        if part.shape[0] == local_rows:
            return part
        pad = part.new_zeros((local_rows - part.shape[0],) + tuple(part.shape[1:]))
        return torch.cat([part, pad], dim=0)  # padded vocabulary rows are zero
    if kind == QKV:
        return fuse_qkv(*parts, num_groups=parts[1].shape[0] // spec.head_dim)
    if kind in (FC1, EXPERT_FC1):
        return torch.cat(parts, dim=0)
    (part,) = parts
    return part


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[q; k; v] rows of `num_groups` query groups -> megatron's per-group [q_g | k_g | v_g]."""
    hidden = q.shape[1]
    qg = q.reshape(num_groups, -1, hidden)
    kg = k.reshape(num_groups, -1, hidden)
    vg = v.reshape(num_groups, -1, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden)


def split_qkv(w: torch.Tensor, num_groups: int, heads_per_group: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: megatron's grouped rows -> HF (q, k, v)."""
    hidden = w.shape[1]
    grouped = w.reshape(num_groups, (heads_per_group + 2) * head_dim, hidden)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, hidden).contiguous(), k.reshape(-1, hidden).contiguous(),
            v.reshape(-1, hidden).contiguous())


def unshard(spec: ModelSpec, kind: str, shards: list[torch.Tensor], names: list[str]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors from the TP shards (rank order) of one megatron parameter."""
    if kind in (EMBED, OUTPUT):
        yield names[0], torch.cat(shards, dim=0)[: spec.vocab_size]
    elif kind == QKV:
        hpg = spec.num_attention_heads // spec.num_query_groups
        full = torch.cat(shards, dim=0)
        q, k, v = split_qkv(full, spec.num_query_groups, hpg, spec.head_dim)
        yield from zip(names, (q, k, v))
    elif kind in (FC1, EXPERT_FC1):
        halves = [s.chunk(2, dim=0) for s in shards]
        yield names[0], torch.cat([h[0] for h in halves], dim=0)
        yield names[1], torch.cat([h[1] for h in halves], dim=0)
    elif kind in (PROJ, FC2, EXPERT_FC2):
        yield names[0], torch.cat(shards, dim=1)
    else:
        yield names[0], shards[0]
