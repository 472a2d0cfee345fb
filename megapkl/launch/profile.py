"""Cluster profiles: what a Slurm partition offers and how megapkl submits to it.

A profile is a YAML file under `slurm/profiles/` (or any path), validated strictly into
`ClusterProfile`: an unknown key gets a did-you-mean, a wrong type or range names the key, and
rules across keys (more GPUs per node than the nodes have, GPUs that do not split evenly over tasks,
more cores than a node has) name the file, the line and the key to fix.

    prof = load_profile("h100")                  # slurm/profiles/h100.yaml
    prof = load_profile("path/to/mine.yaml")
    job = prof.with_job({"nodes": 4, "time": "1-00:00:00"}, source="configs/x.yaml")

Hardware keys (`node_gpus`, `node_cpus`, `max_nodes`) describe the partition's nodes; job keys
(`nodes`, `gpus_per_node`, `tasks_per_node`, `cpus_per_task`, `mem`, `time`, ...) are the defaults of
a job, which a run config's `slurm:` section may override (`with_job`). No torch import here.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from megapkl.config import yamlio
from megapkl.config.typed import ConfigError, build, rng, to_dict
from megapkl.launch.retriever import RetrieverPlacement

# sbatch --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# sbatch flags the launcher sets itself from typed keys; `sbatch:` may not set them behind its back.
_MANAGED_SBATCH = {
    "partition": "partition", "p": "partition", "account": "account", "A": "account",
    "qos": "qos", "q": "qos", "nodes": "nodes", "N": "nodes", "ntasks-per-node": "tasks_per_node",
    "ntasks_per_node": "tasks_per_node", "gpus-per-node": "gpus_per_node",
    "gpus_per_node": "gpus_per_node", "gres": "gpus_per_node", "cpus-per-task": "cpus_per_task",
    "cpus_per_task": "cpus_per_task", "c": "cpus_per_task", "mem": "mem", "time": "time",
    "t": "time", "constraint": "constraint", "C": "constraint", "exclusive": "exclusive",
    "signal": "signal_delay_s", "array": "array_parallelism (megapkl sweep builds the array)",
    "output": "(submitit names the log files)", "error": "(submitit names the log files)",
    "job-name": "the run config's name / slurm.job_name", "job_name": "the run config's name",
    "J": "the run config's name",
}


@dataclass
class ContainerConfig:
    """Run every task inside a container image.

    pyxis (enroot, `srun --container-image`): `image` is e.g. 'nvcr.io#nvidia/pytorch:25.01-py3' or
    a .sqsh file. apptainer: `image` is a .sif file and the task's python runs under
    `apptainer exec --nv`. `mounts` are 'host:container' pairs; the repository must be visible
    inside at the same path (mount it) so that the job can import megapkl.
    """

    image: str = ""
    runtime: Literal["pyxis", "apptainer"] = "pyxis"
    mounts: list[str] = field(default_factory=list)
    workdir: Optional[str] = None
    python: str = "python3"  # the interpreter inside the image
    extra_args: list[str] = field(default_factory=list)

    def check(self, err) -> None:
        if not self.image:
            err("a container needs an image (pyxis: 'registry#image:tag' or a .sqsh file; "
                "apptainer: a .sif file)", "image")
        for i, m in enumerate(self.mounts):
            if not m or m.startswith(":"):
                err(f"expected 'host_path[:container_path[:flags]]', got '{m}'", f"mounts[{i}]")


@dataclass
class ClusterProfile:
    """One Slurm partition and the defaults of a job on it. See slurm/profiles/*.yaml."""

    description: str = ""
    # -- where
    partition: Optional[str] = None  # required
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None  # e.g. 'h100' or 'h200&ib'
    # -- the partition's nodes (hardware)
    node_gpus: int = field(default=0, metadata=rng(0))  # GPUs in one node; 0 = CPU nodes
    node_cpus: Optional[int] = field(default=None, metadata=rng(1))  # cores in one node
    max_nodes: Optional[int] = field(default=None, metadata=rng(1))  # largest job allowed
    # For `megapkl plan`: memory of one GPU (GiB, as the driver reports it) and its dense BF16
    # peak (TFLOP/s). Unset: the planner reports the estimate without a fit verdict.
    gpu_mem_gib: Optional[float] = field(default=None, metadata=rng(0.0, lo_open=True))
    gpu_tflops: Optional[float] = field(default=None, metadata=rng(0.0, lo_open=True))
    # For `megapkl plan`'s generation time: SGLang decode throughput of one GPU, summed over all
    # the requests it serves at once (tokens/s). Unset on a GPU profile: the planner's default
    # (megapkl.launch.plan.DEFAULT_DECODE_TOKENS_PER_S). Set it from a measurement of your own.
    gpu_decode_tokens_per_s: Optional[float] = field(default=None,
                                                     metadata=rng(0.0, lo_open=True))
    # -- the job (defaults; a run config's slurm: section overrides them)
    nodes: int = field(default=1, metadata=rng(1))
    gpus_per_node: Optional[int] = field(default=None, metadata=rng(0))  # unset: node_gpus
    tasks_per_node: Optional[int] = field(default=None, metadata=rng(1))  # unset: 1 per GPU
    cpus_per_task: int = field(default=1, metadata=rng(1))
    mem: Optional[str] = None  # per node: '0' = all of it, '64G', '500000M'
    time: str = "01:00:00"
    exclusive: bool = False
    # -- the environment of each task
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load, venv)
    env: dict[str, str] = field(default_factory=dict)  # exported before srun
    container: Optional[ContainerConfig] = None
    # the search agent's retriever (env.search.index) as its own step: node, GPUs, cores, memory
    # (megapkl/launch/retriever.py); unset: it runs beside rank 0
    retriever: Optional[RetrieverPlacement] = None
    python: Optional[str] = None  # python on the nodes; unset: the submitting interpreter
    srun_args: list[str] = field(default_factory=list)
    sbatch: dict[str, Any] = field(default_factory=dict)  # extra sbatch flags, name without '--'
    # -- preemption, time limits, arrays
    signal_delay_s: int = field(default=120, metadata=rng(10))  # USR2 this long before the kill
    preempt_grace_s: int = field(default=60, metadata=rng(1))  # wait for a step boundary this long
    max_requeues: int = field(default=10, metadata=rng(0))
    array_parallelism: int = field(default=8, metadata=rng(1))  # sweep elements running at once

    def check(self, err) -> None:
        if not self.partition:
            err("required: the Slurm partition to submit to (`sinfo -s` lists them)", "partition")
        if not _TIME.match(self.time):
            err(f"expected a Slurm time such as '04:00:00' or '1-12:00:00', got '{self.time}'",
                "time")
        if self.mem is not None and not _MEM.match(self.mem):
            err(f"expected a Slurm memory size such as '0' (all), '64G' or '500000M', got "
                f"'{self.mem}'", "mem")
        if self.max_nodes is not None and self.nodes > self.max_nodes:
            err(f"asks for {self.nodes} nodes but this partition allows at most max_nodes="
                f"{self.max_nodes}", "nodes", "max_nodes")
        gpus = self.job_gpus_per_node
        if gpus > self.node_gpus:
            err(f"asks for {gpus} GPUs per node but the nodes of this profile have node_gpus="
                f"{self.node_gpus}", "gpus_per_node", "node_gpus")
        tasks = self.job_tasks_per_node
        if gpus and tasks > gpus:
            err(f"{tasks} tasks per node but only {gpus} GPUs per node: every task needs its own "
                "GPU", "tasks_per_node", "gpus_per_node")
        if gpus and gpus % tasks:
            err(f"{gpus} GPUs per node do not split evenly over {tasks} tasks per node",
                "tasks_per_node", "gpus_per_node")
        if self.node_cpus is not None and tasks * self.cpus_per_task > self.node_cpus:
            err(f"tasks_per_node x cpus_per_task = {tasks} x {self.cpus_per_task} = "
                f"{tasks * self.cpus_per_task} cores, but the nodes of this profile have node_cpus="
                f"{self.node_cpus}", "cpus_per_task", "tasks_per_node", "node_cpus")
        if self.preempt_grace_s >= self.signal_delay_s:
            err(f"must be < signal_delay_s ({self.signal_delay_s}): the step boundary must come "
                "before Slurm kills the job", "preempt_grace_s", "signal_delay_s")
        for name in self.env:
            if not _ENV_NAME.match(name):
                err(f"'{name}' is not an environment variable name", f"env.{name}")
        for name in self.sbatch:
            flag = str(name).lstrip("-")
            if flag in _MANAGED_SBATCH:
                err(f"the sbatch flag '{flag}' is set by the launcher; use the profile key "
                    f"{_MANAGED_SBATCH[flag]}", f"sbatch.{name}")
        if self.container is not None and self.python is not None:
            err("set the interpreter inside the image with container.python", "python",
                "container.python")

    # ---- derived job shape
    @property
    def job_gpus_per_node(self) -> int:
        return self.node_gpus if self.gpus_per_node is None else self.gpus_per_node

    @property
    def job_tasks_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return max(self.job_gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.job_tasks_per_node

    @property
    def timeout_min(self) -> int:
        return time_to_minutes(self.time)

    @property
    def uses_gpus(self) -> bool:
        return self.job_gpus_per_node > 0

    # ---- provenance: plain class attributes (not fields), set per instance by load_profile
    source = "<dict>"
    name = ""

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def with_job(self, job: Mapping[str, Any], *, source: str, key_prefix: str = "slurm.",
                 key_names: Optional[Mapping[str, str]] = None) -> "ClusterProfile":
        """This profile with job keys replaced (a run config's explicit `slurm:` keys).

        Errors about a replaced key name `source` and `key_prefix + key` (`key_names` maps a
        profile key to the caller's name for it, e.g. sbatch -> extra), and say what the profile
        allows (e.g. `slurm.gpus_per_node: asks for 16 GPUs per node but ... node_gpus=8`)."""
        names = dict(key_names or {})

        def theirs(key: str) -> str:
            head, dot, rest = key.partition(".")
            return key_prefix + names.get(head, head) + dot + rest

        data = self.to_dict()
        for k, v in job.items():
            if k not in JOB_KEYS:
                raise ConfigError(f"cannot be set per run (a profile key of the cluster); the job "
                                  f"keys are {', '.join(sorted(JOB_KEYS))}", key=theirs(k),
                                  source=source)
            data[k] = v
        try:
            out = build(ClusterProfile, data, source=source)
        except ConfigError as exc:
            keys = [exc.key, *exc.related]
            mine = [k for k in keys if k.split(".")[0] in job]
            if not mine:
                raise
            where = f"the profile {self.name or self.source}"
            raise ConfigError(f"{exc.detail} ({where} is {self.source})", key=theirs(mine[0]),
                              source=source, related=tuple(theirs(k) for k in mine[1:])
                              ) from None
        out.source, out.name = self.source, self.name
        return out


# Keys of a profile that a run config's `slurm:` section may set for its own job.
JOB_KEYS = frozenset({"partition", "account", "qos", "constraint", "nodes", "gpus_per_node",
                      "tasks_per_node", "cpus_per_task", "mem", "time", "exclusive", "setup",
                      "sbatch"})


def time_to_minutes(text: str) -> int:
    """Slurm time string -> minutes (rounded up); '90' -> 90, '1-00:00:00' -> 1440."""
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(p) for p in text.split(":")]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, minutes, seconds = 0, parts[0], parts[1]
        else:
            hours, minutes, seconds = parts
    total_s = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return max(1, -(-total_s // 60))


def profiles_dir() -> Path:
    """$MEGAPKL_PROFILES, else the repository's slurm/profiles/."""
    env = os.environ.get("MEGAPKL_PROFILES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "slurm" / "profiles"


def list_profiles() -> list[str]:
    d = profiles_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def resolve_profile_path(name_or_path: str | os.PathLike) -> Path:
    """A path to a YAML file as given, else slurm/profiles/<name>.yaml."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or os.sep in str(name_or_path):
        if not p.is_file():
            raise ConfigError("no such profile file", source=str(p))
        return p
    cand = profiles_dir() / f"{name_or_path}.yaml"
    if not cand.is_file():
        known = list_profiles()
        from megapkl.config.typed import suggest
        raise ConfigError(f"unknown cluster profile '{name_or_path}'{suggest(str(name_or_path), known)}"
                          f" (known: {', '.join(known) or 'none'}; or give a path to a YAML file)",
                          source=str(profiles_dir()))
    return cand


def load_profile(name_or_path: str | os.PathLike) -> ClusterProfile:
    path = resolve_profile_path(name_or_path)
    return loads_profile(path.read_text(encoding="utf-8"), source=_display(path),
                         name=path.stem)


def loads_profile(text: str, *, source: str = "<string>", name: str = "") -> ClusterProfile:
    """Validate a profile from YAML text; errors name `source`, the line and the key."""
    data, lines = yamlio.parse_mapping(text, source, "a profile is a mapping of keys")
    try:
        prof = build(ClusterProfile, data, source=source)
    except ConfigError as exc:
        line = _line_of(lines, exc.key)
        raise ConfigError(exc.detail, key=exc.key, source=source, line=line,
                          related=exc.related) from None
    prof.source, prof.name = source, name or Path(source).stem
    return prof


def _line_of(lines: Mapping[str, int], key: str) -> Optional[int]:
    while key:
        if key in lines:
            return lines[key]
        cut = max(key.rfind("."), key.rfind("["))
        if cut <= 0:
            return None
        key = key[:cut]
    return None


def _display(path: Path) -> str:
    try:
        rel = os.path.relpath(path.resolve())
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel
