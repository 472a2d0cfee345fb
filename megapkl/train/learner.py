"""The learner: the policy on megatron-core with its optimizer and distributed loss.

One object per rank. `train_step` runs one optimizer update on this rank's share of a minibatch
(megatron's forward-backward schedule with the partition-invariant policy loss of
`megapkl.parallel.megatron_loss`) and says how many forward passes the update took, `logprobs` /
`fill_logprobs` recompute log-probs under the weights in the model (the reference policies swap
their snapshots in: train/references.py), `export` streams the weights in Hugging Face names for
the rollout engines.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megapkl.models.hf import export_hf_weights, load_hf_weights
from megapkl.models.optimizer import (OptimSettings, attach_to_config, build_optimizer,
                                      build_scheduler, optimizer_step, wrap_ddp, zero_grads)
from megapkl.models.provider import build_model_chunks, options_from_config
from megapkl.models.spec import spec_from_model_config
from megapkl.parallel import megatron_loss as ML
from megapkl.parallel.batching import MicroBatch, pad_multiple
from megapkl.parallel.microbatches import build_micro_batches
from megapkl.parallel.groups import ParallelGroups


def optim_settings(t, parallel) -> OptimSettings:
    """Adam settings from the `train` section (docs/spec.md section 10) and the `parallel` one's
    optimizer."""
    return OptimSettings(
        lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.grad_clip or 0.0,
        lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
        decay_steps=t.steps if t.lr_schedule == "cosine" else None,
        distributed_optimizer=parallel.distributed_optimizer)


def hf_checkpoint_dir(model) -> Optional[Path]:
    """The model section's local HF checkpoint to start from, or None for megatron's random
    init."""
    path = model.hf_checkpoint
    if not path:
        return None
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model.hf_checkpoint: {path} is not a local directory (megapkl never downloads "
            "weights at run time: download the checkpoint first and give its path, or set "
            "model.hf_checkpoint: null for a random init)")
    return p


class Learner:
    """The policy model and its optimizer, built from the model, parallel, train and objective
    sections; `temperature`: the rollouts' (log-probs are taken at it)."""

    def __init__(self, model, parallel, train, objective, *, temperature: float,
                 groups: ParallelGroups) -> None:
        self.groups, self.objective, self.parallel = groups, objective, parallel
        self.spec = spec_from_model_config(model)
        pgc = groups.pg_collection   # megatron's explicit process groups, everywhere below
        chunks = build_model_chunks(self.spec, options_from_config(model, parallel), pgc)
        ckpt = hf_checkpoint_dir(model)
        if ckpt is not None:
            load_hf_weights(chunks, ckpt, spec=self.spec, groups=groups)
        self.settings = optim_settings(train, parallel)
        self.model = wrap_ddp(chunks, self.settings, pg_collection=pgc)
        self.optimizer = build_optimizer(self.model, self.settings, pg_collection=pgc)
        self.scheduler = build_scheduler(self.optimizer, self.settings)
        attach_to_config(self.model, self.optimizer, pg_collection=pgc)
        self.temperature = temperature
        self.multiple = pad_multiple(groups.cp_size, groups.tp_size, parallel.sequence_parallel)
        self._passes = 0  # forward passes over a set of micro-batches since the last step

    # ------------------------------------------------------------------ batches

    @property
    def layout(self) -> str:
        return "thd" if self.parallel.packing == "thd" else "bshd"

    def pack(self, samples: Sequence) -> list[MicroBatch]:
        """This rank's CP shards of the micro-batches of `samples` (this DP rank's share), on
        the device: built once per minibatch, then passed to `logprobs` / `fill_logprobs` /
        `train_step` (`megapkl.parallel.microbatches`)."""
        p = self.parallel
        return build_micro_batches(samples, self.groups, self.multiple, self.layout,
                                   micro_batch_size=p.micro_batch_size,
                                   max_tokens=p.max_tokens_per_micro_batch)

    # ------------------------------------------------------------------ forward passes

    def logprobs(self, micro_batches: Sequence[MicroBatch]) -> dict[int, torch.Tensor]:
        """{uid: [T]} log-probs (CPU) of the micro-batches' tokens under the model's weights, on
        every rank (broadcast from the last pipeline stage)."""
        self._passes += 1
        out = ML.forward_logprobs(self.groups, self.model, micro_batches, self.temperature)
        return self._from_last_stage(out)

    def fill_logprobs(self, micro_batches: Sequence[MicroBatch], name: str) -> None:
        """Write the local action tokens' log-probs under the model's weights into each
        micro-batch's field `name` (e.g. logp_prox): no gather, the shards are reused as is."""
        self._passes += 1
        ML.fill_logprobs(self.groups, self.model, micro_batches, name, self.temperature)

    def own_routing(self):
        """Context manager: forwards inside (e.g. `logprobs`) record each MoE router's own top-k
        choice, even under R3 replay; yields a list filled on exit with, per micro-batch, one
        [rows, top_k] tensor per local MoE layer (`megapkl.models.routing_probe`)."""
        from megapkl.models.routing_probe import own_routing
        return own_routing(self.model)

    def train_step(self, micro_batches: Sequence[MicroBatch], step: int,
                   record: Optional[str] = None) -> tuple[dict[str, float], bool]:
        """One optimizer update on this rank's micro-batches (`pack`); returns (metrics,
        applied). A non-finite loss skips the update (gradients dropped), applied=False. The
        metrics count the update's forward passes (`train/forward_passes`): its own and those of
        `logprobs` / `fill_logprobs` since the previous step (the reference passes).
        `record`: a micro-batch field that receives the training pass's detached log-probs (the
        weights before this update), as `fill_logprobs` would write them."""
        obj = self.objective
        mbs = micro_batches
        zero_grads(self.model, self.optimizer)
        stats = ML.count_minibatch(mbs, self.groups)
        if ML.prepass_required(obj, self.groups, len(mbs)):
            self._passes += 1
            stats = ML.run_prepass(obj, self.groups, self.model, mbs, stats, self.temperature, step)
        passes, self._passes = self._passes + 1, 0
        spec = ML.PolicyLossSpec(cfg=obj, groups=self.groups, stats=stats,
                                 temperature=self.temperature, step=step, record=record)
        reports = ML.forward_backward(spec, self.model, mbs)
        metrics = self._from_last_stage(ML.reduce_reports(reports, self.groups)
                                        if self.groups.is_last_pp_stage else {})
        metrics["train/forward_passes"] = float(passes)
        if not math.isfinite(metrics.get("loss", math.nan)):
            zero_grads(self.model, self.optimizer)
            return metrics, False
        st = optimizer_step(self.optimizer, self.scheduler)
        if st.grad_norm is not None:
            metrics["grad_norm"] = st.grad_norm
        metrics["lr"] = st.lr
        return metrics, st.update_successful

    # ------------------------------------------------------------------ weights

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, on every rank (collective)."""
        return export_hf_weights(self.model, spec=self.spec, groups=self.groups)

    # ------------------------------------------------------------------ checkpoint files

    def save_files(self, directory: Path) -> None:
        """Collective: megatron's distributed checkpoint of model, optimizer, LR schedule and RNG
        under `directory/model` (reshardable)."""
        from megapkl.models.checkpoint import save_checkpoint

        save_checkpoint(directory / "model", self.model, self.optimizer, self.scheduler,
                        groups=self.groups)

    def load_files(self, directory: Path) -> None:
        """Collective: the state `save_files` wrote, at this rank's layout."""
        from megapkl.models.checkpoint import load_checkpoint

        load_checkpoint(directory / "model", self.model, self.optimizer, self.scheduler,
                        groups=self.groups)

    def _from_last_stage(self, obj: Any) -> Any:
        """The last pipeline stage's `obj` on every stage (one object broadcast over PP)."""
        if self.groups.pp_size == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.groups.pp, self.groups.pp_size - 1)
        dist.broadcast_object_list(box, src=src, group=self.groups.pp)
        return box[0]
