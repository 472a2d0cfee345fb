"""Micro-batch plans: which samples share a micro-batch, and the shape every rank agrees on.

Two plans (`parallel.micro_batch_size` / `parallel.max_tokens_per_micro_batch`):
- a fixed count: contiguous, near-equal groups of `micro_batch_size` responses;
- a token budget: first-fit decreasing on the padded tokens a micro-batch costs the model
  (`padded_cost`), so one long response no longer sets the memory of a whole micro-batch of
  many (the log-prob pass OOM of fixed counts). Every DP rank then runs the same number of
  micro-batches (the maximum over the DP group: the fullest are split), which pipeline
  schedules and the MoE dispatchers need.
The loss is partition invariant, so the plan changes speed and memory, never the result.

`build_micro_batches` is the one place training data is packed, CP-sharded and moved to the
device (`ParallelGroups.device`). Under pipeline parallelism every micro-batch has one [b, S];
with expert parallelism that shape is also agreed over the DP group, because megatron's
all-gather token dispatcher gathers equal shapes over an EP group that spans DP ranks.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from megapkl.parallel.batching import (MicroBatch, PackableSample, round_up, make_micro_batches,
                                       micro_batch_shape, seq_len, shard_for_cp, split_responses)
from megapkl.parallel.groups import ParallelGroups
from megapkl.parallel.reductions import all_reduce_max


def padded_cost(lengths: Sequence[int], multiple: int, layout: str) -> int:
    """Tokens the model processes for one micro-batch of sequences of these lengths: the
    packed row for THD, rows x the longest for one row per response."""
    if not lengths:
        return 0
    if layout == "thd":
        return sum(round_up(n, multiple) for n in lengths)
    return len(lengths) * round_up(max(lengths), multiple)


def plan_by_tokens(lengths: Sequence[int], max_tokens: int, multiple: int, layout: str,
                   num_micro: Optional[int] = None) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped into micro-batches of at most `max_tokens`
    padded tokens (`padded_cost`), each listed in increasing index order, micro-batches ordered
    by their first index. `num_micro` (>= the FFD count, e.g. the maximum over DP ranks) splits
    the fullest micro-batches until there are that many, so every rank runs the same number."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        if padded_cost([lengths[i]], multiple, layout) > max_tokens:
            raise ValueError(f"parallel.max_tokens_per_micro_batch = {max_tokens} is smaller than "
                             f"one response (prompt + response = {lengths[i]} tokens, padded to "
                             f"{padded_cost([lengths[i]], multiple, layout)})")
        for b in bins:
            if padded_cost([lengths[j] for j in b] + [lengths[i]], multiple, layout) <= max_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    target = len(bins) if num_micro is None else num_micro
    if not len(bins) <= target <= len(lengths):
        raise ValueError(f"plan_by_tokens: cannot make {target} micro-batches of {len(lengths)} "
                         f"responses (first-fit needs {len(bins)})")
    while len(bins) < target:   # split the micro-batch with the most responses in two
        b = max(bins, key=len)
        bins.remove(b)
        b = sorted(b)
        bins += [b[:len(b) // 2], b[len(b) // 2:]]
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def plan_micro_batches(samples: Sequence[PackableSample], groups: ParallelGroups, multiple: int,
                       layout: str, *, micro_batch_size: int = 1,
                       max_tokens: Optional[int] = None) -> list[list[int]]:
    """Sample indices of each micro-batch of this DP rank (collective over DP with a budget)."""
    if max_tokens is None:
        num = max(1, math.ceil(len(samples) / micro_batch_size))
        return split_responses(list(range(len(samples))), num)
    lengths = [seq_len(s) for s in samples]
    mine = len(plan_by_tokens(lengths, max_tokens, multiple, layout))
    num = int(all_reduce_max(torch.tensor([mine]), groups.dp)[0])
    return plan_by_tokens(lengths, max_tokens, multiple, layout, num_micro=num)


def build_micro_batches(samples: Sequence[PackableSample], groups: ParallelGroups, multiple: int,
                        layout: str = "bshd", *, micro_batch_size: int = 1,
                        max_tokens: Optional[int] = None) -> list[MicroBatch]:
    """This rank's CP shards of the micro-batches of `samples` (its DP share), on the device."""
    plan = plan_micro_batches(samples, groups, multiple, layout,
                              micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    shape = None
    if groups.pp_size > 1 or groups.ep_size > 1:
        shape = micro_batch_shape([[samples[i] for i in p] for p in plan], multiple, layout)
        if groups.ep_size > 1:
            shape = tuple(int(x) for x in all_reduce_max(torch.tensor(shape), groups.dp).tolist())
    mbs = make_micro_batches(samples, plan, multiple, shape=shape, layout=layout)
    return [shard_for_cp(mb, groups.cp_rank, groups.cp_size).to(groups.device) for mb in mbs]
