"""Explicit process groups, taken once from megatron-core and passed to the math.

megatron-core keeps its process groups in module globals (`parallel_state`). Code in
megapkl that reduces across ranks never reads those globals: it receives a `ParallelGroups`
bundle (or a single group from it) as an argument, so the same function works for any
layout, and in a single process with `ParallelGroups.single()` (all groups None, sizes 1).

A group of None always means "no communication: this rank holds everything".

`ParallelGroups.device` is where every tensor that enters a collective or the model lives:
`cuda:LOCAL_RANK` under NCCL, the CPU under gloo (and for the single-process bundle). Code that
allocates a tensor to reduce, gather or feed to the model takes the device from here.

The megatron CPU compatibility layer (`megapkl.parallel.compat`) is not installed here: a CPU
process installs it once at its entry point (`megapkl.train.loop.init_groups` for the trainer,
the forked test harness for tests); `init_parallel` refuses to build megatron groups on a
machine without CUDA when it is missing, instead of failing later inside megatron.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from megapkl.parallel.dist_internals import default_group, process_groups

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    """World size of `group`; 1 for None (single process semantics)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """Process groups and this rank's coordinates in each of them.

    tp: tensor parallel (vocab-sharded logits, sharded linear layers)
    pp: pipeline parallel stages
    cp: context parallel (a sequence split across ranks)
    dp: data parallel, without the CP ranks
    dp_cp: data parallel including CP ranks (what gradients and global token counts reduce over)
    ep: expert parallel (MoE)
    world: all ranks
    """

    world: ProcessGroup
    tp: ProcessGroup
    pp: ProcessGroup
    cp: ProcessGroup
    dp: ProcessGroup
    dp_cp: ProcessGroup
    ep: ProcessGroup
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    dp_cp_rank: int
    dp_cp_size: int
    ep_rank: int
    ep_size: int
    device: torch.device = torch.device("cpu")
    # megatron's `ProcessGroupCollection` of the same layout (every group megatron-core's model,
    # DDP, optimizer and schedules take as an argument); None for the single-process bundle.
    pg_collection: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_groups(cls, *, world: ProcessGroup, tp: ProcessGroup, pp: ProcessGroup,
                    cp: ProcessGroup, dp: ProcessGroup, dp_cp: ProcessGroup,
                    ep: ProcessGroup, device: Optional[torch.device] = None) -> "ParallelGroups":
        """Bundle explicit groups, reading each rank/size from the group itself. `device`
        defaults to the one the default process group's backend needs (`process_device`)."""
        named = dict(tp=tp, pp=pp, cp=cp, dp=dp, dp_cp=dp_cp, ep=ep)
        coords = {}
        for name, group in named.items():
            coords[f"{name}_rank"] = group_rank(group)
            coords[f"{name}_size"] = group_size(group)
        # world=None is the single-process bundle; otherwise ranks come from the default group.
        return cls(world=world, **named, rank=group_rank(world), world_size=group_size(world),
                   device=process_device() if device is None else torch.device(device), **coords)

    @classmethod
    def single(cls) -> "ParallelGroups":
        """Everything on this process: every group None, every size 1."""
        return cls.from_groups(world=None, tp=None, pp=None, cp=None, dp=None, dp_cp=None,
                               ep=None, device=torch.device("cpu"))

    @classmethod
    def from_collection(cls, pgc) -> "ParallelGroups":
        """The bundle of megatron's `ProcessGroupCollection` (which it keeps for megatron)."""
        bundle = cls.from_groups(world=dist.group.WORLD, tp=pgc.tp, pp=pgc.pp, cp=pgc.cp,
                                 dp=pgc.dp, dp_cp=pgc.dp_cp, ep=pgc.ep)
        return dataclasses.replace(bundle, pg_collection=pgc)

    @classmethod
    def from_megatron(cls) -> "ParallelGroups":
        """The groups megatron-core created in `initialize_model_parallel`, taken once here; the
        trainer passes them on (model, DDP, optimizer, schedules, loss) instead of megatron
        reading its `parallel_state` globals."""
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("megatron model parallel is not initialized")
        return cls.from_collection(ProcessGroupCollection.use_mpu_process_groups())


_OUT_OF_STEP = {"set": False}


def mark_out_of_step() -> None:
    """This process's ranks are no longer in step: one failed outside an agreement and the others
    left the collective they waited in (megapkl.train.failure_notice). No closing collective may
    be entered now: its partners are gone or inside another one."""
    _OUT_OF_STEP["set"] = True


def out_of_step() -> bool:
    return _OUT_OF_STEP["set"]


