"""`megapkl sweep`: a grid of overrides -> one Slurm job array, with a parallelism limit.

    megapkl sweep configs/demo/cpu_demo.yaml --profile local_cpu \\
        --grid objective.name=proximal_kl,grpo,pg seed=1,2,3 --parallelism 4

Every element is validated before anything is submitted. Layout: the base config's run directory
becomes the sweep directory; element `i` runs as `<name>-<label>` in `<sweep_dir>/<label>/` (a normal
run directory, see `megapkl.launch.submit`), all elements share `<sweep_dir>/submitit/`, and
`<sweep_dir>/sweep.json` lists the grid, the elements and the array job id; `megapkl status`
prints one row per element (`megapkl.launch.jobs.sweep_table`).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from megapkl.config.typed import ConfigError
from megapkl.launch.job import DEFAULT_ENTRY, MegapklJob, check_entry_importable
from megapkl.launch.plan import check_fleet
from megapkl.launch.runconfig import prepare_run
from megapkl.launch.shape import job_profile, shape_overrides, with_dedicated_tasks
from megapkl.launch.submit import (IfExists, LaunchError, _now, _read_json, _write_json,
                                   check_container, check_mounts, make_executor, make_spec,
                                   prepare_run_dir, read_metrics, record_job, resume_overrides,
                                   sbatch_parameters, sbatch_script, write_run_files)

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class SweepElement:
    index: int
    label: str
    overrides: list[str]  # the grid's own overrides
    run_dir: Path
    job: Any = None


@dataclass
class SweepSubmission:
    sweep_dir: Path
    elements: list[SweepElement]
    array_job_id: Optional[str]
    script: Optional[str] = None

    @property
    def jobs(self) -> list[Any]:
        return [e.job for e in self.elements]


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """['objective.name=pkl,grpo', 'seed=1,2'] -> [('objective.name', ['pkl','grpo']), ...].
    Commas inside [] or {} do not split (`objective.is_clip=[0,5],[0,10]`)."""
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw:
            raise ConfigError(f"expected KEY=V1,V2,... (e.g. seed=1,2,3), got '{item}'",
                              source="--grid")
        if key in (k for k, _ in axes):
            raise ConfigError("appears twice in the grid", key=key, source="--grid")
        if key in ("name", "run_dir") or key.startswith("slurm."):
            raise ConfigError("cannot vary within one job array (every element shares the job "
                              "shape and the sweep names its runs)", key=key, source="--grid")
        axes.append((key, _split_top(raw)))
    return axes


def _split_top(raw: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in raw:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [v for v in out if v != ""]


def grid_elements(axes: Sequence[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Cartesian product -> [(label, overrides)], labels unique and file-name safe."""
    out = []
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        label = "_".join(f"{k.split('.')[-1]}-{_SAFE.sub('', v) or 'x'}" for k, v in combo)
        out.append((label or "base", [f"{k}={v}" for k, v in combo]))
    labels = [lab for lab, _ in out]
    if len(set(labels)) != len(labels):  # values that differ only in unsafe characters
        out = [(f"{i:03d}-{lab}", ov) for i, (lab, ov) in enumerate(out)]
    return out


