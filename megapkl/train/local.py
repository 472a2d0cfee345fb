"""Run the trainer on this machine: in-process for one rank; for more, one process per GPU started
the way torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT in
the environment: NCCL, each rank on cuda:LOCAL_RANK), or forked gloo ranks on a machine without
GPUs.

Under torchrun or Slurm (WORLD_SIZE set, or torch.distributed already up) every rank simply calls
`megapkl.train.loop.run`; `megapkl submit` covers Slurm.
"""
from __future__ import annotations

import os
from typing import Any, Callable

WEEK_S = 7 * 24 * 3600.0


def world_size(cfg) -> int:
    p = cfg.parallel
    data = p.data if isinstance(p.data, int) else 1
    return p.tensor * p.pipeline * p.context * data


# What a run leaves in its directory: any of these means the directory holds a run.
RUN_RECORDS = ("metrics.jsonl", "config.yaml", "launch.json", "events.jsonl", "result.json")


def held_run(cfg) -> str:
    """What `cfg.run_dir` (and checkpoint.dir) already hold of a run, in words; '' when nothing."""
    from pathlib import Path

    run, ckpt = Path(cfg.run_dir), Path(cfg.checkpoint.dir)
    found = [name for name in RUN_RECORDS if (run / name).is_file()]
    steps = sorted(p.name for p in ckpt.glob("step_*")) if ckpt.is_dir() else []
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {ckpt}, the latest {steps[-1]}")
    return ", ".join(found)


def run_dir_action(cfg, if_exists: str = "error") -> tuple[str, str]:
    """What starting `cfg` does with a run directory that may hold a run, the rule of both
    `megapkl train` and `megapkl submit`: (action, what it holds in words). 'new' (it holds no
    run), 'refuse' (it does and --if-exists is 'error' with checkpoint.resume unset), 'resume'
    (--if-exists resume, or checkpoint.resume set in the config: continue from its checkpoint),
    'overwrite' (delete the run directory and checkpoint.dir, then start)."""
    held = held_run(cfg)
    if not held:
        return "new", ""
    if if_exists == "overwrite":
        return "overwrite", held
    if if_exists == "resume" or cfg.checkpoint.resume is not False:
        return "resume", held
    return "refuse", held


def refusal(cfg, held: str) -> str:
    return (f"run directory {cfg.run_dir} already holds a run ({held}); pass --if-exists resume "
            "(continue from its latest checkpoint) or --if-exists overwrite (delete it) or set "
            "checkpoint.resume, or another name (name=...)")


def claim_run_dir(cfg, if_exists: str = "error"):
    """`megapkl train` into a directory that may hold a run, by `run_dir_action`: refused with one
    line naming the directory and what it holds, resumed (checkpoint.resume: true unless the
    config names one) or deleted first. Returns the config to train."""
    import dataclasses
    import shutil

    action, held = run_dir_action(cfg, if_exists)
    if action == "refuse":
        from megapkl.errors import MegapklError

        raise MegapklError(refusal(cfg, held))
    if action == "overwrite":
        shutil.rmtree(cfg.checkpoint.dir, ignore_errors=True)
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    elif action == "resume" and cfg.checkpoint.resume is False:
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    return cfg


def _rank_main(rank: int, world: int, cfg) -> Any:
    from megapkl.train.loop import run

    return run(cfg)


def train_local(cfg) -> list[dict]:
    """Train `cfg`; returns every rank's last metrics (rank order)."""
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()):
        from megapkl.train.loop import run

        return [run(cfg)]
    world = world_size(cfg)
    if world == 1:
        return [_rank_main(0, 1, cfg)]
    from megapkl.train.stopping import forward_to_children

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if world > gpus:
            raise RuntimeError(f"parallel: {world} ranks (data x tensor x pipeline x context) but "
                               f"this machine has {gpus} GPUs")
        forward_to_children()
        return run_ranks(_rank_main, world, cfg)
    from megapkl.parallel.forked import preload_megatron, run_forked

    forward_to_children()  # Ctrl-C / SIGTERM: the ranks checkpoint and stop, this waits for them
    preload_megatron()   # imported once, inherited by the forked ranks

    threads = max(1, (os.cpu_count() or 1) // world)
    # install_compat=False: each rank installs megatron's CPU layer itself, in init_groups
    return run_forked(_rank_main, world, cfg, timeout=WEEK_S, threads=threads, install_compat=False)


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun exports to rank `rank` of `world` on one machine."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _spawned(fn: Callable, rank: int, world: int, port: int, args: tuple, results: Any) -> None:
    """A started rank: the torchrun environment, then `fn(rank, world, *args)`; the outcome goes
    back on `results` (the value, or the formatted error)."""
    import traceback

    os.environ.update(rank_environment(rank, world, port))
    try:
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` in `world` fresh processes (spawned, not forked: a process that
    touched CUDA cannot fork), each with torchrun's environment; the values in rank order. The
    first rank to fail ends the others and its traceback is raised."""
    import multiprocessing as mp
    import queue

    from megapkl.parallel.forked import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(fn, r, world, port, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {procs.index(dead[0])} exited with code "
                                       f"{dead[0].exitcode} before reporting") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(out) == world else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]
