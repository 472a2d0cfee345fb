"""One line to the user when a mechanism of the objective stops doing what it is there for.

Two cases, each judged on the mean of the last `WINDOW` updates in which the mechanism could act,
and said once per run:

- **Proximal KL's cost clip binds on most moving tokens** (`pkl/cost_clip_frac_moving` above
  one half, over the updates whose log-ratio moved at all: a minibatch whose reference is the
  current policy has none). The clip eps_F guards the future-KL credit against outlier
  log-ratios; when it binds on more than half of the tokens that moved, the credit is mostly
  +-beta * eps_F per token, set by the clip rather than by how far the policy moved, so the
  method acts as a fixed per-position penalty. Short answers, a high learning rate or a large
  staleness make it bind; `objective.cost_clip` (larger, or null) is the key.
- **Most SIS rejections come from outside the behavior top-K** (`sis/reject_outside_topk` above
  one half, over updates with rejections). A token outside the top-K is rejected whatever its
  weight, so the acceptance test itself decides less than half of the rejections: the top-K
  does not hold the behavior policy's mass, which the method assumes. `objective.sis.top_k`
  (and `rollout.topk_logprobs` where set) is the key.

docs/objectives.md says what to do in each case.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

WINDOW = 8     # updates: long enough that one odd minibatch does not warn
BINDS = 0.5    # "most": above one half


@dataclass
class _Case:
    metric: str
    acts: Callable[[dict[str, float]], bool]  # could the mechanism act in this update?
    message: str
    seen: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    said: bool = False

    def note(self, metrics: dict[str, float]) -> Optional[str]:
        if self.said or self.metric not in metrics or not self.acts(metrics):
            return None
        self.seen.append(metrics[self.metric])
        mean = sum(self.seen) / len(self.seen)
        if len(self.seen) < WINDOW or mean <= BINDS:
            return None
        self.said = True
        return self.message.format(pct=100 * mean, n=WINDOW)


def _cases() -> list[_Case]:
    return [
        _Case("pkl/cost_clip_frac_moving", lambda m: m.get("pkl/moving_frac", 0.0) > 0,
              "the Proximal KL cost clip binds on {pct:.0f}% of the tokens whose log-ratio moved "
              "(mean of {n} updates): the credit is set by the clip, not by the divergence; "
              "consider a larger objective.cost_clip, or null (docs/objectives.md)"),
        _Case("sis/reject_outside_topk", lambda m: m.get("sis/accept_rate", 1.0) < 1,
              "{pct:.0f}% of the SIS rejections are tokens outside the behavior top-K (mean of "
              "{n} updates): the top-K does not hold the behavior policy's mass; consider a "
              "larger objective.sis.top_k (and rollout.topk_logprobs) (docs/objectives.md)"),
    ]


class MechanismWatch:
    """Fed each update's reduced metrics; returns the warnings that became due."""

    def __init__(self) -> None:
        self.cases = _cases()

    def note(self, metrics: dict[str, float]) -> list[str]:
        return [m for m in (c.note(metrics) for c in self.cases) if m is not None]
