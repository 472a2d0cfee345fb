"""Token sampling with the SGLang conventions, as pure functions on one decoding step's logits.

The reported log-probs are log_softmax(logits / T) over the full vocabulary; top-k and top-p only
restrict which tokens may be *drawn*. Both truncations are computed on that same temperature-scaled
distribution (not renormalized in between) and the kept set is their intersection, as in SGLang's
torch sampler. The most likely token is always kept, so the kept set is never empty.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megapkl.rollout.engine import SamplingParams


def step_logprobs(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """[B, V] float32 log-probs at the reporting temperature (1 for greedy decoding)."""
    return torch.log_softmax(logits.float() / sampling.logprob_temperature, dim=-1)


def keep_mask(logp: Tensor, top_k: int, top_p: float) -> Optional[Tensor]:
    """[B, V] bool: tokens that may be drawn; None when no truncation is active.

    top-k keeps the k most likely tokens; top-p keeps the smallest prefix (by decreasing
    probability) whose mass reaches p, i.e. a token is kept while the mass *before* it is < p.
    """
    vocab = logp.shape[-1]
    use_k = 0 < top_k < vocab
    use_p = top_p < 1.0
    if not (use_k or use_p):
        return None
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    keep_sorted = torch.ones_like(sorted_logp, dtype=torch.bool)
    if use_k:
        keep_sorted[:, top_k:] = False
    if use_p:
        probs = sorted_logp.exp()
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep_sorted &= mass_before < top_p
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def draw(logp: Tensor, sampling: SamplingParams, u: Optional[Tensor]) -> Tensor:
    """Next token ids [B] from step log-probs [B, V] and one uniform in [0, 1) per row (`u`,
    float64 [B]; unused when greedy): the inverse of each row's CDF over the kept tokens, so a
    row's token depends on its own uniform alone (rollout/seeds.py)."""
    if sampling.greedy:
        return logp.argmax(dim=-1)
    probs = logp.double().exp()
    mask = keep_mask(logp, sampling.top_k, sampling.top_p)
    if mask is not None:
        probs = probs.masked_fill(~mask, 0.0)
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    # the first token whose CDF exceeds the target: never a masked one (its CDF step is flat)
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return token.clamp_(max=logp.shape[-1] - 1)


def top_logprobs(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(ids [B, k] int64, log-probs [B, k] float32) of the k most likely tokens, best first."""
    values, ids = torch.topk(logp, k, dim=-1, largest=True, sorted=True)
    return ids, values
