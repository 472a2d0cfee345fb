"""The callable submitit pickles and runs in every Slurm task.

`MegapklJob(spec)()` (in each task): chdir to the submit directory, threads from
SLURM_CPUS_PER_TASK, torch.distributed from the Slurm environment, reload the resolved config from
<run_dir>/config.yaml (with checkpoint.resume=True after a requeue), install the cooperative
preemption handler, call the entry point, write <run_dir>/result.json (rank 0) and return the entry
point's value (every task; `job.results()` gives one per task).

It is a `submitit.helpers.Checkpointable`: if the preemption signal arrives before the cooperative
handler is installed, submitit's own handler calls `checkpoint()` and requeues the same spec; every
start resumes from the run directory's checkpoints, so the callable itself carries no state.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import submitit

DEFAULT_ENTRY = "megapkl.train:run"


@dataclass
class LaunchSpec:
    """Everything a task needs; pickled into the submitit folder. Paths are absolute."""

    run_dir: str
    cwd: str
    config_file: str  # <run_dir>/config.yaml, the resolved config
    entry: str = DEFAULT_ENTRY  # 'module:function'
    entry_kwargs: dict[str, Any] = field(default_factory=dict)
    use_gpus: bool = False
    max_requeues: int = 10
    preempt_grace_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    dist_timeout_s: float = 600.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_entry(entry: str) -> Callable[..., Any]:
    module, _, name = entry.partition(":")
    if not module or not name:
        raise ValueError(f"entry point must be 'module:function', got '{entry}'")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise ModuleNotFoundError(f"entry point module '{module}' not found ({exc}); pass "
                                      "--entry module:function") from exc
        raise
    fn = getattr(mod, name, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"entry point '{entry}': module '{module}' has no function '{name}'")
    return fn


def check_entry_importable(entry: str) -> None:
    """At submit time, without importing the module (and torch): does it exist?"""
    import importlib.util

    module, _, name = entry.partition(":")
    if not module or not name:
        raise ValueError(f"entry point must be 'module:function', got '{entry}'")
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise ValueError(f"entry point module '{module}' is not importable here; pass --entry "
                         "module:function (e.g. megapkl.launch.toy:run)")


def _takes_context(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.name == "ctx" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _event(run_dir: Path, **row: Any) -> None:
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")


class MegapklJob(submitit.helpers.Checkpointable):
    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        # submitit's own handler (signal before ours is installed): requeue the same stateless
        # spec; the next start resumes from the run directory's checkpoints.
        return submitit.helpers.DelayedSubmission(MegapklJob(self.spec))

    def __call__(self) -> Any:
        return run_task(self.spec)


def run_task(spec: LaunchSpec, cfg: Any = None) -> Any:
    """One task of a launched job (see the module docstring). `cfg`: an already loaded config
    (plain srun/torchrun launches); default: reload spec.config_file."""
    import dataclasses

    from megapkl.launch import runtime
    from megapkl.launch.runconfig import absolute_paths, load_resolved

    os.chdir(spec.cwd)
    os.environ.update(spec.env)
    run_dir = Path(spec.run_dir)
    job_env = submitit.JobEnvironment()
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    threads = runtime.configure_threads()  # imports torch
    layout = runtime.init_distributed(spec.use_gpus, spec.dist_timeout_s)
    if cfg is None:
        cfg = load_resolved(spec.config_file, resume=restart > 0)
    elif restart > 0 and cfg.checkpoint.resume is False:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    # One run directory: the entry point (the trainer writes <cfg.run_dir>/metrics.jsonl and
    # checkpoints to cfg.checkpoint.dir) gets the very paths of ctx.run_dir / ctx.metrics_path /
    # ctx.checkpoint_dir, absolute, whatever the config file says.
    cfg = absolute_paths(cfg, spec.cwd)
    if Path(cfg.run_dir) != run_dir:
        print(f"[megapkl.launch] the config's run_dir {cfg.run_dir} is not the launched run "
              f"directory {run_dir}; using {run_dir}", file=sys.stderr, flush=True)
        cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    ckpt_dir = Path(cfg.checkpoint.dir)
    ctx = runtime.LaunchContext(
        rank=layout["rank"], world_size=layout["world_size"], local_rank=layout["local_rank"],
        local_world_size=layout["local_world_size"], num_nodes=job_env.num_nodes,
        backend=layout["backend"], device=layout["device"], run_dir=run_dir,
        checkpoint_dir=ckpt_dir, metrics_path=run_dir / "metrics.jsonl", job_id=job_env.job_id,
        restart_count=restart, max_requeues=spec.max_requeues, threads=threads,
        entry_kwargs=dict(spec.entry_kwargs))
    if ctx.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _event(run_dir, event="start", job_id=ctx.job_id, restart=restart,
               host=job_env.hostname, world_size=ctx.world_size, backend=ctx.backend,
               threads=threads, master=layout["master"])
    runtime.install_preemption_handler(ctx, spec.preempt_grace_s)
    runtime._CURRENT = ctx
    fn = resolve_entry(spec.entry)
    try:
        if _takes_context(fn):
            result = fn(cfg, ctx, **spec.entry_kwargs)
        else:
            result = fn(cfg, **spec.entry_kwargs)
    except runtime.Requeued:
        if ctx.rank == 0:
            _event(run_dir, event="requeued", job_id=ctx.job_id, restart=restart)
        # No result: submitit keeps waiting for the requeued job. SystemExit is not an Exception,
        # so submitit's process_job writes nothing.
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(0)
    except BaseException as exc:
        if ctx.rank == 0:
            _event(run_dir, event="failed", job_id=ctx.job_id, restart=restart,
                   error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        raise
    finally:
        runtime._CURRENT = None
    if ctx._flag is not None:
        ctx._flag.acknowledged = True  # finished: a late signal must not requeue a completed run
    if ctx.rank == 0:
        tmp = run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, run_dir / "result.json")
        _event(run_dir, event="done", job_id=ctx.job_id, restart=restart)
    runtime.shutdown_distributed()
    return result
