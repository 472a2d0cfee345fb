"""Parameter counts and served-weight bytes of a model spec, per rank of a layout: arithmetic
only (no torch), shared by `megapkl plan` (launch) and the one-process checks of eval and
diagnose (analysis)."""
from __future__ import annotations

from megapkl.config.layout import Layout


# ------------------------------------------------------------------ parameters


def padded_vocab(spec, tp: int) -> int:
    return spec.padded_vocab_size(tp)


def layer_params(spec, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer held by one rank."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_query_groups * hd
    attn = h * (q + 2 * kv) // tp + q * h // tp
    norms = 2 * h + (2 * hd if spec.qk_layernorm else 0)
    if not spec.is_moe:
        return attn + norms + 3 * h * spec.ffn_hidden_size // tp, 0
    router = h * spec.num_experts
    experts = spec.num_experts // ep * 3 * h * spec.moe_ffn_hidden_size  # expert TP = 1
    return attn + norms + router, experts


def stage_params(spec, lay: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters of pipeline stage `stage` on one rank."""
    dense, expert = layer_params(spec, lay.tp, lay.ep)
    layers = spec.num_layers // lay.pp
    dense, expert = dense * layers, expert * layers
    emb = padded_vocab(spec, lay.tp) * spec.hidden_size // lay.tp
    if stage == 0:
        dense += emb
    if stage == lay.pp - 1:
        dense += spec.hidden_size  # final norm
        if not spec.tie_word_embeddings or lay.pp > 1:
            dense += emb  # the output layer (a tied one is a copy on the last stage)
    return dense, expert


def total_params(spec, active: bool = False) -> int:
    """Whole-model parameters (active: only the routed experts of a token count)."""
    lay = Layout()
    dense, expert = stage_params(spec, lay, 0)
    if active and spec.is_moe:
        expert = expert * spec.moe_router_topk // spec.num_experts
    return dense + expert


def served_weight_bytes(spec, fp8: bool) -> float:
    """Bytes of the weights an SGLang server holds in all: BF16, or under rollout.fp8 one byte
    per linear-layer parameter (embeddings, lm_head, norms and routers stay BF16)."""
    total = total_params(spec)
    if not fp8:
        return 2.0 * total
    emb = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return 2.0 * emb + 1.0 * (total - emb)
