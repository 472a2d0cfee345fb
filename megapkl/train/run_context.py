"""What a run holds open, and how it ends: on every exit path, everything is closed.

    with RunContext(launch_ctx) as run:
        run.lock(run_dir)                 # collective, before anything is launched
        engine = run.hold(build_engine()) # closed when the run ends, however it ends
        ...
        reason = run.stop_requested()     # once per update: one collective

The context is an ExitStack: each component is registered as soon as it exists, so a constructor
that fails half-way closes what the earlier ones started (launched SGLang fleets, the verifier's
worker process, TensorBoard and W&B), and so does the normal end, a NaN abort, an engine outage,
Ctrl-C and a Slurm preemption (whose requeue unwinds the stack on its way out). The run-directory
lock is taken first and released last.

Stopping: on a local run SIGTERM / SIGINT are recorded (megapkl.train.stopping); under a launcher
(Slurm) its context records the preemption signal. Either way `stop_requested` asks every rank in
one collective, so they all save the same checkpoint and stop together.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch.distributed as dist

T = TypeVar("T")
PREEMPTION = "preemption"


class RunContext:
    def __init__(self, launch: Any = None) -> None:
        """`launch`: the launcher's context (Slurm: preemption and requeue), None for a local run."""
        self.launch = launch
        self.stack = contextlib.ExitStack()
        self.notice: Any = None  # megapkl.train.failure_notice.FailureNotice, once started

    def __enter__(self) -> "RunContext":
        self.stack.__enter__()
        if self.launch is None:  # under a launcher, its handlers own the signals
            from megapkl.train import stopping

            self.stack.callback(stopping.install())
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self.stack.__exit__(*exc)

    def hold(self, thing: T) -> T:
        """Close `thing` (if it has a close()) when the run ends; returns it."""
        close = getattr(thing, "close", None)
        if close is not None:
            self.stack.callback(close)
        return thing

    def on_exit(self, fn: Any) -> None:
        """Call `fn()` when the run ends, however it ends (before what was held earlier closes)."""
        self.stack.callback(fn)

    def watch_failures(self) -> None:
        """Once torch.distributed is up: the watcher of failures outside an agreement
        (megapkl.train.failure_notice), closed when the run ends."""
        from megapkl.train.failure_notice import FailureNotice

        self.notice = self.hold(FailureNotice.start())

    def stop_watching(self) -> None:
        """The run is over on this rank: the failure watcher stops (also closed with the run)."""
        if self.notice is not None:
            self.notice.close()

    def told(self, exc: BaseException, update: int, checkpoint: Any) -> BaseException:
        """What this rank raises for `exc` (the run's exception): the same line on every rank when
        a rank failed outside an agreement (see FailureNotice.failed), else `exc`."""
        if self.notice is None:
            return exc
        return self.notice.failed(exc, update, None if checkpoint is None else str(checkpoint))

    def lock(self, run_dir: Path) -> None:
        """Collective: rank 0 takes the run directory's lock (a second live run is refused on
        every rank, before anything is launched); released when the run ends."""
        from megapkl.train.agree import agreed
        from megapkl.train.runlock import RunLock

        def take() -> None:
            if not dist.is_initialized() or dist.get_rank() == 0:
                self.hold(RunLock(Path(run_dir)).acquire())
        agreed(take, what="locking the run directory")

    def stopping(self) -> bool:
        """This rank got a stop signal or a preemption (no collective: any thread, any time)."""
        if self.launch is not None:
            signaled = getattr(self.launch, "preempt_signaled", None)
            return bool(signaled and signaled())
        from megapkl.train import stopping

        return stopping.received() != 0

    def stop_requested(self, error: Any = None) -> Optional[str]:
        """Collective, once per update on every rank: 'preemption' (launcher), the name of a stop
        signal any rank received (local run), or None. `error`: a rank-local failure carried to
        this point (megapkl.train.agree.Carried), agreed in the same all-reduce: RanksFailed on
        every rank when any rank passes one."""
        from megapkl.train import stopping
        from megapkl.train.agree import agree

        if self.launch is not None:  # local only: the launcher is asked below, when agreed
            local = int(bool(self.stopping()))
        else:
            local = stopping.received()
        signum, = agree(error, what="the update", flags=[local])
        if not signum:
            return None
        if self.launch is not None:  # every rank is here: its collective acknowledges the signal
            return PREEMPTION if self.launch.preempt_requested() else None
        return stopping.name(signum)

    def shorten_timeouts(self, seconds: float) -> None:
        """Collective, after the first update: every process group of this rank waits at most
        `seconds` in a collective from now on (startup, which may take long, is over), so a rank
        that is lost outside any agreement costs minutes, not the startup timeout. The barrier
        first: no rank may meet the short timeout while a peer still runs under the long one."""
        import datetime

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        dist.barrier()
        timeout = datetime.timedelta(seconds=seconds)
        # torch 2.14 made it public; 2.13 (the lowest torch pyproject.toml admits) has the same
        # call under its former private name
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        world = dist.distributed_c10d._world.pg_map  # every group this process created
        for group in list(world):
            if dist.distributed_c10d._rank_not_in_group(group):
                continue
            set_timeout(timeout, group)

    def stop(self, reason: str, u: int, checkpoint: Path) -> None:
        """After update u's checkpoint: requeue a preempted job (never returns), or say why a
        local run stopped."""
        if reason == PREEMPTION:
            self.launch.requeue()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[megapkl.train] {reason}: stopped after update {u} with checkpoint "
                  f"{checkpoint}; continue with checkpoint.resume=true", file=sys.stderr,
                  flush=True)
