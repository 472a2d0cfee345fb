"""Inside a Slurm task: torch.distributed from the Slurm environment, the context handed to the
entry point, and cooperative preemption.

The entry point (the trainer, or `megapkl.launch.toy.run`) is called as `entry(cfg, ctx)` (or
`entry(cfg)` if it takes one argument; it can then reach the context with `current_context()`).

Preemption protocol. Slurm sends SIGUSR2 to every task `signal_delay_s` before a time limit, and
on preemption (submitit's `job._interrupt()` does the same). Each task only records the signal. The
entry point calls `ctx.preempt_requested()` at every step boundary; it is a collective (one tiny
all-reduce) so all ranks agree on the same step. When it returns True, the entry point saves a
checkpoint (collectively) and calls `ctx.requeue()`, which never returns: rank 0 requeues the Slurm
job and every rank exits without a result, so submitit keeps waiting and the requeued job starts
again with `cfg.checkpoint.resume = True` and `ctx.restart_count` + 1.
An entry point that never polls still gets requeued: `preempt_grace_s` after the signal a watchdog
requeues the job from rank 0 and exits it (srun's --kill-on-bad-exit then ends the other ranks);
the job resumes from its last periodic checkpoint.

Who runs `scontrol requeue`: jobs submitted by megapkl (submitit) and by slurm/sbatch_template.sh
export MEGAPKL_REQUEUE_DIR; rank 0 leaves a request file there and the batch script, on the host,
requeues the job once every task has exited (`host_requeue_lines`). Tasks then need no Slurm
client, which container images do not ship. Without it (a bare srun launch) rank 0 runs
`scontrol requeue` itself.

torch is imported inside functions only (the launcher's modules import without it).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megapkl.errors import MegapklError

log = logging.getLogger("megapkl.launch")

_CURRENT: Optional["LaunchContext"] = None


class Requeued(BaseException):
    """Raised by `LaunchContext.requeue()` after the job was requeued. A BaseException so that a
    trainer's `except Exception` does not swallow it and submitit writes no result."""

    every_rank = True  # every rank requeues alike: no failure notice (train.failure_notice)


class RequeueLimitError(MegapklError, RuntimeError):
    """Preempted or timed out more often than the profile's max_requeues allows."""

    every_rank = True  # the same decision on every rank


@dataclass
class LaunchContext:
    """What the entry point gets besides the config. All paths are absolute."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    backend: str  # 'gloo' or 'nccl'
    device: str  # 'cpu' or 'cuda:<local_rank>'
    run_dir: Path
    checkpoint_dir: Path
    metrics_path: Path
    job_id: str
    restart_count: int  # times this job was requeued before this start (SLURM_RESTART_COUNT)
    max_requeues: int
    threads: int
    entry_kwargs: dict[str, Any] = field(default_factory=dict)
    _flag: "_PreemptFlag" = field(default=None, repr=False)  # type: ignore[assignment]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def resumed(self) -> bool:
        return self.restart_count > 0

    # ---- metrics
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics to <run_dir>/metrics.jsonl (rank 0; other ranks: no-op).
        A step logged again after a resume replaces the earlier line for readers."""
        if self.rank != 0:
            return
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items() if k != "step"}}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def retriever_launcher(self) -> Any:
        """The job step that runs the search agent's retriever where the cluster profile puts it
        (megapkl.launch.retriever), or None: it runs beside this rank."""
        from megapkl.launch.retriever import step_launcher

        return step_launcher()

    # ---- preemption
    def preempt_signaled(self) -> bool:
        """This rank got the preemption/time-limit signal (no collective: any thread, any time)."""
        return self._flag is not None and self._flag.requested

    def preempt_requested(self) -> bool:
        """Collective: True on every rank when any rank got the preemption/time-limit signal.
        Call it on all ranks at the same point (a step boundary)."""
        local = 1.0 if self._flag is not None and self._flag.requested else 0.0
        if self.world_size == 1:
            return bool(local)
        import torch
        import torch.distributed as dist

        t = torch.tensor([local], dtype=torch.float32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got = bool(t.item() > 0)
        if got and self._flag is not None:
            self._flag.acknowledged = True
        return got

    def requeue(self) -> "None":
        """After the checkpoint is saved: requeue the job and exit this task. Never returns."""
        if self._flag is not None:
            self._flag.acknowledged = True
        if self.restart_count >= self.max_requeues:  # the same decision on every rank
            raise RequeueLimitError(_limit_message(self.job_id, self.restart_count,
                                                   self.max_requeues))
        _barrier(self)
        if self.rank == 0:
            requeue_job(self.job_id, self.restart_count, self.max_requeues)
        raise Requeued(f"job {self.job_id} requeued at restart {self.restart_count}")


def current_context() -> Optional[LaunchContext]:
    """The context of the running launched job, or None outside one."""
    return _CURRENT


# ---- signal handling

class _PreemptFlag:
    def __init__(self) -> None:
        self.requested = False
        self.acknowledged = False
        self.signal_time: Optional[float] = None


_EARLY_SIGNAL: dict[str, Optional[float]] = {"time": None}


def _preempt_signal() -> signal.Signals:
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))


