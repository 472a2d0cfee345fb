"""The reference policies an update compares the learner against: the proximal reference
(`logp_prox`, the reference section) and the initial model (`logp_init`, the KL-to-init term of
objective.kl_init_coef); docs/objectives.md gives their roles.

`ReferencePolicies` is their one owner. It decides which of the learner's weights are kept
(`keep`: a snapshot when the schedule refreshes the reference, the initial model at update 0),
fills the log-probs (`start_batch`, `fill`) and returns the train-inference mismatch metrics
(train/mismatch.py) that its forward passes give for free:

- snapshot: `logp_prox` of each minibatch is the reference snapshot's forward, or the live
  weights' when the reference is the learner's own version (refreshed at this update);
- per_batch (PKL C.2): one forward over the whole batch when it starts, frozen as each sample's
  `logp_prox` for the batch's minibatches (a checkpoint saves it with the batch);
- behavior: nothing (the objective couples logp_prox to logp_behav);
- `logp_init`: the initial snapshot's forward, the live weights' at update 0.

One forward pass per distinct weights: fields wanting the same weights share one pass. The pass on
the live weights (or the per-batch reference at the batch's first minibatch) also gives the
mismatch metrics; without one, the training pass records the live log-probs for them
(`Mismatch.record`), except under routing replay, whose mismatch compares the routers' own choices,
which only a pass of its own records. The snapshots are this rank's shards in host memory
(models/snapshot.py) and, in a checkpoint, Hugging Face safetensors read back at any layout.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from megapkl.models.snapshot import SnapshotStore
from megapkl.train import mismatch
from megapkl.train.timers import Timers

LIVE = "logp_live"  # micro-batch field: the live weights' log-probs, for the mismatch metrics
SNAPSHOTS, INDEX = "snapshots", "index.json"  # a checkpoint's snapshot files


class Mismatch:
    """An update's train-inference mismatch metrics: measured by a reference pass already, or read
    after the training step from the live log-probs it records into the micro-batch field
    `record` (None: nothing to record)."""

    def __init__(self, metrics: Optional[dict[str, float]] = None,
                 measure: Optional[Callable[[], dict[str, float]]] = None) -> None:
        self._metrics, self._measure = metrics, measure
        self.record = None if measure is None else LIVE

    def metrics(self) -> dict[str, float]:
        """The metrics; collective when they are read from the training pass."""
        return self._measure() if self._measure is not None else self._metrics


class ReferencePolicies:
    def __init__(self, reference: Any, objective: Any, learner: Any, *,
                 routing_replay: bool = False, timers: Optional[Timers] = None) -> None:
        """`reference`, `objective`: the resolved sections; `learner`: whose weights are kept and
        whose forwards give the log-probs; `routing_replay`: model.routing_replay (the routing
        mismatch needs a reference pass of its own)."""
        self.mode, self.keep_init = reference.mode, bool(reference.kl_init)
        self.fill_init = objective.kl_init_coef > 0
        self.learner, self.routing = learner, routing_replay
        self.timers = timers or Timers()
        self.snapshots = SnapshotStore(learner.model)

    # ------------------------------------------------------------------ an update's steps

    def keep(self, plan: Any) -> None:
        """Before update `plan.update` (the learner at that version): snapshot the weights later
        updates compare against, the proximal reference when the schedule refreshes it to this
        version (snapshot mode) and the initial model at update 0 (reference.kl_init)."""
        u = plan.update
        with self.timers("export"):
            if self.mode == "snapshot" and plan.refresh_reference and plan.reference_version == u:
                self.snapshots.save("reference", meta=u)
            if u == 0 and self.keep_init:
                self.snapshots.save("init", meta=0)

    def start_batch(self, samples: Sequence) -> None:
        """A new batch (this rank's samples). per_batch: the learner's log-probs of the whole
        batch, frozen as each sample's `logp_prox` for the batch's minibatches. Collective."""
        if self.mode != "per_batch":
            return
        with self.timers("reference"):
            logp = self.learner.logprobs(self.learner.pack(samples))
        for s in samples:
            s.logp_prox = logp[s.uid]

    def fill(self, micro_batches: list, minibatch: list, plan: Any) -> Mismatch:
        """The proximal (snapshot mode) and initial log-probs into the micro-batches of
        `minibatch`, one forward pass per distinct weights; returns the mismatch metrics of the
        samples the learner's version generated, or what the training pass must record for them.
        Collective."""
        wants = self._wants(plan)
        live = "logp_prox" if self.mode == "per_batch" and plan.minibatch == 0 else None
        own = None
        with self.timers("reference"):
            for weights in dict.fromkeys(wants.values()):
                first, *more = [f for f, w in wants.items() if w == weights]
                record = self.routing and weights is None  # the routers' own choices, too
                with (self.learner.own_routing() if record else contextlib.nullcontext()) as got, \
                        self._weights(weights):
                    self.learner.fill_logprobs(micro_batches, first)
                for mb in micro_batches:  # the same weights and tokens: the same values
                    for name in more if first in mb.fields else ():
                        mb.fields[name] = mb.fields[first].clone()
                if weights is None:
                    live, own = first, got
            if live is None and not self.routing:
                return Mismatch(measure=lambda: self._measure(micro_batches, minibatch, plan))
            return Mismatch(mismatch.exact_version_metrics(
                self.learner, minibatch, micro_batches, plan.update, field=live, own=own))

    def _wants(self, plan: Any) -> dict[str, Optional[str]]:
        """micro-batch field -> the snapshot whose log-probs it takes (None: the live weights)."""
        wants: dict[str, Optional[str]] = {}
        if self.mode == "snapshot":
            wants["logp_prox"] = None if plan.reference_version == plan.update else "reference"
        if self.fill_init:
            wants["logp_init"] = None if plan.update == 0 else "init"
        return wants

    def _weights(self, snapshot: Optional[str]):
        return contextlib.nullcontext() if snapshot is None else \
            self.snapshots.swapped_in(snapshot)

    def _measure(self, micro_batches: list, minibatch: list, plan: Any) -> dict[str, float]:
        """The mismatch metrics from the log-probs the training pass recorded (the weights before
        the update: the same weights and tokens as a reference pass)."""
        with self.timers("reference"):
            return mismatch.exact_version_metrics(self.learner, minibatch, micro_batches,
                                                  plan.update, field=LIVE)

    # ------------------------------------------------------------------ checkpoint files

    def save_files(self, directory: Path) -> None:
        """Collective: every snapshot as Hugging Face safetensors in full shapes under
        `directory/snapshots/<key>` (global rank 0 writes), with their versions in its index."""
        from safetensors.torch import save_file

        root, rank, index = Path(directory) / SNAPSHOTS, dist.get_rank(), {}
        for key in sorted(self.snapshots.keys()):
            with self.snapshots.swapped_in(key):
                # copy: the export hands out replicated tensors (norms) as the live parameters,
                # which the end of the block restores to the current weights
                tensors = {name: t.detach().to("cpu", copy=True).contiguous()
                           for name, t in self.learner.export()}
            if rank == 0:
                (root / key).mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(root / key / "model.safetensors"))
            index[key] = self.snapshots.meta(key)
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            (root / INDEX).write_text(json.dumps(index))

    def load_files(self, directory: Path) -> None:
        """Collective: the snapshots `save_files` wrote, at this rank's layout. They pass through
        the live model: load them before the learner's own checkpoint, which overwrites it."""
        from megapkl.models.hf import load_hf_weights

        root, learner = Path(directory) / SNAPSHOTS, self.learner
        for key, meta in json.loads((root / INDEX).read_text()).items():
            load_hf_weights(learner.model, root / key, spec=learner.spec, groups=learner.groups,
                            check_config=False)
            self.snapshots.save(key, meta=meta)
