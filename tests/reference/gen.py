"""Random, internally consistent token batches for the reference tests (float64 torch tensors).

Each token gets small-vocabulary distributions for mu (behavior), pi_k (proximal), pi_theta (learner)
and pi_0 (init); the sampled token is drawn from mu, so logp / topk fields are mutually consistent
(the logp of the sampled token equals topk_logp at its id when it is in the top-K).
No import from megapkl.objectives here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .naive import naive_advantages

BATCH_KEYS = ("logp", "logp_behav", "advantages", "response_index", "group_index", "positions",
              "logp_prox", "logp_init", "token_ids", "topk_ids", "topk_logp_behav", "topk_logp",
              "response_uid", "step", "entropy")


def make_batch(seed: int, *, M: int = 12, G: int = 4, lengths: Optional[Sequence[int]] = None,
               min_len: int = 1, max_len: int = 40, V: int = 8, top_k: Optional[int] = None,
               prox_scale: float = 0.35, learner_scale: float = 0.35, init_scale: float = 0.3,
               behav_scale: float = 2.0, adv_mode: str = "group_std", rewards: Optional[Sequence[float]] = None,
               group_index: Optional[Sequence[int]] = None, with_prox: bool = True, with_init: bool = False,
               with_entropy: bool = False, response_uid: Optional[Sequence[int]] = None, step: int = 0,
               perturb_baseline: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    if group_index is None:
        if lengths is not None:
            M = len(lengths)
        group_index = [m // G for m in range(M)]
    group_index = list(group_index)
    M = len(group_index)
    if lengths is None:
        lengths = torch.randint(min_len, max_len + 1, (M,), generator=gen).tolist()
    lengths = list(lengths)
    N = sum(lengths)
    if rewards is None:
        rewards = torch.randint(0, 2, (M,), generator=gen).double().tolist()
    adv = naive_advantages(rewards, group_index, adv_mode, perturb_baseline=perturb_baseline)

    logits_mu = torch.randn(N, V, generator=gen, dtype=torch.float64) * behav_scale
    logits_prox = logits_mu + torch.randn(N, V, generator=gen, dtype=torch.float64) * prox_scale
    logits_pi = logits_prox + torch.randn(N, V, generator=gen, dtype=torch.float64) * learner_scale
    logits_init = logits_mu + torch.randn(N, V, generator=gen, dtype=torch.float64) * init_scale
    lmu = torch.log_softmax(logits_mu, -1)
    lprox = torch.log_softmax(logits_prox, -1)
    lpi = torch.log_softmax(logits_pi, -1)
    linit = torch.log_softmax(logits_init, -1)
    tok = torch.multinomial(lmu.exp(), 1, generator=gen).squeeze(-1)
    ar = torch.arange(N)

    ridx = torch.repeat_interleave(torch.arange(M), torch.tensor(lengths))
    pos = torch.cat([torch.arange(1, n + 1) for n in lengths])
    b = {
        "logp": lpi[ar, tok].clone(),
        "logp_behav": lmu[ar, tok].clone(),
        "advantages": torch.tensor([adv[m] for m in ridx.tolist()], dtype=torch.float64),
        "response_index": ridx,
        "group_index": torch.tensor(group_index, dtype=torch.int64),
        "positions": pos,
        "logp_prox": lprox[ar, tok].clone() if with_prox else None,
        "logp_init": linit[ar, tok].clone() if with_init else None,
        "token_ids": None, "topk_ids": None, "topk_logp_behav": None, "topk_logp": None,
        "response_uid": torch.tensor(response_uid, dtype=torch.int64) if response_uid is not None else None,
        "step": step,
        "entropy": (-(lpi.exp() * lpi).sum(-1)).clone() if with_entropy else None,
        # extras, not TokenBatch fields
        "_lengths": lengths, "_rewards": list(rewards), "_lpi": lpi, "_lmu": lmu,
    }
    if top_k is not None:
        k = min(top_k, V)
        topi = torch.topk(lmu, k, dim=-1).indices
        b["token_ids"] = tok
        b["topk_ids"] = topi
        b["topk_logp_behav"] = torch.gather(lmu, 1, topi).clone()
        b["topk_logp"] = torch.gather(lpi, 1, topi).clone()
    return b


def to_token_batch(d: dict, requires_grad: Sequence[str] = ("logp",)):
    """Build the library's TokenBatch (imported lazily) from a batch dict; returns (batch, leaves)."""
    from megapkl.objectives import TokenBatch  # noqa: WPS433 (lazy: the library may not exist yet)

    kw = {}
    leaves = {}
    for k in BATCH_KEYS:
        v = d.get(k)
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if k in requires_grad and v.is_floating_point():
                v.requires_grad_(True)
                leaves[k] = v
        kw[k] = v
    return TokenBatch(**kw), leaves


def subset_responses(d: dict, keep: Sequence[int]) -> dict:
    """Sub-batch of whole responses `keep` (in that order), with response_uid preserved."""
    keep = list(keep)
    ridx = d["response_index"].tolist()
    M = len(d["group_index"])
    uid = d["response_uid"] if d.get("response_uid") is not None else torch.arange(M)
    tok = [t for m in keep for t in range(len(ridx)) if ridx[t] == m]
    tok_t = torch.tensor(tok, dtype=torch.int64)
    new_ridx = []
    for i, m in enumerate(keep):
        new_ridx += [i] * sum(1 for r in ridx if r == m)
    out = dict(d)
    for k in ("logp", "logp_behav", "advantages", "positions", "logp_prox", "logp_init", "token_ids",
              "topk_ids", "topk_logp_behav", "topk_logp", "entropy"):
        if d.get(k) is not None:
            out[k] = d[k][tok_t].clone()
    out["response_index"] = torch.tensor(new_ridx, dtype=torch.int64)
    out["group_index"] = d["group_index"][torch.tensor(keep)].clone()
    out["response_uid"] = uid[torch.tensor(keep)].clone()
    out["_token_subset"] = tok
    return out