def install_early_handler() -> None:
    """For launches without submitit (plain srun): USR2's default action kills the process, so
    record a signal that arrives before `install_preemption_handler` and honor it there."""
    def early(signum: int, frame: Any) -> None:
        _EARLY_SIGNAL["time"] = _EARLY_SIGNAL["time"] or time.time()

    signal.signal(_preempt_signal(), early)


def install_preemption_handler(ctx: LaunchContext, grace_s: float) -> _PreemptFlag:
    """Replace submitit's USR2 handler (which checkpoints from inside the signal) with a flag, and
    arm a watchdog that requeues from rank 0 if the entry point does not react in `grace_s`."""
    flag = _PreemptFlag()
    sig = _preempt_signal()

    def on_signal(signum: int, frame: Any) -> None:
        if flag.requested:
            return
        flag.requested = True
        flag.signal_time = time.time()
        print(f"[megapkl.launch] rank {ctx.rank}: got {signal.Signals(signum).name}; will "
              f"checkpoint and requeue at the next step boundary (watchdog {grace_s:.0f}s)",
              file=sys.stderr, flush=True)
        from megapkl.parallel.threads import start_thread

        start_thread(_watchdog, name="megapkl-preempt-watchdog", args=(ctx, flag, grace_s))

    signal.signal(sig, on_signal)
    ctx._flag = flag
    if _EARLY_SIGNAL["time"] is not None:  # arrived during start-up
        on_signal(sig, None)
    return flag


def _watchdog(ctx: LaunchContext, flag: _PreemptFlag, grace_s: float) -> None:
    time.sleep(grace_s)
    if flag.acknowledged:
        return  # the entry point is checkpointing; requeue() follows
    print(f"[megapkl.launch] rank {ctx.rank}: the entry point did not reach a step boundary "
          f"within {grace_s:.0f}s of the signal", file=sys.stderr, flush=True)
    if ctx.rank == 0:
        try:
            requeue_job(ctx.job_id, ctx.restart_count, ctx.max_requeues)
        except RequeueLimitError as exc:
            print(f"[megapkl.launch] {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(3)


REQUEUE_DIR_ENV = "MEGAPKL_REQUEUE_DIR"


def requeue_job(job_id: str, restart_count: int, max_requeues: int) -> None:
    if restart_count >= max_requeues:
        raise RequeueLimitError(_limit_message(job_id, restart_count, max_requeues))
    print(f"[megapkl.launch] requeueing job {job_id} (restart {restart_count + 1})",
          file=sys.stderr, flush=True)
    folder = os.environ.get(REQUEUE_DIR_ENV)
    if folder:  # the batch script requeues from the host when the tasks have exited
        slurm_id = os.environ.get("SLURM_JOB_ID") or job_id
        (Path(folder) / f"requeue.{slurm_id}").write_text(job_id + "\n")
        return
    if shutil.which("scontrol") is None:
        raise RuntimeError(f"cannot requeue job {job_id}: no Slurm client (scontrol) in this task "
                           f"and no {REQUEUE_DIR_ENV} for the batch script to requeue it from the "
                           "host (megapkl submit sets it up)")
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)


