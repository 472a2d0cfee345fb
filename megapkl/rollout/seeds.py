"""Seeded sampling that depends on the prompt, never on the call: counter-based uniforms.

A response's random draws are a function of (its prompt's seed, its sample index, the decoding
step) alone, so the same prompt group comes out the same whichever other prompts share the
engine call, however the rows are chunked, and on whichever data-parallel rank generates it. That
is what keeps a parallel layout from changing the samples, and so `metrics.jsonl`. A running
generator consumed row after row cannot do this: the k-th prompt of a rank's call would draw the
numbers of the k-th prompt of every other rank's call.

The mixing is a splitmix64 step built on the finalizer SIS's counter-based draws use
(`megapkl/objectives/sis.py`), on Python ints for the per-prompt seeds and on int64 tensors for the
per-row, per-step uniforms.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megapkl.objectives.sis import _GOLDEN, _lsr, _signed, mix64 as _finalize, mix64_int

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """One splitmix64 step of a Python int (the golden-ratio increment, then SIS's finalizer):
    a 64-bit value, well spread over all bits."""
    return mix64_int(x + _GOLDEN)


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt `index` of something seeded with `seed`: a non-negative int63 (what
    SGLang's `sampling_seed` and torch accept)."""
    return mix64(mix64(seed & _MASK64) + index + 1) >> 1


def _mix_tensor(z: Tensor) -> Tensor:
    """`mix64` on int64 tensors (wrapping arithmetic)."""
    return _finalize(z + _GOLDEN)


def row_seeds(prompt_seeds: list[int], n: int, device: torch.device | str = "cpu") -> Tensor:
    """int64 [len(prompt_seeds) * n]: one seed per response, prompt-major (sample j of a prompt)."""
    base = torch.tensor([_signed(mix64(s)) for s in prompt_seeds], dtype=torch.int64,
                        device=device)
    return _mix_tensor(base.repeat_interleave(n) + torch.arange(n, device=device).repeat(
        len(prompt_seeds)))


def uniforms(rows: Tensor, step: int) -> Tensor:
    """float64 [B] in [0, 1): decoding step `step`'s uniform of each row seed (53 random bits)."""
    z = _mix_tensor(rows ^ _signed(mix64(step)))
    return _lsr(z, 11).to(torch.float64) * 2.0 ** -53


def uniforms_at(rows: Tensor, steps: Tensor) -> Tensor:
    """`uniforms` with each row at its own decoding step (`steps` int64 [B]): a multi-turn
    trajectory's k-th sampled token draws step k's uniform, whichever turn it is in and however
    long the other rows' turns were."""
    z = _mix_tensor(rows ^ _mix_tensor(steps.to(rows.device, torch.int64)))
    return _lsr(z, 11).to(torch.float64) * 2.0 ** -53
