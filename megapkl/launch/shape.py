"""The job shape a cluster profile gives a run config: the profile with the config's `slurm:` keys,
the shape recorded back into the config (so its world-size rules check the layout against the
real job), and the trainer's tasks per node beside dedicated SGLang GPUs. Read by `submit`,
`sweep` and `plan`, which sizes a run exactly as submit would launch it. No torch import.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

from megapkl.config.typed import ConfigError
from megapkl.launch.profile import ClusterProfile, load_profile
from megapkl.launch.runconfig import PreparedRun, prepare_run

# Run config `slurm:` keys -> profile keys (`extra` holds extra sbatch flags).
_SLURM_TO_PROFILE = {"nodes": "nodes", "gpus_per_node": "gpus_per_node",
                     "cpus_per_task": "cpus_per_task", "mem": "mem", "time": "time",
                     "partition": "partition", "account": "account", "qos": "qos",
                     "constraint": "constraint", "exclusive": "exclusive", "setup": "setup",
                     "extra": "sbatch", "tasks_per_node": "tasks_per_node"}
_NOT_JOB_KEYS = {"profile", "job_name"}


def job_profile(prep: PreparedRun, profile: Optional[str]) -> ClusterProfile:
    """The profile named on the command line (or by the config's slurm.profile), with the run
    config's explicit `slurm:` keys applied; errors name the file and key to fix."""
    name = profile or prep.cfg.slurm.profile
    if not name:
        raise ConfigError("no cluster profile: pass --profile NAME (slurm/profiles/NAME.yaml) or "
                          "set slurm.profile in the run config", key="slurm.profile",
                          source=prep.config_path)
    prof = load_profile(name)
    job: dict[str, Any] = {}
    for k, v in prep.slurm_explicit.items():
        if k in _NOT_JOB_KEYS or v is None:  # null: the profile's value
            continue
        if k not in _SLURM_TO_PROFILE:
            continue  # a key the config schema added later: it validated it already
        job[_SLURM_TO_PROFILE[k]] = v
    back = {v: k for k, v in _SLURM_TO_PROFILE.items()}
    return prof.with_job(job, source=prep.config_path, key_names=back) if job else prof


def shape_overrides(prep: PreparedRun, prof: ClusterProfile, profile_name: str) -> list[str]:
    """Record the job shape in the run config (so its world-size rules check the parallel layout
    against the real job): slurm.profile, the profile's constraint (GPU type: model.dtype bf16 is
    refused on GPUs without it), and nodes/gpus_per_node on GPU profiles unless set."""
    extra = []
    if "profile" not in prep.slurm_explicit:
        extra.append(f"slurm.profile={profile_name}")
    if prof.constraint and "constraint" not in prep.slurm_explicit:  # GPU type: dtype rules
        extra.append(f"slurm.constraint={prof.constraint}")
    if prof.uses_gpus:
        for key, value in (("nodes", prof.nodes), ("gpus_per_node", prof.job_gpus_per_node)):
            if key not in prep.slurm_explicit:
                extra.append(f"slurm.{key}={value}")
    return extra


def dedicated_tasks_per_node(cfg: Any) -> Optional[int]:
    """Trainer tasks per node when SGLang servers get GPUs of their own (`colocate: false`): the
    job asks for every GPU of its nodes but starts fewer tasks; the servers take the rest."""
    sg, world, nodes = cfg.rollout.sglang, cfg.world_size, cfg.slurm.nodes
    if cfg.rollout.engine != "sglang" or sg.colocate or sg.urls or world is None:
        return None
    return world // nodes if world % nodes == 0 else None


def settle_shape(config: str | os.PathLike, overrides: list[str], profile: Optional[str], *,
                 cwd: Path, tokenizes: bool = True) -> tuple[PreparedRun, ClusterProfile]:
    """The run config and its profile with the job shape the profile gives it (shape_overrides),
    and, with dedicated SGLang GPUs, as many tasks per node as the trainer has ranks there."""
    prep = prepare_run(config, overrides, cwd=cwd, tokenizes=tokenizes)
    prof = job_profile(prep, profile)
    name = profile or prep.cfg.slurm.profile
    extra = shape_overrides(prep, prof, name)
    if extra:
        prep = dataclasses.replace(prepare_run(config, overrides + extra, cwd=cwd,
                                               tokenizes=tokenizes),
                                   overrides=overrides)
    return prep, with_dedicated_tasks(prep, prof)


def with_dedicated_tasks(prep: PreparedRun, prof: ClusterProfile) -> ClusterProfile:
    """`prof` with as many tasks per node as the run's trainer has ranks there when its SGLang
    servers get GPUs of their own (unless the run config sets slurm.tasks_per_node)."""
    tasks = dedicated_tasks_per_node(prep.cfg) if prof.uses_gpus else None
    if tasks is None or "tasks_per_node" in prep.slurm_explicit:
        return prof
    return prof.with_job({"tasks_per_node": tasks}, source=prep.config_path,
                         key_names={"tasks_per_node": "tasks_per_node (trainer ranks per "
                                                      "node beside dedicated SGLang GPUs)"})
