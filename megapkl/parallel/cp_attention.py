"""Core attention with context parallelism for megatron-core's local (non-TE) layer spec.

megatron-core's local `DotProductAttention` refuses context parallelism ("only supported by
TEDotProductAttention"), and Transformer Engine does not exist on CPU. This module is the
smallest exact replacement: each context-parallel rank holds its queries, all-gathers the keys
and values of the whole sequence over the CP group, and attends with a causal mask built from
*global* token positions. It is O(S) memory per rank for K/V (not a ring), which is what tests
and CPU runs need; GPU training uses TE's ring attention instead.

Layout (Megatron's load balancing, `megatron.core.utils.get_batch_on_this_cp_rank`): the padded
sequence of length S is cut into 2*cp chunks of c = S / (2 cp) tokens and CP rank r holds chunks
r and 2cp-1-r, in that order. The gathered K/V are put back into global order, so every rank
sums over keys in the same order as a CP=1 run (results equal CP=1 to fp32 round-off).

Autograd: the gather's backward sums the key/value gradients of every rank (each rank's queries
attend to every rank's keys) and keeps this rank's slice: a reduce-scatter, done as all-reduce
+ slice on gloo, which has no reduce-scatter.

    spec = gpt_layer_spec_with_cp_attention(normalization="RMSNorm")   # local spec, CP-capable
    model = GPTModel(config, spec, ...)     # config.context_parallel_size may be > 1

Packed sequences (THD, `megapkl.parallel.batching.pack_thd`): with
`packed_seq_params=PackedSeqParams(qkv_format="thd", ...)` megatron passes [t, heads, hn]
tensors of one packed row; `cp_thd_causal_attention` attends causally within each packed
sequence (block-diagonal), CP layout = chunks r and 2cp-1-r of EACH sequence (TE's).
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

from megapkl.parallel.groups import ProcessGroup, group_rank, group_size


# ----------------------------------------------------------------------------- layout helpers

def cp_chunk_order(cp_size: int) -> list[int]:
    """Global chunk ids in the order they appear after an all-gather of the local sequences:
    rank 0's chunks (0, 2cp-1), then rank 1's (1, 2cp-2), ..."""
    return [c for r in range(cp_size) for c in (r, 2 * cp_size - 1 - r)]


def cp_local_positions(seq_local: int, cp_rank: int, cp_size: int,
                       device: Optional[torch.device] = None) -> Tensor:
    """Global positions [seq_local] of the tokens CP rank `cp_rank` holds (chunks r, 2cp-1-r)."""
    if cp_size == 1:
        return torch.arange(seq_local, device=device)
    if seq_local % 2:
        raise ValueError(f"local sequence length {seq_local} is odd: not a 2*cp chunk layout")
    c = seq_local // 2
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device)
                      for k in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def cp_global_index(seq_local: int, cp_size: int, device: Optional[torch.device] = None) -> Tensor:
    """Index [S] into the rank-major gathered sequence that yields global order 0..S-1."""
    c = seq_local // 2
    slot_of_chunk = {chunk: slot for slot, chunk in enumerate(cp_chunk_order(cp_size))}
    return torch.cat([torch.arange(slot_of_chunk[k] * c, (slot_of_chunk[k] + 1) * c, device=device)
                      for k in range(2 * cp_size)])


# ----------------------------------------------------------------------------- autograd gather

class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group` (rank-major); backward = reduce-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        n, rank = group_size(group), group_rank(group)
        grad = grad.contiguous()
        if not grad.is_cuda:  # CPU tensors go through gloo, which has no reduce-scatter
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad.chunk(n, dim=0)[rank].contiguous(), None
        out = torch.empty_like(grad.chunk(n, dim=0)[rank])
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out, None


def gather_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """[s_local, ...] on each CP rank -> [cp * s_local, ...] in rank-major order (differentiable)."""
    if group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


# ----------------------------------------------------------------------------- attention math

def cp_causal_attention(query: Tensor, key: Tensor, value: Tensor, cp_group: ProcessGroup,
                        softmax_scale: float, padding_mask: Optional[Tensor] = None,
                        dropout_p: float = 0.0) -> Tensor:
    """Causal attention of the local queries over the whole (CP-gathered) sequence.

    query [sq, b, np, hn]; key, value [sq, b, ng, hn] (the local tokens; ng divides np, GQA
    query head i uses key group i // (np / ng), megatron's convention); padding_mask optional
    bool [b, 1, sq, S], True = masked out, keys in global order (megatron's attention_mask sharded
    by `get_batch_on_this_cp_rank`). Returns [sq, b, np * hn].
    """
    sq, b, heads, hn = query.shape
    cp, rank = group_size(cp_group), group_rank(cp_group)
    kv = gather_sequence(torch.stack([key, value], dim=2), cp_group)   # one collective for K and V
    if cp > 1:
        kv = kv.index_select(0, cp_global_index(sq, cp, kv.device))
    k, v = kv.unbind(dim=2)                                             # [S, b, ng, hn]
    rep = heads // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q_pos = cp_local_positions(sq, rank, cp, query.device)
    k_pos = torch.arange(k.shape[0], device=query.device)
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)                 # [sq, S] from global positions
    if padding_mask is not None:
        allowed = allowed & ~padding_mask
    # SDPA wants [b, heads, seq, hn]; a bool mask marks the keys that take part.
    out = F.scaled_dot_product_attention(
        query.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
        attn_mask=allowed, dropout_p=dropout_p, scale=softmax_scale)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


# ----------------------------------------------------------------------------- packed (THD)

def thd_segment_ids(cu_seqlens_padded: Tensor, device: Optional[torch.device] = None) -> Tensor:
    """[S] segment index of every position of the full packed row."""
    lengths = cu_seqlens_padded.diff().to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)


def cp_thd_causal_attention(query: Tensor, key: Tensor, value: Tensor, cp_group: ProcessGroup,
                            softmax_scale: float, cu_seqlens_padded: Tensor,
                            cu_seqlens: Optional[Tensor] = None, dropout_p: float = 0.0) -> Tensor:
    """Block-diagonal causal attention of a packed (THD) row, local queries over the CP-gathered
    keys and values.

    query [t, np, hn]; key, value [t, ng, hn]: this CP rank's tokens in TE's THD layout (chunks
    r and 2cp-1-r of every segment, `megapkl.parallel.batching.thd_cp_index`). cu_seqlens_padded
    [n+1]: segment bounds of the FULL row (global). A query attends to the keys of its own
    segment at global positions <= its own; with `cu_seqlens` (unpadded cumulative lengths) the
    padding keys at the end of a segment are masked too (a padding query still sees itself, so
    no row is empty). Keys are put back into global order, so the sum runs as at CP=1.
    Returns [t, np * hn].
    """
    t, heads, hn = query.shape
    cp, rank = group_size(cp_group), group_rank(cp_group)
    bounds = tuple(int(x) for x in cu_seqlens_padded.tolist())
    real = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens.tolist())
    if t * cp != bounds[-1]:
        raise ValueError(f"THD attention: {t} local tokens x cp {cp} != packed length {bounds[-1]}")
    order, allowed = _thd_layout(bounds, real, rank, cp)     # cached: every layer reuses it
    kv = gather_sequence(torch.stack([key, value], dim=1), cp_group)      # [S, 2, ng, hn]
    if order is not None:
        kv = kv.index_select(0, order.to(kv.device))
    k, v = kv.unbind(dim=1)                                                # [S, ng, hn], global order
    rep = heads // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        query.permute(1, 0, 2).unsqueeze(0), k.permute(1, 0, 2).unsqueeze(0),
        v.permute(1, 0, 2).unsqueeze(0), attn_mask=allowed.to(query.device), dropout_p=dropout_p,
        scale=softmax_scale)                                               # [1, np, t, hn]
    return out[0].permute(1, 0, 2).reshape(t, heads * hn)


@functools.lru_cache(maxsize=16)
def _thd_layout(bounds: tuple, real: Optional[tuple], rank: int, cp: int):
    """(index putting the rank-major gathered keys into global order, or None at CP=1;
    bool [t, S] mask of the keys each local query attends to), for one packed layout."""
    from megapkl.parallel.batching import thd_cp_index

    cu_padded = torch.tensor(bounds, dtype=torch.int64)
    total = bounds[-1]
    order = None
    if cp > 1:
        held = torch.cat([thd_cp_index(cu_padded, q, cp) for q in range(cp)])   # gathered order
        order = torch.argsort(held)
    seg = thd_segment_ids(cu_padded)                                       # [S]
    q_pos = thd_cp_index(cu_padded, rank, cp)                              # [t] global positions
    k_pos = torch.arange(total)
    allowed = (seg.unsqueeze(0) == seg[q_pos].unsqueeze(1)) & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))
    if real is not None:
        lengths = torch.tensor(real, dtype=torch.int64).diff()
        k_valid = (k_pos - cu_padded[:-1][seg]) < lengths[seg]             # not segment padding
        allowed = allowed & (k_valid.unsqueeze(0) | (k_pos.unsqueeze(0) == q_pos.unsqueeze(1)))
    return order, allowed


def _thd_bounds(packed_seq_params):
    """(padded bounds, unpadded bounds or None) of megatron's PackedSeqParams (self-attention:
    q and kv bounds must agree)."""
    p = packed_seq_params
    cu = p.cu_seqlens_q
    padded = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else cu
    kv_padded = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
    if kv_padded is not None and not torch.equal(kv_padded.cpu(), padded.cpu()):
        raise ValueError("CPDotProductAttention (THD): q and kv cu_seqlens differ (self-attention only)")
    return padded, (cu if p.cu_seqlens_q_padded is not None else None)


# ----------------------------------------------------------------------------- megatron module

class CPDotProductAttention(MegatronModule):
    """Drop-in `core_attention` for megatron's local spec that also works with CP > 1.

    Same constructor as megatron's `DotProductAttention`; causal self-attention only (the GPT
    case). Dropout uses the model-parallel RNG stream like megatron's; with dropout > 0 the
    result is not partition invariant (neither is megatron's).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"CPDotProductAttention is causal only, got {attn_mask_type}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("CPDotProductAttention: sliding-window attention is not supported")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("CPDotProductAttention: only the vanilla softmax is supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.tp_group = (pg_collection.tp if pg_collection is not None
                         else ps.get_tensor_model_parallel_group())
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else ps.get_context_parallel_group(check_initialized=False)
        if group_size(self.cp_group) != config.context_parallel_size:
            raise ValueError(f"CP group size {group_size(self.cp_group)} != "
                             f"config.context_parallel_size {config.context_parallel_size}")
        tp = group_size(self.tp_group)
        head_dim = config.kv_channels
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = config.num_query_groups // tp
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside the softmax: the net scale is 1/sqrt(hn) either way.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            raise ValueError("CPDotProductAttention: packed sequences must use qkv_format='thd', "
                             f"got {packed_seq_params.qkv_format!r}")
        if attention_bias is not None:
            raise ValueError("CPDotProductAttention: attention_bias is not supported")
        p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            # megatron's Attention squeezed q/k/v to [t, heads, hn] and applied the THD RoPE
            # (restarting per segment, CP-aware); it reshapes our [t, np*hn] to [t, 1, np*hn].
            padded, cu = _thd_bounds(packed_seq_params)
            if p > 0:
                from megatron.core import tensor_parallel

                with tensor_parallel.get_cuda_rng_tracker().fork():
                    return cp_thd_causal_attention(query, key, value, self.cp_group,
                                                   self.softmax_scale, padded, cu, p)
            return cp_thd_causal_attention(query, key, value, self.cp_group, self.softmax_scale,
                                           padded, cu)
        if p > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return cp_causal_attention(query, key, value, self.cp_group, self.softmax_scale,
                                           attention_mask, p)
        return cp_causal_attention(query, key, value, self.cp_group, self.softmax_scale,
                                   attention_mask)


