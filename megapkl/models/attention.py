"""torch SDPA core attention for megatron-core's local layer spec (GPUs without Transformer Engine).

megatron's local `DotProductAttention` materialises the [b, heads, s, s] score matrix and runs an
unfused softmax (or apex's fused kernel, absent here). `torch.nn.functional.scaled_dot_product_attention`
with `is_causal=True` picks the flash or memory-efficient kernel on CUDA instead: O(s) memory and
the same math. GQA key/value groups are passed unexpanded (`enable_gqa`).

Only the plain case takes that path (causal self-attention, context parallel size 1, no padding
mask, no packed sequences); the rest (THD packing, explicit masks) goes through the parent class,
`CPDotProductAttention`, which builds an explicit mask and is exact for every layout. Context
parallelism on GPU needs TE (`megapkl.models.provider.kernel_plan` refuses it without).
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from megapkl.parallel.cp_attention import CPDotProductAttention
from megapkl.parallel.groups import group_size


class SDPAttention(CPDotProductAttention):
    """`core_attention` for the local spec: torch SDPA's causal kernel. Same constructor as
    megatron's `DotProductAttention`."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        dropout = self.training and self.dropout_p > 0  # the parent forks megatron's RNG stream
        plain = (packed_seq_params is None and attention_mask is None and attention_bias is None
                 and group_size(self.cp_group) == 1 and not dropout)
        if not plain:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        return sdpa_causal(query, key, value, self.softmax_scale)


def sdpa_causal(query: Tensor, key: Tensor, value: Tensor, softmax_scale: float) -> Tensor:
    """Causal attention; query [s, b, np, hn], key/value [s, b, ng, hn] (ng divides np, query
    head i uses group i // (np / ng), megatron's convention). Returns [s, b, np * hn]."""
    s, b, heads, hn = query.shape
    out = F.scaled_dot_product_attention(
        query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
        is_causal=True, scale=softmax_scale,
        enable_gqa=key.shape[2] != heads)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * hn)
