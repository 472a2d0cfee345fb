"""`megapkl submit`: a run config + a cluster profile -> a submitit job on Slurm.

    from megapkl.launch import submit
    sub = submit("configs/demo/cpu_demo.yaml", "local_cpu", ["seed=3"],
                 entry="megapkl.launch.toy:run")
    sub.job.results()          # one value per task

Run directory (`cfg.run_dir`, default runs/<name>/, made absolute against the submit directory):

    <run_dir>/config.yaml      the fully resolved run config the job reloads, run_dir and
                               checkpoint.dir absolute (the trainer rewrites it: the same, with
                               checkpoint.resume: true after a requeue)
    <run_dir>/launch.json      profile (resolved), sbatch parameters, entry point, overrides, job ids
    <run_dir>/submitit/        submitit's pickles and logs: <jobid>_<task>_log.out / _log.err
    <run_dir>/checkpoints/     cfg.checkpoint.dir unless the config moves it (the trainer's
                               step_<u>/ directories)
    <run_dir>/metrics.jsonl    one JSON line per step, rank 0: the trainer's MetricsLogger
                               (megapkl.train.metrics_log; steps from 0, truncated to the checkpoint
                               on resume) or `ctx.log_metrics` (after a resume a step may repeat:
                               the last line of a step wins, see `read_metrics`)
    <run_dir>/events.jsonl     start / requeued / failed / done, one line each (rank 0)
    <run_dir>/result.json      the entry point's return value (rank 0)

A sweep (`megapkl.launch.sweep`) puts one such directory per element under <run_dir>/<label>/ and
shares one submitit folder, <run_dir>/submitit/. No torch import here.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence

from megapkl.errors import MegapklError
from megapkl.config.local_files import job_paths
from megapkl.config.typed import ConfigError
from megapkl.launch.job import DEFAULT_ENTRY, LaunchSpec, MegapklJob, check_entry_importable
from megapkl.launch.profile import ClusterProfile, load_profile
from megapkl.launch.runconfig import PreparedRun, config_error, prepare_run

IfExists = Literal["error", "resume", "overwrite"]
# Run config `slurm:` keys -> profile keys (`extra` holds extra sbatch flags).
_SLURM_TO_PROFILE = {"nodes": "nodes", "gpus_per_node": "gpus_per_node",
                     "cpus_per_task": "cpus_per_task", "mem": "mem", "time": "time",
                     "partition": "partition", "account": "account", "qos": "qos",
                     "constraint": "constraint", "exclusive": "exclusive", "setup": "setup",
                     "extra": "sbatch", "tasks_per_node": "tasks_per_node"}
_NOT_JOB_KEYS = {"profile", "job_name"}


class LaunchError(MegapklError, RuntimeError):
    """A launcher problem that is not a config error (existing run dir, no Slurm, ...)."""


@dataclass
class Submission:
    job: Any  # submitit.Job (None for a dry run)
    run_dir: Path
    profile: ClusterProfile
    sbatch_params: dict[str, Any]
    spec: LaunchSpec
    script: Optional[str] = None  # the sbatch script (dry run)
    run_dir_action: str = ""  # what the submit does (or, dry, would do) with the run directory

    @property
    def job_id(self) -> Optional[str]:
        return None if self.job is None else str(self.job.job_id)


# ---- profile + run config -> job shape

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


def sbatch_parameters(prof: ClusterProfile, job_name: str,
                      folder: Optional[Path] = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (native names) for a job on `prof`; with the submitit
    `folder`, the batch script requeues the job from the host when a task asks for it
    (runtime.host_requeue_lines: tasks in a container have no Slurm client), and srun ends every
    task when one exits with an error (a rank the preemption watchdog stops, a crashed rank)."""
    p: dict[str, Any] = {
        "job_name": job_name,
        "partition": prof.partition,
        "time": prof.timeout_min,
        "nodes": prof.nodes,
        "ntasks_per_node": prof.job_tasks_per_node,
        "cpus_per_task": prof.cpus_per_task,
        "signal_delay_s": prof.signal_delay_s,
        "array_parallelism": prof.array_parallelism,
        "stderr_to_stdout": False,
    }
    if prof.job_gpus_per_node:
        p["gpus_per_node"] = prof.job_gpus_per_node
    for key in ("account", "qos", "constraint", "mem"):
        value = getattr(prof, key)
        if value is not None:
            p[key] = value
    if prof.exclusive:
        p["exclusive"] = True
    # sbatch hands the job the submitting shell's environment: a rendezvous port meant for that
    # shell (a torchrun, an interactive job) would make every job meet on one port, and
    # torchrun's run id would make the tasks read torchrun's variables; the job picks its own
    # port (runtime.rendezvous_port) unless the profile's env sets one.
    setup = ["unset MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID"]
    setup += [f"export {k}={shlex.quote(str(v))}" for k, v in prof.env.items()] + list(prof.setup)
    srun_args = list(prof.srun_args)
    if folder is not None:
        from megapkl.launch.runtime import host_requeue_lines

        requeue_setup, p["teardown"] = host_requeue_lines(folder)
        setup += requeue_setup
        srun_args.insert(0, "--kill-on-bad-exit=1")
    if setup:
        p["setup"] = setup
    c = prof.container
    if c is not None and c.runtime == "pyxis":
        srun_args.append(f"--container-image={c.image}")
        if c.mounts:
            srun_args.append(f"--container-mounts={','.join(c.mounts)}")
        if c.workdir:
            srun_args.append(f"--container-workdir={c.workdir}")
        srun_args += c.extra_args
    if srun_args:
        p["srun_args"] = srun_args
    if prof.sbatch:
        p["additional_parameters"] = {str(k).lstrip("-"): v for k, v in prof.sbatch.items()}
    return p


