"""Slurm launch with submitit: cluster profiles, `megapkl submit|sweep|status|cancel|logs`,
torch.distributed from the Slurm environment, preemption -> checkpoint -> requeue -> resume.

    from megapkl.launch import submit, sweep, load_profile
    sub = submit("configs/demo/cpu_demo.yaml", "local_cpu")   # the trainer, megapkl.train:run
    print(sub.job.results()[0])                                 # rank 0's last update's metrics

The entry point contract (what the trainer implements; `megapkl.launch.toy:run` is a cheap stand-in
for launcher tests) is in `megapkl.launch.runtime`: `run(cfg, ctx) -> metrics`, with
`ctx.preempt_requested()` polled at step boundaries and `ctx.requeue()` after a checkpoint.
Importing this package imports neither torch nor submitit.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ClusterProfile": "megapkl.launch.profile", "load_profile": "megapkl.launch.profile",
    "loads_profile": "megapkl.launch.profile", "list_profiles": "megapkl.launch.profile",
    "profiles_dir": "megapkl.launch.profile",
    "submit": "megapkl.launch.submit", "Submission": "megapkl.launch.submit",
    "LaunchError": "megapkl.launch.submit", "read_metrics": "megapkl.launch.submit",
    "sweep": "megapkl.launch.sweep", "sweep_table": "megapkl.launch.jobs",
    "LaunchContext": "megapkl.launch.runtime", "current_context": "megapkl.launch.runtime",
    "add_subcommands": "megapkl.launch.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megapkl.launch' has no attribute '{name}'")
