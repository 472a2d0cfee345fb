"""`megapkl status | cancel | logs JOB`, where JOB is a Slurm job id (`1234`, `1234_5` for an array
element), a run directory (its latest job) or a sweep directory (its array). No torch import.

Job id -> run directory goes through the index that `submit`/`sweep` append to
($MEGAPKL_JOB_INDEX, default ~/.cache/megapkl/jobs.jsonl), falling back to `scontrol show job`.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from megapkl.errors import MegapklError
from megapkl.launch.submit import _read_json, job_index_path, read_metrics

_JOB_ID = re.compile(r"^\d+(_\d+)?$")
SACCT_FIELDS = ("JobID", "JobName", "State", "Elapsed", "ExitCode", "NodeList")
SUMMARY_METRICS = ("loss", "reward/mean", "train/accuracy", "kl/prox_k3", "x")


class JobLookupError(MegapklError, RuntimeError):
    pass


@dataclass
class JobRef:
    job_id: Optional[str]  # None: a sweep, see sweep_dir
    run_dir: Optional[Path]
    submitit_folder: Optional[Path]
    sweep_dir: Optional[Path] = None


def resolve(job: str) -> JobRef:
    """A job id, run directory or sweep directory -> what we know about it."""
    p = Path(job)
    if p.is_dir():
        if (p / "sweep.json").exists():
            info = json.loads((p / "sweep.json").read_text(encoding="utf-8"))
            return JobRef(info.get("array_job_id"), None, Path(info["submitit_folder"]),
                          sweep_dir=p.resolve())
        if (p / "launch.json").exists():
            info = json.loads((p / "launch.json").read_text(encoding="utf-8"))
            jobs = info.get("jobs") or []
            if not jobs:
                raise JobLookupError(f"{p}: no job was submitted from this run directory")
            folder = info.get("submitit_folder")
            return JobRef(str(jobs[-1]["job_id"]), p.resolve(), Path(folder) if folder else None)
        raise JobLookupError(f"{p} is neither a run directory (launch.json) nor a sweep "
                             "directory (sweep.json)")
    if not _JOB_ID.match(job):
        raise JobLookupError(f"'{job}' is not a job id (1234 or 1234_5) nor a directory")
    run_dir = _index_lookup(job)
    if run_dir is not None and (run_dir / "launch.json").exists():
        info = json.loads((run_dir / "launch.json").read_text(encoding="utf-8"))
        folder = info.get("submitit_folder")
        return JobRef(job, run_dir, Path(folder) if folder else _scontrol_folder(job))
    return JobRef(job, None, _scontrol_folder(job))


def _index_lookup(job_id: str) -> Optional[Path]:
    path = job_index_path()
    if not path.exists():
        return None
    found = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if str(row.get("job_id")) == job_id:
            found = Path(row["run_dir"])
    return found


def _scontrol_folder(job_id: str) -> Optional[Path]:
    try:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"StdOut=(\S+)", out)
    return Path(m.group(1)).parent if m else None


# ---- sacct

def sacct_states(job_ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """{job id: {field: value}} for jobs and array elements (allocation lines only)."""
    ids = sorted({str(j).split("_")[0] for j in job_ids if j})
    if not ids:
        return {}
    try:
        proc = subprocess.run(["sacct", "-X", "-P", "-n", "-j", ",".join(ids),
                               "-o", ",".join(SACCT_FIELDS)], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JobLookupError(f"sacct failed: {exc}") from None
    if proc.returncode != 0:
        raise JobLookupError(f"sacct failed: {proc.stderr.strip()}")
    out: dict[str, dict[str, str]] = {}
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS):
            continue
        row = dict(zip(SACCT_FIELDS, parts))
        out[row["JobID"]] = row
    return out


def requeue_count(job_id: str) -> int:
    """How often the job was requeued (sacct --duplicates keeps one REQUEUED row per requeue)."""
    proc = subprocess.run(["sacct", "-D", "-X", "-P", "-n", "-j", job_id, "-o", "JobID,State"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise JobLookupError(f"sacct failed: {proc.stderr.strip()}")
    return sum(1 for ln in proc.stdout.splitlines()
               if ln.split("|")[0] == job_id and ln.split("|")[-1].startswith("REQUEUED"))


def status(job: str) -> str:
    """A few lines: Slurm state(s), and for a run directory the last step's metrics."""
    ref = resolve(job)
    if ref.sweep_dir is not None:
        return f"sweep {ref.sweep_dir} (array {ref.job_id})\n{sweep_table(ref.sweep_dir)}"
    states = sacct_states([ref.job_id] if ref.job_id else [])
    rows = [r for jid, r in states.items() if jid == ref.job_id or jid.startswith(f"{ref.job_id}_")]
    lines = []
    for r in rows or [{"JobID": ref.job_id, "State": "unknown to sacct"}]:
        lines.append("  ".join(f"{k}={r.get(k, '')}" for k in SACCT_FIELDS if r.get(k)))
    if ref.run_dir is not None:
        lines.append(f"run_dir={ref.run_dir}")
        metrics = read_metrics(ref.run_dir)
        if metrics:
            last = metrics[-1]
            lines.append("last step: " + "  ".join(f"{k}={_fmt(v)}" for k, v in last.items()))
        events = ref.run_dir / "events.jsonl"
        if events.exists():
            tail = events.read_text(encoding="utf-8").splitlines()[-1:]
            lines += [f"last event: {t}" for t in tail]
    return "\n".join(lines)


