"""The trainer's resume state beyond megatron's checkpoint, in a layout-independent form.

- The prompt iterator, the rollout engine's pool of policy versions (Hugging Face names, full
  tensors) and its current version are the same on every engine rank: rank 0's copy is saved.
- The current global batch is saved whole, minibatch by minibatch (each minibatch = the slices of
  every data-parallel rank, in DP order). A resume at DP size D gives rank d the d-th of D equal
  slices of every remaining minibatch, so each optimizer update sees the same responses (with
  their advantages and reference log-probs) whatever the DP size. Later batches are split by the
  rollout stage at the new size; with `rollout.minibatches_per_batch: 1` the global minibatches
  do not depend on the DP size at all, and the metrics after a resume match the original layout
  up to float summation order.
- The reference snapshots (proximal, initial) are written as Hugging Face safetensors from the
  collective export and loaded with the HF importer, which shards them for any TP/PP/EP layout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

INDEX = "index.json"


def layout(trainer) -> dict[str, int]:
    g = trainer.groups
    return {"tp": g.tp_size, "pp": g.pp_size, "cp": g.cp_size, "dp": g.dp_size,
            "ep": getattr(g, "ep_size", 1)}


# ------------------------------------------------------------------ batch and counters


def _my_minibatches(trainer) -> list[list[Any]]:
    """This rank's samples (with their advantages and per-batch reference log-probs) by minibatch."""
    n = trainer.cfg.rollout.minibatches_per_batch
    per = len(trainer.batch) // n
    return [trainer.batch[m * per:(m + 1) * per] for m in range(n)]


def gather(trainer, step: int, checkpoint: Path) -> Optional[dict]:
    """Collective: the whole trainer state on rank 0 (None on the other ranks); the policy
    versions the schedule still needs are hard-linked into `checkpoint`, not pickled."""
    g, rank = trainer.groups, dist.get_rank()
    payload = (g.dp_rank, _my_minibatches(trainer))
    got: Optional[list] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(payload, got, dst=0)
    if rank != 0:
        return None
    by_dp: dict[int, list] = {}
    for dp_rank, mbs in got:
        by_dp.setdefault(dp_rank, mbs)  # model-parallel peers hold the same samples
    n = trainer.cfg.rollout.minibatches_per_batch
    minibatches = [[pair for d in sorted(by_dp) for pair in by_dp[d][m]] for m in range(n)]
    return {"step": step, "rollouts": trainer.rollouts.state_dict(checkpoint),
            "minibatches": minibatches,
            "nan_streak": trainer.nan_streak, "nan_skipped": trainer.nan_skipped,
            "layout": layout(trainer)}


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


def apply(trainer, state: dict, checkpoint: Path) -> None:
    g = trainer.groups
    trainer.rollouts.load_state_dict(state["rollouts"], checkpoint=checkpoint)
    trainer.batch = my_share(state["minibatches"], g.dp_rank, g.dp_size)
    trainer.nan_streak, trainer.nan_skipped = state["nan_streak"], state["nan_skipped"]


# ------------------------------------------------------------------ reference snapshots


def save_snapshots(learner, root: Path) -> None:
    """Collective: every snapshot as a HF safetensors directory written by rank 0."""
    from safetensors.torch import save_file

    store, rank = learner.snapshots, dist.get_rank()
    index = {}
    for key in sorted(store.keys()):
        with store.swapped_in(key):
            # copy: the export hands out replicated tensors (norms) as the live parameters,
            # which the end of the block restores to the current weights
            tensors = {name: t.detach().to("cpu", copy=True).contiguous()
                       for name, t in learner.export()}
        if rank == 0:
            (root / key).mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(root / key / "model.safetensors"))
        index[key] = store.meta(key)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / INDEX).write_text(json.dumps(index))


def load_snapshots(learner, root: Path) -> None:
    """Collective: rebuild every snapshot at this rank's layout (leaves HF weights in the live
    model: load megatron's checkpoint afterwards)."""
    from megapkl.models.hf import load_hf_weights

    index = json.loads((root / INDEX).read_text())
    for key, meta in index.items():
        load_hf_weights(learner.model, root / key, spec=learner.spec, groups=learner.groups,
                        check_config=False)
        learner.snapshots.save(key, meta=meta)
