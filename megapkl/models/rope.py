"""Rotary position embedding frequencies of a `ModelSpec`, computed as transformers computes them.

    inv_freq(spec)          fp32 [head_dim / 2]: the frequency of each rotated pair
    set_rotary(model, spec) put them into a megatron GPTModel's `rotary_pos_emb`

The trainer (megatron-core), the embedded engine (transformers) and SGLang must rotate every
position by the same angles, or their log-probabilities drift apart as responses grow. Reference:
transformers 5, `modeling_rope_utils._compute_default_rope_parameters` (and
`LlamaRotaryEmbedding.compute_default_rope_parameters`) and `_compute_llama3_parameters`; this
module evaluates the same fp32 expressions in the same order, so the frequencies are equal bit
for bit (tests/models/test_models_llama.py).

Why megapkl does not leave the frequencies to megatron-core: its `RotaryEmbedding._apply_scaling`
(models/common/embeddings/rotary_pos_embedding.py) takes only the factor and hard-codes
low_freq_factor 1, high_freq_factor 4 and an original context of 8192 (Llama 3.1's), and
`GPTModel(rope_scaling_factor=...)` defaults to 8, the factor of Llama 3.1, not of Llama 3.2 (32):
a builder that forgets the argument scales silently by the wrong factor. megapkl passes the factor
anyway and then sets the frequencies from the spec, so every llama3 parameter is honoured.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megapkl.models.spec import ModelSpec


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """1 / theta^(2i / dim), i = 0 .. dim/2 - 1, in fp32 (transformers' default RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int
                    ) -> torch.Tensor:
    """Llama 3.1+ scaling: wavelengths above original / low_freq_factor are divided by `factor`,
    those below original / high_freq_factor kept, the band between interpolated smoothly."""
    old_context_len = original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """The spec's RoPE inverse frequencies, fp32 on the CPU."""
    base = default_inv_freq(spec.rope_theta, spec.head_dim)
    if spec.rope_type == "default":
        return base
    if spec.rope_type == "llama3":
        return llama3_inv_freq(base, spec.rope_scaling_factor, spec.rope_low_freq_factor,
                               spec.rope_high_freq_factor,
                               spec.rope_original_max_position_embeddings)
    raise ValueError(f"rope_type {spec.rope_type!r}")  # validate() refuses it first


def megatron_rope_args(spec: ModelSpec) -> dict[str, Any]:
    """The RoPE arguments of megatron's GPTModel for `spec`, the scaling factor always explicit
    (its default, 8, is Llama 3.1's). theta stays a float: an int() would truncate it."""
    scaled = spec.rope_type == "llama3"
    return dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=spec.rope_theta,
                rope_scaling=scaled,
                rope_scaling_factor=spec.rope_scaling_factor if scaled else 1.0)


def set_rotary(model: Any, spec: ModelSpec) -> None:
    """Give a megatron GPTModel chunk the spec's frequencies (before its first forward: the
    embedding's forward caches its output per sequence length)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("the model has no rotary_pos_emb: megapkl builds RoPE models only")
    old = rotary.inv_freq
    rotary.inv_freq = inv_freq(spec).to(device=old.device)