class LeanDotProductAttention(DotProductAttention):
    """megatron's local `DotProductAttention` with its per-call work trimmed, bit for bit.

    In the plain case (causal self-attention without a mask argument, vanilla softmax, no
    window, no layer scaling, scores not in fp16/bf16, no dropout active) megatron's forward
    forks the model-parallel RNG stream around a dropout of p = 0 (three state copies and a
    comparison per call, and the stream unchanged after), takes the score buffer from a global
    pool and goes through its softmax module; here the same kernels run on the same operands
    in the same order, without that: the baddbmm that scales the scores, the causal mask
    filled with megatron's -10000, softmax, bmm. On the CPU demo's model that is ~0.1 ms of a
    layer's forward and backward (8 micro-batches x 2 layers per update). Every other case is
    megatron's forward.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        from megatron.core.transformer.enums import AttnMaskType

        sms = self.scale_mask_softmax
        plain = (attention_mask is None and attention_bias is None and packed_seq_params is None
                 and self.softmax_offset is None and sms.scale is None and sms.window_size is None
                 and not sms.input_in_float16 and sms.attn_mask_type == AttnMaskType.causal
                 and not (self.training and self.attention_dropout.p > 0))
        if not plain:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        return unfused_causal_attention(query, key, value, self.softmax_scale)


def unfused_causal_attention(query: Tensor, key: Tensor, value: Tensor, softmax_scale: float
                             ) -> Tensor:
    """megatron's unfused attention: query [sq, b, np, hn], key/value [sk, b, ng, hn] (GQA groups
    repeated as megatron repeats them). Returns [sq, b, np * hn]."""
    from megatron.core.fusions import fused_softmax

    sq, b, heads, hn = query.shape
    sk, rep = key.shape[0], heads // key.shape[2]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
    q = query.reshape(sq, b * heads, hn).transpose(0, 1)                  # [b*np, sq, hn]
    k = key.reshape(sk, b * heads, hn).transpose(0, 1).transpose(1, 2)    # [b*np, hn, sk]
    scores = torch.baddbmm(q.new_empty(b * heads, sq, sk), q, k, beta=0.0, alpha=softmax_scale)
    scores = scores.view(b, heads, sq, sk)
    if sq > 1:  # megatron masks only then (one query: a decode step of a KV cache)
        scores = scores.masked_fill_(fused_softmax.get_default_causal_mask(sq), -10000.0)
    probs = torch.softmax(scores, dim=-1).view(b * heads, sq, sk)
    context = torch.bmm(probs, value.reshape(sk, b * heads, hn).transpose(0, 1))
    return context.view(b, heads, sq, hn).permute(2, 0, 1, 3).contiguous().view(sq, b, heads * hn)


# ----------------------------------------------------------------------------- layer specs

def replace_core_attention(spec, attention_cls=CPDotProductAttention):
    """Deep copy of a GPT layer spec (or block spec with `layer_specs`) whose self-attention
    uses `attention_cls` as its `core_attention` submodule."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None)
    for layer in (layers if layers is not None else [spec]):
        attn = layer.submodules.self_attention
        if not hasattr(attn.submodules, "core_attention"):
            raise ValueError(f"self_attention spec {attn.module} has no core_attention submodule")
        attn.submodules.core_attention = attention_cls
    return spec


def local_spec_attention(spec, *, cp_size: int, packed: bool):
    """The local spec with the core attention this layout needs: megatron's DotProductAttention
    refuses CP > 1 and packed (THD) sequences, `CPDotProductAttention` takes both (and is
    megatron's math otherwise); the rest get `LeanDotProductAttention` (megatron's, less per-call
    work). Used by the model provider and the partition tests alike."""
    if cp_size > 1 or packed:
        return replace_core_attention(spec)
    return replace_core_attention(spec, LeanDotProductAttention)


def gpt_layer_spec_with_cp_attention(**local_spec_kwargs):
    """megatron's `get_gpt_layer_local_spec(**kwargs)` with `CPDotProductAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return replace_core_attention(get_gpt_layer_local_spec(**local_spec_kwargs))
