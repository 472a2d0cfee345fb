"""Future-KL credit C_t (Proximal KL paper eq. 5; docs/spec.md section 4.1), O(T_m) per response by
prefix sums."""
from __future__ import annotations

from typing import Literal, Optional, Union

import torch
from torch import Tensor


def clipped_costs(l: Tensor, cost_clip: Optional[float]) -> Tensor:
    """c_j = clip(l_j, -eps_F, eps_F); eps_F = None disables the clip."""
    return l if cost_clip is None else torch.clamp(l, -cost_clip, cost_clip)


def future_kl_credit(l: Tensor, response_index: Tensor, positions: Tensor, lengths: Tensor,
                     beta: float, horizon: Union[int, Literal["full"]],
                     cost_clip: Optional[float], tail: Literal["none", "linear"] = "none") -> Tensor:
    """C_t = beta * sum_{j=t}^{min(T_m, t+H-1)} c_j   (eq. 5), per token of a packed batch.

    Tokens are packed in response order with 1-based `positions`; `lengths` [M] are the T_m.
    `tail='linear'` (PKL C.2, 4B staleness 4) keeps weight 1 on the first H positions and weights
    the remaining n = T_m - t - H + 1 positions j = t+H..T_m by (T_m + 1 - j) / (n + 1).
    Range sums come from one float64 prefix sum over the whole batch, so precision does not depend
    on where a response sits in the batch.
    """
    c = clipped_costs(l, cost_clip)
    ends = torch.cumsum(lengths.to(torch.int64), 0)             # exclusive end of each response
    p = torch.nn.functional.pad(torch.cumsum(c, 0, dtype=torch.float64), (1, 0))  # P[i] = sum_{k<i}
    p_here = p[:-1]
    if horizon == "full" and tail == "none":
        return (beta * (p.index_select(0, ends).index_select(0, response_index) - p_here)).to(l.dtype)
    end_tok = ends.index_select(0, response_index)
    idx = torch.arange(c.shape[0], device=c.device)
    window_end = end_tok if horizon == "full" else torch.minimum(end_tok, idx + int(horizon))
    total = p.index_select(0, window_end) - p_here
    if tail == "linear" and horizon != "full":
        q = torch.nn.functional.pad(torch.cumsum(c * positions.to(c.dtype), 0, dtype=torch.float64), (1, 0))
        p_end, p_win = p.index_select(0, end_tok), p.index_select(0, window_end)
        t_len = lengths.to(torch.float64).index_select(0, response_index)
        n = (end_tok - window_end).to(torch.float64)  # tail positions t+H..T_m (0 when the window covers)
        weighted = (t_len + 1) * (p_end - p_win) - (q.index_select(0, end_tok) - q.index_select(0, window_end))
        total = total + weighted / (n + 1)
    return (beta * total).to(l.dtype)
