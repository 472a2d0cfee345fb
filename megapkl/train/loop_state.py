"""The train loop's own state: the next update, the current global batch, the NaN counters.

The current batch is saved whole, minibatch by minibatch (each minibatch = the slices of every
data-parallel rank, in DP order). A resume at DP size D gives rank d the d-th of D equal slices of
every remaining minibatch, so each optimizer update sees the same responses (with their
advantages and reference log-probs) whatever the DP size. Later batches are split by the rollout
stage at the new size; with `rollout.minibatches_per_batch: 1` the global minibatches do not
depend on the DP size at all, and the metrics after a resume match the original layout up to
float summation order.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from megapkl.errors import MegapklError


class TrainingError(MegapklError, RuntimeError):
    """The run cannot go on (too many non-finite losses in a row, ...)."""


class LoopState:
    def __init__(self, *, minibatches: int, max_nan_skips_in_row: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        self.minibatches, self.max_nan = minibatches, max_nan_skips_in_row
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.update = 0            # the next optimizer update to run
        self.batch: list = []      # this rank's samples of the current global batch
        self.nan_streak = 0
        self.nan_skipped = 0

    def minibatch(self, m: int) -> list:
        """This rank's samples of minibatch `m` of the current batch."""
        per = len(self.batch) // self.minibatches
        return self.batch[m * per:(m + 1) * per]

    def count(self, u: int, metrics: dict, applied: bool) -> None:
        """A NaN/Inf loss skips the update with a logged count; too many in a row abort
        (docs/reliability.md)."""
        if applied:
            self.nan_streak = 0
        else:
            self.nan_streak += 1
            self.nan_skipped += 1
        metrics["train/skipped_updates"] = float(self.nan_skipped)
        if self.nan_streak > self.max_nan:
            raise TrainingError(
                f"update {u}: non-finite loss ({metrics.get('loss')}) in {self.nan_streak} updates "
                f"in a row (train.max_nan_skips_in_row = {self.max_nan}); stopping. Lower train.lr, "
                "check the rollout log-probs (temperature) or the objective's clip settings.")

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> Optional[dict]:
        """Collective: the whole state on rank 0, in a layout-independent form; None elsewhere."""
        mine = (self.dp_rank, [self.minibatch(m) for m in range(self.minibatches)])
        rank = dist.get_rank() if dist.is_initialized() else 0
        got: Optional[list] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            got = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(mine, got, dst=0)
        if rank != 0:
            return None
        by_dp: dict[int, list] = {}
        for dp_rank, mbs in got:
            by_dp.setdefault(dp_rank, mbs)  # model-parallel peers hold the same samples
        minibatches = [[s for d in sorted(by_dp) for s in by_dp[d][m]]
                       for m in range(self.minibatches)]
        return {"update": self.update, "minibatches": minibatches,
                "nan_streak": self.nan_streak, "nan_skipped": self.nan_skipped}

    def load_state_dict(self, state: dict) -> None:
        self.update = int(state["update"])
        self.batch = my_share(state["minibatches"], self.dp_rank, self.dp_size)
        self.nan_streak, self.nan_skipped = state["nan_streak"], state["nan_skipped"]


def my_share(minibatches: list[list[Any]], dp_rank: int, dp_size: int) -> list[Any]:
    """This rank's part of every minibatch: the dp_rank-th of dp_size equal slices."""
    out: list[Any] = []
    for m, items in enumerate(minibatches):
        if len(items) % dp_size:
            raise ValueError(f"minibatch {m} of the saved batch has {len(items)} responses, which "
                             f"do not split over data-parallel size {dp_size}")
        k = len(items) // dp_size
        out.extend(items[dp_rank * k:(dp_rank + 1) * k])
    return out
