"""Future-KL credit C_t (Proximal KL paper eq. 5; SPEC 4.1), O(T_m) per response by prefix sums."""
from __future__ import annotations

from typing import Literal, Optional, Union

import torch
from torch import Tensor


def clipped_costs(l: Tensor, cost_clip: Optional[float]) -> Tensor:
    """c_j = clip(l_j, -eps_F, eps_F); eps_F = None disables the clip."""
    return l if cost_clip is None else torch.clamp(l, -cost_clip, cost_clip)


def _prefix(x: Tensor) -> Tensor:
    """P[i] = sum_{k<i} x_k in float64 (length N+1), so range sums do not lose precision."""
    return torch.nn.functional.pad(torch.cumsum(x.to(torch.float64), 0), (1, 0))


def future_kl_credit(l: Tensor, response_index: Tensor, positions: Tensor, lengths: Tensor,
                     beta: float, horizon: Union[int, Literal["full"]],
                     cost_clip: Optional[float], tail: Literal["none", "linear"] = "none") -> Tensor:
    """C_t = beta * sum_{j=t}^{min(T_m, t+H-1)} c_j   (eq. 5), per token of a packed batch.

    Tokens are packed in response order with 1-based `positions`; `lengths` [M] are the T_m.
    `tail='linear'` (PKL C.2, 4B staleness 4) keeps weight 1 on the first H positions and weights
    the remaining n = T_m - t - H + 1 positions j = t+H..T_m by (T_m + 1 - j) / (n + 1).
    """
    c = clipped_costs(l, cost_clip)
    n_tok = c.shape[0]
    idx = torch.arange(n_tok, device=c.device)
    start = idx - (positions - 1)
    t_len = lengths[response_index]
    end = start + t_len  # exclusive
    p = _prefix(c)
    if horizon == "full":
        window_end = end
    else:
        window_end = torch.minimum(end, idx + int(horizon))
    total = p[window_end] - p[idx]
    if tail == "linear" and horizon != "full":
        q = _prefix(c * positions.to(c.dtype))
        n = (end - window_end).to(torch.float64)  # tail positions t+H..T_m (0 when the window covers)
        weighted = (t_len.to(torch.float64) + 1) * (p[end] - p[window_end]) - (q[end] - q[window_end])
        total = total + weighted / (n + 1)
    return (beta * total).to(l.dtype)