def process_device() -> torch.device:
    """The device collectives of this process use: cuda:LOCAL_RANK under NCCL, else the CPU."""
    import os

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def group_device(group: ProcessGroup) -> torch.device:
    """The device tensors must be on to cross `group` (NCCL: this process's GPU; gloo, None: CPU)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replica_group(groups: ParallelGroups) -> ProcessGroup:
    """The ranks that share this rank's data-parallel index (one model replica). Collective over
    the world: every rank creates every replica's group (torch requires it)."""
    world = dist.get_world_size()
    mine = torch.tensor([groups.dp_rank], dtype=torch.int64, device=groups.device)
    table = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(table, mine)
    dp_of = [int(t) for t in table]
    out = None
    for d in range(groups.dp_size):
        g = dist.new_group([r for r in range(world) if dp_of[r] == d])
        if d == groups.dp_rank:
            out = g
    return out


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    *,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    seed: Optional[int] = None,
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
) -> ParallelGroups:
    """Initialize torch.distributed (if needed) and megatron model parallel; return the groups.

    The data-parallel size is whatever is left: world_size / (tp * pp * cp). The backend
    defaults to nccl with CUDA (the process then uses cuda:LOCAL_RANK) and to gloo without,
    where the megatron CPU compatibility layer must already be installed (module docstring).
    `init_method`/`rank`/`world_size` default to torchrun's environment.
    A previous megatron model-parallel state is destroyed, so this can be called again with
    another layout in the same process. `seed` seeds torch and megatron's RNG tracker
    (`model_parallel_cuda_manual_seed`), giving TP ranks distinct model-parallel streams.
    """
    _require_cpu_compat()
    if not dist.is_initialized():
        _init_process_group(backend, init_method, rank, world_size, timeout_minutes)

    from megatron.core import parallel_state as ps

    _check_layout(dist.get_world_size(), tp, pp, cp, ep, tp if etp is None else etp)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
        order=order,
    )
    if seed is not None:
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return ParallelGroups.from_megatron()


def created_groups() -> set:
    """The process groups that exist now (to tell later which ones a run created)."""
    return set(process_groups())


def release_groups(existing: set) -> None:
    """Destroy the process groups made since `existing` (created_groups()): megatron's model
    parallel state and every group made beside it (a weight-update group left by a failure
    too), except the default group, which belongs to whoever started torch.distributed."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if not dist.is_initialized():
        return
    default = default_group()
    for group in process_groups():
        if group not in existing and group is not default:
            dist.destroy_process_group(group)


def _require_cpu_compat() -> None:
    from megapkl.parallel import compat

    if not torch.cuda.is_available() and not compat.is_installed():
        raise RuntimeError(
            "init_parallel: no CUDA device and the megatron CPU compatibility layer is not "
            "installed; call megapkl.parallel.compat.install() at the process entry point "
            "(megapkl.train.loop.init_groups does) before building megatron groups")


# ProcessGroupNCCL's asynchronous error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING, read when a
# group is made; torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp, `ErrorHandlingMode`):
# 0 NoHandling, 1 TearDown, 2 CleanUpOnly, 3 SkipCleanUp (the default when unset). On a failed or
# timed-out collective the watchdog aborts the communicators under 1 and 2 (SHOULD_CLEAN_UP) and
# rethrows in its own thread under 1 and 3 (SHOULD_TEAR_DOWN: `WorkNCCL::handleException`),
# which ends the process. The failure notice aborts a rank's groups when another rank failed
# (torch documents `_abort_process_group` for a mode without handling), and the aborted work is
# an error the watchdog then handles: under 1 or 3 the process would die mid-exit, before its
# line. CleanUpOnly keeps the watchdog's abort on a timeout (a rank killed outright costs the
# shortened timeout, not forever, as 0 would) and leaves the process to raise the collective's
# error itself; megapkl uses it unless the environment names a mode.
NCCL_ERROR_HANDLING_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_CLEAN_UP_ONLY = 2
NCCL_DEFAULT_HANDLING = 3  # SkipCleanUp, torch's default


def nccl_error_handling() -> int:
    """The asynchronous error handling mode NCCL groups of this process are made with."""
    import os

    for name in NCCL_ERROR_HANDLING_ENV:
        value = os.environ.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return NCCL_DEFAULT_HANDLING


def use_nccl_clean_up_only() -> None:
    """Before the first NCCL group: CleanUpOnly unless the environment chose a mode (see
    NCCL_ERROR_HANDLING_ENV)."""
    import os

    if not any(os.environ.get(name, "").strip() for name in NCCL_ERROR_HANDLING_ENV):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = str(NCCL_CLEAN_UP_ONLY)


def _init_process_group(backend, init_method, rank, world_size, timeout_minutes) -> None:
    import os

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per process: collectives and the model use cuda:LOCAL_RANK
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        use_nccl_clean_up_only()
    kwargs = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    dist.init_process_group(
        backend,
        init_method=init_method or "env://",
        timeout=datetime.timedelta(minutes=timeout_minutes),
        **kwargs,
    )


def _check_layout(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> None:
    # megatron asserts these too, with messages that do not name the sizes.
    model = tp * pp * cp
    if world_size % model:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {model}")
    per_stage = world_size // pp  # the ranks of one pipeline stage hold all experts
    if per_stage % (etp * ep):
        raise ValueError(f"etp*ep = {etp}*{ep} does not divide world/pp = {per_stage}")