def python_command(prof: ClusterProfile) -> str:
    """How each task starts python (submitit runs `<python> -u -m submitit.core._submit`)."""
    c = prof.container
    if c is None:
        return prof.python or shlex.quote(sys.executable)
    if c.runtime == "pyxis":
        return c.python
    binds = "".join(f" --bind {shlex.quote(m)}" for m in c.mounts)
    gpu = " --nv" if prof.uses_gpus else ""
    pwd = f" --pwd {shlex.quote(c.workdir)}" if c.workdir else ""
    extra = "".join(f" {shlex.quote(a)}" for a in c.extra_args)
    return f"apptainer exec{gpu}{binds}{pwd}{extra} {shlex.quote(c.image)} {c.python}"


def make_executor(prof: ClusterProfile, folder: Path, params: Mapping[str, Any]) -> Any:
    """A submitit.AutoExecutor on the Slurm cluster with the profile's parameters."""
    import submitit

    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise LaunchError("Slurm is not available here (no sbatch/srun on PATH); run on a login "
                          "node, or start the local cluster: tools/slurm/setup_local_cluster.sh")
    ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm",
                               slurm_python=python_command(prof),
                               slurm_max_num_timeout=prof.max_requeues)
    ex.update_parameters(**{f"slurm_{k}": v for k, v in params.items()})
    return ex