def host_requeue_lines(folder: Path) -> tuple[list[str], list[str]]:
    """(setup, teardown) lines of a batch script: export the request folder to the tasks; after
    srun, requeue the job from the host if a task asked for it."""
    import shlex

    request = f'"${REQUEUE_DIR_ENV}/requeue.$SLURM_JOB_ID"'
    return ([f"export {REQUEUE_DIR_ENV}={shlex.quote(str(folder))}"],
            [f"if [ -e {request} ]; then rm -f {request}; "
             f'scontrol requeue "$SLURM_JOB_ID"; fi'])


def _limit_message(job_id: str, restart_count: int, max_requeues: int) -> str:
    return (f"job {job_id} was preempted or timed out after {restart_count} requeues "
            f"(max_requeues={max_requeues} in the profile); not requeueing it again")


def _barrier(ctx: LaunchContext) -> None:
    if ctx.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()


# ---- torch.distributed from the Slurm environment

def configure_threads() -> int:
    """OMP/MKL threads and torch threads from SLURM_CPUS_PER_TASK (task/none binds nothing)."""
    n = int(os.environ.get("SLURM_CPUS_PER_TASK") or 1)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    return n


def rendezvous_port(job_id: str, restart: int) -> int:
    """The job's MASTER_PORT, which every task computes alike from the Slurm job id (an integer)
    and the restart count: in 20000-29999, below Linux's ephemeral range (32768-60999 unless
    changed), so that no outgoing connection on the node holds it, and below the servers'
    base_port (30000); a new one at each requeue (7919 is prime to 10000), so that a socket of the
    attempt before, still closing, cannot hold it; and consecutive jobs sharing a node get
    different ones. slurm/sbatch_template.sh computes the same in bash for torchrun.
    (submitit's own default draws from 20000-60000 by job id alone.)"""
    return 20000 + (int(job_id) + 7919 * int(restart)) % 10000


def init_distributed(use_gpus: bool, timeout_s: float = 600.0) -> dict[str, Any]:
    """Export MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK from Slurm (submitit) and initialize
    the default process group: NCCL on GPUs, gloo on CPU. Returns the layout."""
    import datetime

    import submitit
    import torch
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun: it exported everything already
        env = _TorchrunEnv()
    else:
        if "MASTER_PORT" not in os.environ and os.environ.get("SLURM_JOB_ID"):
            os.environ["MASTER_PORT"] = str(rendezvous_port(
                os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT") or 0)))
        # overwrite: the task's rank and world come from Slurm, whatever the environment held
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                                    overwrite=True)
    if use_gpus:
        if not torch.cuda.is_available():
            raise RuntimeError("the profile asks for GPUs but CUDA is not available in this task "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(env.local_rank)
        backend, device = "nccl", f"cuda:{env.local_rank}"
        from megapkl.parallel.groups import use_nccl_clean_up_only

        use_nccl_clean_up_only()  # what the failure notice's abort needs (parallel/groups.py)
    else:
        backend, device = "gloo", "cpu"
    if env.world_size > 1 and not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "local_world_size": env.local_world_size, "backend": backend, "device": device,
            "master": f"{env.master_addr}:{env.master_port}"}


class _TorchrunEnv:
    def __init__(self) -> None:
        e = os.environ
        self.rank, self.world_size = int(e["RANK"]), int(e["WORLD_SIZE"])
        self.local_rank = int(e["LOCAL_RANK"])
        self.local_world_size = int(e.get("LOCAL_WORLD_SIZE", 1))
        self.master_addr, self.master_port = e.get("MASTER_ADDR", ""), e.get("MASTER_PORT", "")


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        try:
            return v.item()
        except Exception:  # noqa: BLE001 - a non-scalar tensor: leave it to json
            return str(v)
    return v
