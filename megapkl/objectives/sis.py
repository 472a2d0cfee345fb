"""Selective importance sampling (SIS paper, eq. 7-11, Proposition 1, Algorithm 1; docs/spec.md
section 4.3).

A token a_t drawn from the behavior policy mu is accepted as an on-policy sample of pi_theta with
probability w_t / M_t, where M_t = max over the behavior top-K ids of pi_theta / mu (the top-K envelope
of eq. 11). Tokens outside the top-K are never accepted. The paper's eq. 8 prints w_t * M_t; its
Proposition 1 and Algorithm 1 use w_t / M_t, which is the correct acceptance probability.

The uniform u_t is a counter-based hash of (seed, optimizer step, response uid, position), so every
tensor-parallel rank draws the same value and the result does not depend on how tokens are split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    return c - (1 << 64) if c >= (1 << 63) else c


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _lsr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64 finalizer on int64 tensors (wrapping arithmetic)."""
    x = x ^ _lsr(x, 30)
    x = x * _M1
    x = x ^ _lsr(x, 27)
    x = x * _M2
    return x ^ _lsr(x, 31)


def mix64_int(x: int) -> int:
    """Pure-Python SplitMix64 finalizer on unsigned 64-bit ints (the definition the tensor code follows)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def response_keys(seed: int, step: int, uid: Tensor) -> Tensor:
    """Per-response stream keys: mix(mix(mix(seed) + step) + uid)."""
    base = mix64_int(mix64_int(seed) + step)
    return mix64(torch.as_tensor(_signed(base), dtype=torch.int64, device=uid.device)
                 + uid.to(torch.int64))


def uniform_draws(seed: int, step: int, uid: Tensor, positions: Tensor) -> Tensor:
    """u_t in [0, 1) as float64: a pure function of (seed, step, uid_t, position_t) for each token."""
    h = mix64(response_keys(seed, step, uid) + positions.to(torch.int64) * _GOLDEN)
    return _lsr(h, 11).to(torch.float64) * (2.0 ** -53)


@dataclass
class SISResult:
    accepted: Tensor  # [N] bool, z_t
    xi_k: Tensor      # [N] target mass outside the behavior top-K
    in_topk: Tensor   # [N] bool, a_t among the behavior top-K ids (rejected whatever u_t if not)


def sis_accept(w: Tensor, token_ids: Tensor, topk_ids: Tensor, topk_logp: Tensor,
               topk_logp_behav: Tensor, u: Tensor) -> SISResult:
    """z_t = 1{a_t in top-K and u_t < w_t / M_t} with M_t = max_v exp(topk_logp - topk_logp_behav)."""
    log_m = (topk_logp - topk_logp_behav).amax(dim=-1)
    in_topk = (topk_ids == token_ids.unsqueeze(-1)).any(dim=-1)
    accept_prob = torch.exp(torch.log(w) - log_m)  # <= 1 for tokens in the top-K (w_t is one of them)
    # Compare in float64: a float32 u rounds values within 2^-25 of 1 up to 1.0.
    accepted = in_topk & (u < accept_prob.to(torch.float64))
    xi_k = 1.0 - torch.exp(topk_logp).sum(dim=-1)
    return SISResult(accepted=accepted, xi_k=xi_k, in_topk=in_topk)