def sbatch_script(prof: ClusterProfile, folder: Path, params: Mapping[str, Any]) -> str:
    """The sbatch script submitit would write (for --dry-run); needs no Slurm."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = f"{python_command(prof)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=str(folder), **params)


# ---- run directory

def claim_run_dir(prep: PreparedRun, if_exists: IfExists, *, dry_run: bool = False) -> str:
    """What this submit does with the run directory, by `megapkl train`'s rule
    (megapkl.train.local.run_dir_action: a directory of `megapkl train` holds a run as much as one
    of `submit`), in words for the dry run: LaunchError when it holds a run and --if-exists is
    'error' (a dry run too: it says what the real submit will do); 'overwrite' deletes the run
    directory and checkpoint.dir unless `dry_run`."""
    from megapkl.train.local import refusal, run_dir_action

    action, held = run_dir_action(prep.cfg, if_exists)
    if action == "refuse":
        launch = prep.run_dir / "launch.json"
        jobs = _read_json(launch).get("jobs", []) if launch.is_file() else []
        last = f" (last job {jobs[-1]['job_id']})" if jobs else ""
        raise LaunchError(refusal(prep.cfg, held + last))
    if action == "overwrite" and not dry_run:
        shutil.rmtree(prep.cfg.checkpoint.dir, ignore_errors=True)
        shutil.rmtree(prep.run_dir, ignore_errors=True)
    if not dry_run:
        prep.run_dir.mkdir(parents=True, exist_ok=True)
    return {"new": "a new run in an empty run directory",
            "resume": f"continues the run it holds ({held}) from its latest checkpoint",
            "overwrite": f"deletes the run it holds ({held}) and starts a new one"}[action]


def prepare_run_dir(run_dir: Path, if_exists: IfExists) -> None:
    """A sweep's directory or element (`megapkl sweep`): refused ('error') when it holds a
    submitted run, kept ('resume') or deleted first ('overwrite')."""
    launch = run_dir / "launch.json"
    if launch.exists():
        if if_exists == "error":
            jobs = _read_json(launch).get("jobs", [])
            last = f" (last job {jobs[-1]['job_id']})" if jobs else ""
            raise LaunchError(f"run directory {run_dir} already holds a run{last}; set another "
                              "name (name=...), or pass --if-exists resume (continue from its "
                              "checkpoints) or --if-exists overwrite (delete it)")
        if if_exists == "overwrite":
            shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def write_run_files(prep: PreparedRun, prof: ClusterProfile, params: Mapping[str, Any],
                    spec: LaunchSpec, submitit_folder: Path, extra: Mapping[str, Any] = ()) -> None:
    run_dir = prep.run_dir
    (run_dir / "config.yaml").write_text(prep.resolved_yaml, encoding="utf-8")
    launch = _read_json(run_dir / "launch.json") if (run_dir / "launch.json").exists() else {}
    launch.update({
        "name": prep.name,
        "config": os.path.abspath(prep.config_path),
        "overrides": prep.overrides,
        "profile": {"name": prof.name, "file": prof.source, **prof.to_dict()},
        "sbatch": dict(params),
        "python": python_command(prof),
        "entry": spec.entry,
        "entry_kwargs": spec.entry_kwargs,
        "submitit_folder": str(submitit_folder),
        "cwd": spec.cwd,
        "argv": sys.argv,
        **dict(extra),
    })
    launch.setdefault("jobs", [])
    _write_json(run_dir / "launch.json", launch)


def record_job(run_dir: Path, job_id: str, **info: Any) -> None:
    launch = _read_json(run_dir / "launch.json")
    launch.setdefault("jobs", []).append({"job_id": job_id, "submitted": _now(), **info})
    _write_json(run_dir / "launch.json", launch)
    index = job_index_path()
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        with open(index, "a", encoding="utf-8") as f:
            f.write(json.dumps({"job_id": job_id, "run_dir": str(run_dir), "time": _now()}) + "\n")
    except OSError:
        pass  # the index is a convenience for `megapkl logs JOBID`


def job_index_path() -> Path:
    env = os.environ.get("MEGAPKL_JOB_INDEX")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megapkl" / "jobs.jsonl"


# ---- submit

def make_spec(prep: PreparedRun, prof: ClusterProfile, entry: str,
              entry_kwargs: Optional[Mapping[str, Any]], cwd: Path) -> LaunchSpec:
    from megapkl.launch.retriever import to_env

    return LaunchSpec(run_dir=str(prep.run_dir), cwd=str(cwd),
                      config_file=str(prep.run_dir / "config.yaml"), entry=entry,
                      entry_kwargs=dict(entry_kwargs or {}), use_gpus=prof.uses_gpus,
                      max_requeues=prof.max_requeues, preempt_grace_s=float(prof.preempt_grace_s),
                      env=to_env(prof.retriever))


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


def check_container(cfg: Any, prof: ClusterProfile, source: str) -> None:
    """Dedicated SGLang servers on several nodes are started with `srun --overlap` from inside a
    task, which a container image (no Slurm client) cannot do: refuse before submitting."""
    sg = cfg.rollout.sglang
    if (prof.container is not None and cfg.rollout.engine == "sglang" and not sg.colocate
            and not sg.urls and prof.nodes > 1):
        raise ConfigError(f"false starts the SGLang servers on other nodes with srun from inside "
                          f"a task, and the tasks of profile {prof.name} run in a container "
                          "without the Slurm client: use colocate true, one node, or a profile "
                          "without a container", key="rollout.sglang.colocate", source=source)


def container_paths(prof: ClusterProfile) -> list[Path]:
    """Where the container's mounts ('host[:container[:flags]]') appear inside it: the only
    host paths a task sees (megapkl mounts nothing by itself)."""
    out = []
    for m in prof.container.mounts if prof.container is not None else ():
        host, _, rest = m.partition(":")
        out.append(Path(rest.partition(":")[0] or host))
    return out


def check_mounts(prep: PreparedRun, prof: ClusterProfile, cwd: Path) -> None:
    """Every path the job reads or writes, and the submit directory every task starts in, must
    be under one of the container's mounts: the host checks of `config validate` passed, but a
    task in the image sees nothing else. Relative paths are taken from the submit directory."""
    if prof.container is None:
        return
    inside = container_paths(prof)
    seen = f"profile {prof.name} runs the job in a container that sees only its mounts " \
           f"({', '.join(prof.container.mounts) or 'none'}, {prof.source})"

    def visible(path: str) -> bool:
        full = Path(os.path.normpath(cwd / Path(path).expanduser()))
        return any(full == m or m in full.parents for m in inside)

    if not visible(str(cwd)):
        raise LaunchError(f"the submit directory {cwd} is not visible to the job: {seen}; submit "
                          "from under one of them or add a mount to the profile")
    for key, path in job_paths(prep.cfg):
        if not visible(path):
            raise config_error(prep, f"'{path}' is not visible to the job: {seen}; move it under "
                                     "one of them or add a mount to the profile", key)


def check_fit(cfg: Any, prof: ClusterProfile) -> None:
    """LaunchError with the planner's table when the run cannot fit the profile's GPUs."""
    if not prof.uses_gpus:
        return
    from megapkl.launch.plan import plan

    p = plan(cfg, prof)
    if not p.fits:
        raise LaunchError(f"the run does not fit {prof.name}'s GPUs (megapkl plan); change the "
                          f"layout or pass --force:\n{p.table()}")


def resume_overrides(overrides: list[str], if_exists: IfExists) -> list[str]:
    """`--if-exists resume` continues from the run directory's checkpoints."""
    if if_exists == "resume" and not any(o.startswith("checkpoint.resume=") for o in overrides):
        return [*overrides, "checkpoint.resume=true"]
    return overrides