def cancel(job: str) -> str:
    ref = resolve(job)
    if not ref.job_id:
        raise JobLookupError(f"{job}: no job id to cancel")
    subprocess.run(["scancel", ref.job_id], check=True, timeout=60)
    return ref.job_id


def log_path(job: str, task: int = 0, stderr: bool = False) -> Path:
    ref = resolve(job)
    if ref.submitit_folder is None or not ref.job_id:
        raise JobLookupError(f"{job}: cannot find its submitit folder (not submitted by megapkl on "
                             "this machine, and unknown to scontrol)")
    if ref.sweep_dir is not None:
        raise JobLookupError(f"{job} is a sweep: pass one element's run directory or job id "
                             f"({ref.job_id}_N)")
    suffix = "err" if stderr else "out"
    path = ref.submitit_folder / f"{ref.job_id}_{task}_log.{suffix}"
    if not path.exists():
        raise JobLookupError(f"no log yet at {path} (is the job still pending?)")
    return path


def logs(job: str, task: int = 0, stderr: bool = False, tail: Optional[int] = None) -> str:
    text = log_path(job, task, stderr).read_text(encoding="utf-8", errors="replace")
    if tail:
        text = "\n".join(text.splitlines()[-tail:]) + "\n"
    return text


def _fmt(v: Any) -> str:
    return f"{v:.5g}" if isinstance(v, float) else str(v)


def queue(user: Optional[str] = None) -> str:
    cmd = ["squeue", "-o", "%.12i %.24j %.10T %.10M %.6D %R"]
    cmd += ["-u", user or os.environ.get("USER", "root")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout


# ---- a sweep's summary: one row per element

def sweep_rows(sweep_dir: str | os.PathLike) -> list[dict[str, Any]]:
    info = _read_json(Path(sweep_dir) / "sweep.json")
    ids = [e["job_id"] for e in info["elements"]]
    states = sacct_states(ids)
    rows = []
    for e in info["elements"]:
        st = states.get(e["job_id"], {})
        metrics = read_metrics(e["run_dir"])
        last = metrics[-1] if metrics else {}
        row = {"label": e["label"], "job": e["job_id"], "state": st.get("State", "?"),
               "elapsed": st.get("Elapsed", ""), "step": last.get("step", "")}
        for k in SUMMARY_METRICS:
            if k in last:
                row[k] = last[k]
        rows.append(row)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "(no elements)"
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def sweep_table(sweep_dir: str | os.PathLike) -> str:
    return format_table(sweep_rows(sweep_dir))
