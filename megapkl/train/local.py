"""Run the trainer on this machine: in-process for one rank, forked gloo ranks for more.

Under torchrun or Slurm (WORLD_SIZE set, or torch.distributed already up) every rank simply calls
`megapkl.train.loop.run`; `megapkl submit` covers Slurm.
"""
from __future__ import annotations

import os
from typing import Any

WEEK_S = 7 * 24 * 3600.0


def world_size(cfg) -> int:
    p = cfg.parallel
    data = p.data if isinstance(p.data, int) else 1
    return p.tensor * p.pipeline * p.context * data


def _rank_main(rank: int, world: int, cfg) -> Any:
    from megapkl.train.loop import run

    return run(cfg)


def train_local(cfg) -> list[dict]:
    """Train `cfg`; returns every rank's last metrics (rank order)."""
    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()):
        from megapkl.train.loop import run

        return [run(cfg)]
    world = world_size(cfg)
    if world == 1:
        return [_rank_main(0, 1, cfg)]
    from megapkl.parallel.forked import preload_megatron, run_forked
    from megapkl.train.stopping import forward_to_children

    forward_to_children()  # Ctrl-C / SIGTERM: the ranks checkpoint and stop, this waits for them
    preload_megatron()   # imported once, inherited by the forked ranks

    threads = max(1, (os.cpu_count() or 1) // world)
    # install_compat=False: each rank installs megatron's CPU layer itself, in init_groups
    return run_forked(_rank_main, world, cfg, timeout=WEEK_S, threads=threads, install_compat=False)