def submit(config: str | os.PathLike, profile: Optional[str] = None,
           overrides: Iterable[str] = (), *, entry: str = DEFAULT_ENTRY,
           entry_kwargs: Optional[Mapping[str, Any]] = None, if_exists: IfExists = "error",
           dry_run: bool = False, cwd: Optional[str | os.PathLike] = None,
           force: bool = False) -> Submission:
    """Validate, lay out the run directory and submit one job (see the module docstring).
    A run that `megapkl plan` says cannot fit its GPUs is refused unless `force`."""
    cwd = Path(cwd or Path.cwd()).resolve()
    overrides = resume_overrides(list(overrides), if_exists)
    prep, prof = settle_shape(config, overrides, profile, cwd=cwd)
    check_entry_importable(entry)
    from megapkl.launch.plan import check_fleet

    check_fleet(prep.cfg, prep.config_path)  # the servers must fit the job, --force or not
    check_container(prep.cfg, prof, prep.config_path)
    check_mounts(prep, prof, cwd)
    if not force:
        check_fit(prep.cfg, prof)
    spec = make_spec(prep, prof, entry, entry_kwargs, cwd)
    folder = prep.run_dir / "submitit"
    params = sbatch_parameters(prof, prep.cfg.slurm.job_name or prep.name, folder)
    action = claim_run_dir(prep, if_exists, dry_run=dry_run)  # the same rule, dry or not
    if dry_run:
        return Submission(None, prep.run_dir, prof, params, spec,
                          sbatch_script(prof, folder, params), action)
    write_run_files(prep, prof, params, spec, folder)
    executor = make_executor(prof, folder, params)
    job = executor.submit(MegapklJob(spec))
    record_job(prep.run_dir, str(job.job_id))
    return Submission(job, prep.run_dir, prof, params, spec, run_dir_action=action)


# ---- reading a run directory

def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """metrics.jsonl as a list ordered by step; a step logged twice (after a resume) keeps its
    last line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            rows[int(row.get("step", len(rows)))] = row
    return [rows[k] for k in sorted(rows)]


def read_launch(run_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(run_dir) / "launch.json"
    if not path.exists():
        raise LaunchError(f"{run_dir} is not a megapkl run directory (no launch.json)")
    return _read_json(path)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def parse_entry_args(items: Sequence[str]) -> dict[str, Any]:
    """`k=v` strings -> kwargs for the entry point, values parsed as YAML."""
    from megapkl.config import yamlio

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"expected NAME=VALUE for the entry point, got '{item}'",
                              source="--entry-arg")
        out[key] = yamlio.load_value(raw)
    return out
