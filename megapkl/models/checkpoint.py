"""megatron-core distributed checkpoints of model + optimizer + scheduler + RNG, reshardable.

The model is saved as megatron ShardedTensors and the distributed optimizer in its
`fully_reshardable` format (per-parameter tensors in model space), so a checkpoint written at
one TP/PP/DP layout loads at another (TP2 -> TP1, TP1 -> TP2xDP2, ...). RNG states are
per (PP, TP) rank; they are restored only when TP/PP/EP/CP are the same (another layout has
other streams: there is nothing meaningful to restore), which `LoadResult.rng_restored`
reports.

Two megatron-core 0.16 issues are handled here:
- Its writer forks one process per write bucket and collects their results through a queue of a
  spawned `multiprocessing.Manager` that it caches for the life of the process. Forked test ranks
  are daemonic and cannot have children; on the first GPU run a trainer's second run in one
  process (a resume after a finished run) failed its first save with `[Errno 32] Broken pipe`
  from those helpers; and every such process is one the run does not own. So the buckets are
  written by threads of this process (file writes release the GIL), scoped to the save call
  (`_in_process_writes`).
- With the torch Adam fallback (no apex/TE) the `fully_reshardable` load fails: the inner
  optimizer state is created lazily (so `state_dict()` finds no "step"), and the loader then
  copies every key of the live state, "step" included, from a source that has none. The load
  here allocates the state first and moves "step" aside while the parameter state is copied.
  megatron also gives all parameters one shared "step" tensor, which torch's Adam would then
  increment once per parameter per step (silently wrong bias correction): each gets a copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import random
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from megapkl.parallel.chunks import model_chunks
from megapkl.parallel.patches import apply, check
from megapkl.parallel.threads import rank_executor

# Model-space optimizer tensors without per-sub-optimizer key prefixes: loadable whatever the
# layout and however many sub-optimizers (dense / expert) the loading side has.
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


@dataclasses.dataclass(frozen=True)
class LoadResult:
    step: int
    extra: dict
    rng_restored: bool
    saved_layout: dict




def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _model_sharded(chunks: list) -> dict:
    return {_model_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}


def _groups(groups: Any) -> Any:
    """The run's `ParallelGroups` (megatron's own groups, taken once, when none is given)."""
    if groups is not None:
        return groups
    from megapkl.parallel.groups import ParallelGroups

    return ParallelGroups.from_megatron()


def _layout(g: Any) -> dict:
    return dict(tp=g.tp_size, pp=g.pp_size, ep=g.ep_size, dp=g.dp_size, cp=g.cp_size)


# ------------------------------------------------------------------ RNG


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return dict(python=random.getstate(), numpy=np.random.get_state(),
                torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                tracker=tensor_parallel.get_cuda_rng_tracker().get_states())


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(state: Any, g: Any) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One object per (PP, TP) rank; data-parallel replicas hold the same streams.
    return ShardedObject("rng_state", state, (g.pp_size, g.tp_size), (g.pp_rank, g.tp_rank),
                         replica_id=g.dp_cp_rank)


# ------------------------------------------------------------------ optimizer


def _sub_optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def _allocate_torch_adam_state(opt: Any) -> None:
    """Create the lazily-initialised torch Adam state (zeros, step 0) so it can be loaded into."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE or not _is_distributed(opt):
        return
    inner = opt.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state.get(p):
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def _adam_step(optimizer: Any) -> Optional[int]:
    """The optimizer's update count (megatron keeps it in the param groups' "step")."""
    steps = set()
    for opt in _sub_optimizers(optimizer):
        if not _is_distributed(opt):
            continue
        for group in opt.state_dict()["optimizer"]["param_groups"]:
            if group.get("step") is not None:
                steps.add(int(group["step"]))
    return max(steps) if steps else None


def _optimizer_template(optimizer: Any, model_sd: dict) -> dict:
    """Sharded tensors to load: each distributed sub-optimizer's parameter state.

    Only the sharded part is read from the checkpoint: the rest of megatron's optimizer state
    dict is nested per sub-optimizer (dense, expert), and their number depends on the layout
    (EP1 vs EP2), so it is rebuilt from the live optimizer instead.
    """
    template = {}
    for i, opt in enumerate(_sub_optimizers(optimizer)):
        if not _is_distributed(opt):
            raise ValueError("resharding checkpoints needs the distributed optimizer "
                             "(OptimSettings(distributed_optimizer=True))")
        _allocate_torch_adam_state(opt)
        sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=SHARDING)
        template[i] = sd["param_state"]
    return template


def _load_distributed(opt: Any, param_state: dict, step: Optional[int]) -> None:
    state = opt.state_dict()  # live param groups (hyperparameters), grad scaler
    if step is not None:
        for group in state["optimizer"]["param_groups"]:
            if "step" in group:
                group["step"] = step
    opt.load_state_dict(state)
    inner = opt.optimizer
    steps = {p: s.pop("step") for p, s in inner.state.items() if "step" in s}
    try:
        with torch.no_grad():
            opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        # megatron hands every parameter the *same* step tensor; torch Adam increments each
        # parameter's step in place, so a shared one would advance once per parameter.
        for p, step_t in steps.items():
            inner.state[p]["step"] = step_t.clone()


