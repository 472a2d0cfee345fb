"""megatron-core DDP + (distributed) Adam, gradient clipping and the learning-rate schedule.

The pieces the trainer calls around megatron's forward/backward schedules:

    ddp = wrap_ddp(chunks, settings)              # grads accumulate in fp32 DDP buffers
    opt = build_optimizer(ddp, settings)          # Adam; fp32 main weights for BF16 params
    main_params(opt)                              # what Adam updates (fp32 in every dtype)
    sched = build_scheduler(opt, settings)        # constant LR, optional warmup / cosine
    attach_to_config(ddp, opt)                    # schedules: no_sync, finalize, loss scale
    zero_grads(ddp, opt)
    ... forward_backward (or loss.backward() + finalize_grads(ddp)) ...
    stats = optimizer_step(opt, sched)            # stats.grad_norm is the pre-clip norm

Fused kernels: megatron picks TE's / apex's FusedAdam and multi-tensor kernels when they import
(GPU) and falls back to torch.optim.Adam and plain loops otherwise (CPU): nothing to choose here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, List, Optional

import torch


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """Adam with global-norm clipping; defaults are the paper settings (no weight decay)."""

    lr: float = 1e-6
    min_lr: float = 0.0  # cosine floor
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global L2 norm; 0 disables clipping
    lr_schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0  # linear warmup from 0 to lr
    decay_steps: Optional[int] = None  # cosine: steps from the start to reach min_lr
    distributed_optimizer: bool = True  # shard optimizer state over data-parallel ranks
    overlap_grad_reduce: bool = False  # GPU: overlap the DP reduce-scatter with backward
    bucket_size: Optional[int] = None  # DDP bucket elements (None: megatron's default)

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule: must be constant|cosine, got {self.lr_schedule!r}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"lr/min_lr: need 0 <= min_lr <= lr, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule == "cosine":
            if not self.decay_steps or self.decay_steps <= self.warmup_steps:
                raise ValueError(f"decay_steps: cosine needs decay_steps > warmup_steps "
                                 f"({self.warmup_steps}), got {self.decay_steps}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad: must be >= 0, got {self.clip_grad}")


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports."""

    update_successful: bool
    grad_norm: Optional[float]  # global L2 norm of the gradients *before* clipping
    num_zeros_in_grad: Optional[int]
    lr: float


def _as_list(chunks: Any) -> List[Any]:
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def wrap_ddp(chunks: Any, settings: OptimSettings = OptimSettings(), *,
             broadcast: bool = True, pg_collection: Any = None) -> List[Any]:
    """Wrap model chunks in megatron's DistributedDataParallel (fp32 gradient buffers).

    `broadcast` copies data-parallel rank 0's weights to the other replicas, so replicas agree
    even if they were initialised differently.
    """
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)

    chunks = _as_list(chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # BF16 params, fp32 gradient accumulation and reduction
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.distributed_optimizer,
        bucket_size=settings.bucket_size,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        ddp = DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            # megatron-LM: only the first chunk is bucketed, so later virtual stages'
            # reductions do not wait on buckets filled much later in the backward pass.
            disable_bucketing=i > 0, pg_collection=pg_collection,
        )
        if broadcast:
            ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def build_optimizer(ddp_chunks: Any, settings: OptimSettings = OptimSettings(),
                    pg_collection: Any = None):
    """megatron's optimizer (chained dense + expert parts for MoE) for DDP-wrapped chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = _as_list(ddp_chunks)
    dtype = chunks[0].config.params_dtype
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        main_grads_dtype=torch.float32,
        main_params_dtype=torch.float32,
        use_distributed_optimizer=settings.distributed_optimizer,
    )
    # megatron refuses its extra gloo groups with explicit groups (they only serve its legacy
    # CPU-side optimizer-state gather; checkpoints go through dist_checkpointing).
    return get_megatron_optimizer(config, chunks, pg_collection=pg_collection,
                                  use_gloo_process_groups=pg_collection is None)


def build_scheduler(optimizer: Any, settings: OptimSettings = OptimSettings()):
    """megatron's OptimizerParamScheduler: linear warmup, then constant or cosine decay.

    Update n (1-based) uses `lr_at(settings, n)`: warmup gives lr*n/W for n <= W (megatron's
    scheduler would spend its first update at lr 0, so it is advanced by one here), cosine
    reaches min_lr at update `decay_steps`.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if settings.lr_schedule == "cosine":
        decay_steps, style = settings.decay_steps, "cosine"
    else:  # megatron needs decay_steps > warmup_steps even when nothing decays
        decay_steps, style = settings.warmup_steps + 1, "constant"
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    scheduler.step(increment=1)
    return scheduler


def lr_at(settings: OptimSettings, step: int) -> float:
    """The learning rate of update `step` (1-based), as the scheduler sets it."""
    if settings.warmup_steps and step <= settings.warmup_steps:
        return settings.lr * step / settings.warmup_steps
    if settings.lr_schedule == "constant":
        return settings.lr
    if step > settings.decay_steps:
        return settings.min_lr
    done = (step - settings.warmup_steps) / (settings.decay_steps - settings.warmup_steps)
    return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * done))


def attach_to_config(ddp_chunks: Any, optimizer: Any, pg_collection: Any = None) -> None:
    """Give megatron's pipeline schedules the DDP/optimizer hooks (as megatron-LM's train does)."""
    from megatron.core.distributed import finalize_model_grads

    chunks = _as_list(ddp_chunks)
    config = chunks[0].config
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = (finalize_model_grads if pg_collection is None else
                                        functools.partial(finalize_model_grads,
                                                          pg_collection=pg_collection))
    config.grad_scale_func = optimizer.scale_loss
    if any(c.ddp_config.overlap_grad_reduce for c in chunks):
        sync = [c.start_grad_sync for c in chunks]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync


def zero_grads(ddp_chunks: Any, optimizer: Any) -> None:
    """Clear the DDP gradient buffers and the optimizer's grads before a step's backward passes."""
    for chunk in _as_list(ddp_chunks):
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def finalize_grads(ddp_chunks: Any, num_tokens: Optional[torch.Tensor] = None) -> None:
    """Reduce gradients outside a megatron schedule (after a plain `loss.backward()`):
    data-parallel reduce, tensor-parallel sums of replicated weights (norms, router under SP),
    tied embedding sync across pipeline stages. `num_tokens`: megatron's per-token scaling."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(_as_list(ddp_chunks), num_tokens=num_tokens)


def optimizer_step(optimizer: Any, scheduler: Any = None) -> StepStats:
    """Clip (global norm) and apply one Adam step; advance the LR schedule after it."""
    lr = optimizer.param_groups[0]["lr"]
    ok, grad_norm, zeros = optimizer.step()
    if scheduler is not None and ok:
        scheduler.step(increment=1)
    norm = None if grad_norm is None else float(grad_norm)
    return StepStats(bool(ok), norm, None if zeros is None else int(zeros), float(lr))


def main_params(optimizer: Any) -> List[torch.Tensor]:
    """The tensors Adam updates (this rank's shards under the distributed optimizer): fp32
    copies of bf16 model parameters, or the fp32 parameters themselves."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p for part in parts for group in part.optimizer.param_groups for p in group["params"]]


def current_lr(optimizer: Any) -> float:
    return float(optimizer.param_groups[0]["lr"])