def sweep(config: str | os.PathLike, profile: Optional[str], grid: Sequence[str],
          overrides: Iterable[str] = (), *, entry: str = DEFAULT_ENTRY,
          entry_kwargs: Optional[Mapping[str, Any]] = None, parallelism: Optional[int] = None,
          if_exists: IfExists = "error", dry_run: bool = False,
          cwd: Optional[str | os.PathLike] = None) -> SweepSubmission:
    cwd = Path(cwd or Path.cwd()).resolve()
    overrides = resume_overrides(list(overrides), if_exists)
    base = prepare_run(config, overrides, cwd=cwd)
    prof = job_profile(base, profile)
    if parallelism is not None:
        if parallelism < 1:
            raise ConfigError(f"must be >= 1, got {parallelism}", key="--parallelism",
                              source="command line")
        source, name = prof.source, prof.name
        prof = dataclasses.replace(prof, array_parallelism=parallelism)
        prof.source, prof.name = source, name
    check_entry_importable(entry)
    sweep_dir = base.run_dir
    elements = grid_elements(parse_grid(grid))
    preps = []
    for label, grid_ov in elements:  # validate every element before submitting any
        own = [*overrides, *grid_ov, f"name={base.name}-{label}", f"run_dir={sweep_dir / label}"]
        prep = prepare_run(config, own, cwd=cwd)
        extra = shape_overrides(prep, prof, profile or base.cfg.slurm.profile)
        if extra:
            prep = dataclasses.replace(prepare_run(config, own + extra, cwd=cwd), overrides=own)
        check_fleet(prep.cfg, prep.config_path)
        check_container(prep.cfg, prof, prep.config_path)  # what submit checks, per element
        check_mounts(prep, prof, cwd)
        preps.append(prep)
    prof = one_shape(preps, prof)
    folder = sweep_dir / "submitit"
    params = sbatch_parameters(prof, base.cfg.slurm.job_name or base.name, folder)
    out = SweepSubmission(sweep_dir, [SweepElement(i, lab, ov, p.run_dir) for i, ((lab, ov), p)
                                      in enumerate(zip(elements, preps))], None)
    if dry_run:
        out.script = sbatch_script(prof, folder, {**params, "map_count": len(elements)})
        return out
    if (sweep_dir / "sweep.json").exists() and if_exists == "error":
        raise LaunchError(f"sweep directory {sweep_dir} already holds a sweep; set another name "
                          "(name=...) or pass --if-exists resume|overwrite")
    prepare_run_dir(sweep_dir, "overwrite" if if_exists == "overwrite" else "resume")
    specs = []
    for el, prep in zip(out.elements, preps):
        prepare_run_dir(prep.run_dir, "resume")
        spec = make_spec(prep, prof, entry, entry_kwargs, cwd)
        write_run_files(prep, prof, params, spec, folder,
                        extra={"sweep_dir": str(sweep_dir), "sweep_label": el.label})
        specs.append(spec)
    executor = make_executor(prof, folder, params)
    with executor.batch():
        submitted = [executor.submit(MegapklJob(spec)) for spec in specs]
    for el, job in zip(out.elements, submitted):
        el.job = job
        record_job(el.run_dir, str(job.job_id))
    out.array_job_id = str(submitted[0].job_id).split("_")[0] if submitted else None
    _write_json(sweep_dir / "sweep.json", {
        "name": base.name, "config": os.path.abspath(str(config)), "overrides": overrides,
        "grid": list(grid), "profile": prof.name, "array_parallelism": prof.array_parallelism,
        "entry": entry, "array_job_id": out.array_job_id, "submitted": _now(),
        "submitit_folder": str(folder),
        "elements": [{"index": e.index, "label": e.label, "overrides": e.overrides,
                      "run_dir": str(e.run_dir), "job_id": str(e.job.job_id)}
                     for e in out.elements]})
    return out


def one_shape(preps: Sequence[Any], prof: Any) -> Any:
    """The array's profile: its elements share one job shape, with as many tasks per node as
    their trainers have ranks there when the SGLang servers get GPUs of their own."""
    shaped = [with_dedicated_tasks(p, prof) for p in preps]
    tasks = sorted({s.job_tasks_per_node for s in shaped})
    if len(tasks) > 1:
        raise ConfigError(f"the grid's elements need different tasks per node ({tasks}: SGLang "
                          "servers on GPUs of their own in some elements, or different trainer "
                          "sizes), and the elements of one array job share one shape: sweep "
                          "them separately", key="--grid", source="command line")
    return shaped[0] if shaped else prof


def read_sweep(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(sweep_dir) / "sweep.json"
    if not path.exists():
        raise LaunchError(f"{sweep_dir} is not a sweep directory (no sweep.json)")
    return json.loads(path.read_text(encoding="utf-8"))