def _load_optimizer(optimizer: Any, loaded: dict, step: Optional[int]) -> None:
    subs = _sub_optimizers(optimizer)
    for i, opt in enumerate(subs):
        _load_distributed(opt, loaded[i], step)
    if len(subs) > 1:  # a ChainedOptimizer (dense + expert)
        check("optimizer-step-sync")
        optimizer._synchronize_steps()


# ------------------------------------------------------------------ in-process writer


@contextlib.contextmanager
def _in_process_writes() -> Iterator[None]:
    """Run megatron's checkpoint writer in this process, one thread per write bucket (scoped to
    the save)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    writer = fa.FileSystemWriterAsync

    def write_one(transform_list, use_msc, i, bucket):
        # What one of write_preloaded_data_multiproc's processes does.
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        writer.write_preloaded_data(transform_list, i, bucket, local, count, True,
                                    use_msc=use_msc)
        return local.get()

    def write_all(transform_list, use_msc, rank, write_buckets, results_queue):
        with rank_executor(max(1, len(write_buckets)), "megapkl-ckpt-write") as pool:
            done = list(pool.map(lambda ib: write_one(transform_list, use_msc, *ib),
                                 enumerate(write_buckets)))
        failed = [r for _, r in done if isinstance(r, Exception)]
        results_queue.put(failed[0] if failed else dict(done))

    name = check("checkpoint-writes-in-process").name  # registered: docs/patches.md
    saved_queue = fa._get_write_results_queue
    saved_writer = writer.__dict__["write_preloaded_data_multiproc"]
    apply(name, fa, "_get_write_results_queue", queue.Queue)
    apply(name, writer, "write_preloaded_data_multiproc", staticmethod(write_all))
    try:
        yield
    finally:
        apply(name, fa, "_get_write_results_queue", saved_queue)
        apply(name, writer, "write_preloaded_data_multiproc", saved_writer)


# ------------------------------------------------------------------ save / load


def save_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any = None,
                    scheduler: Any = None, *, step: int = 0, extra: Optional[dict] = None,
                    groups: Any = None) -> None:
    """Write a distributed checkpoint (collective over all ranks) into directory `path`.
    `groups`: the run's ParallelGroups (default: megatron's, taken once)."""
    from megatron.core import dist_checkpointing

    g = _groups(groups)
    chunks = model_chunks(model)
    path = Path(path)
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    model_sd = _model_sharded(chunks)
    state: dict[str, Any] = dict(model_sd)
    if optimizer is not None:
        for opt in _sub_optimizers(optimizer):
            _allocate_torch_adam_state(opt)  # a checkpoint before the first step works too
        merged = {k: v for sd in model_sd.values() for k, v in sd.items()}
        state["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=False,
                                                          metadata=SHARDING)
    state["rng_state"] = _rng_sharded(_rng_state(), g)
    state["common"] = dict(step=int(step), extra=dict(extra or {}), layout=_layout(g),
                           adam_step=None if optimizer is None else _adam_step(optimizer),
                           scheduler=None if scheduler is None else scheduler.state_dict())
    with _in_process_writes():
        dist_checkpointing.save(state, str(path))
    torch.distributed.barrier()


def load_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any = None,
                    scheduler: Any = None, *, load_rng: bool = True, strict: bool = True,
                    groups: Any = None) -> LoadResult:
    """Load a checkpoint written by `save_checkpoint` at any TP/PP/DP layout (collective)."""
    from megatron.core import dist_checkpointing

    g = _groups(groups)
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"no megatron distributed checkpoint at {path} "
                                "(metadata.json missing)")
    chunks = model_chunks(model)
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    # RNG streams are per (TP, PP, EP, CP) rank; data-parallel replicas share them.
    same_layout = all(common["layout"].get(k) == v for k, v in _layout(g).items() if k != "dp")
    model_sd = _model_sharded(chunks)
    template: dict[str, Any] = dict(model_sd)
    if optimizer is not None:
        merged = {k: v for sd in model_sd.values() for k, v in sd.items()}
        template["optimizer_param_state"] = _optimizer_template(optimizer, merged)
    restore_rng = load_rng and same_layout
    if restore_rng:
        template["rng_state"] = _rng_sharded(_rng_state(), g)
    loaded = dist_checkpointing.load(template, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=strict)
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer_param_state"], common.get("adam_step"))
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.num_steps = 0  # megatron's load *adds* the saved step count
        scheduler.load_state_dict(common["scheduler"])
    if restore_rng:
        _set_rng_state(loaded["rng_state"])
    return LoadResult(step=common["step"], extra=common["extra"], rng_restored=restore_rng,
                      saved_layout=common["layout"])
