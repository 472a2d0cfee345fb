"""`python -m megapkl.launch.task CONFIG [KEY=VALUE ...]`: one task of a launch without submitit.

Run it under `srun` (one task per GPU; slurm/sbatch_template.sh) or under `torchrun` (one srun task
per node). It does what the submitit job does: threads from SLURM_CPUS_PER_TASK, torch.distributed
from the environment (NCCL on GPUs, gloo on CPU), the run directory (<run_dir>/config.yaml,
launch.json, metrics.jsonl, events.jsonl, result.json), the entry point `fn(cfg, ctx)`, and the
cooperative preemption protocol: on SIGUSR2 (`#SBATCH --signal=USR2@300`) the entry point
checkpoints at its next step boundary and the job requeues itself (`#SBATCH --requeue`); the
requeued job resumes from the checkpoint. Under torchrun, Slurm signals every process of the
step, workers included; torchrun must ignore the signal (the template starts it with USR2 ignored),
as its default action would kill it and its workers before they checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megapkl.launch import runtime


def _rank() -> int:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return int(os.environ.get("RANK", "0"))
    return int(os.environ.get("SLURM_PROCID", "0"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    runtime.install_early_handler()
    if os.environ.get("SLURM_JOB_ID"):
        os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # submitit's Slurm job environment
    from megapkl.launch.job import DEFAULT_ENTRY, LaunchSpec, run_task
    from megapkl.launch.runconfig import prepare_run
    from megapkl.launch.submit import parse_entry_args

    ap = argparse.ArgumentParser(prog="python -m megapkl.launch.task",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="run config YAML")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ap.add_argument("--entry", default=DEFAULT_ENTRY, help="entry point module:function")
    ap.add_argument("--entry-arg", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--max-requeues", type=int, default=10)
    ap.add_argument("--preempt-grace-s", type=float, default=60.0,
                    help="seconds after SIGUSR2 before a forced requeue (keep below --signal's)")
    ap.add_argument("--gpus", choices=("auto", "yes", "no"), default="auto",
                    help="NCCL on GPUs or gloo on CPU (auto: GPUs when Slurm gave the node some)")
    args = ap.parse_intermixed_args(argv)

    prep = prepare_run(args.config, args.overrides)
    cwd = Path.cwd().resolve()
    if _rank() == 0:
        prep.run_dir.mkdir(parents=True, exist_ok=True)
        (prep.run_dir / "checkpoints").mkdir(exist_ok=True)
        tmp = prep.run_dir / "config.yaml.tmp"
        tmp.write_text(prep.resolved_yaml, encoding="utf-8")
        os.replace(tmp, prep.run_dir / "config.yaml")
        _record_launch(prep, args)
    if args.gpus == "auto":
        gpus = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0) > 0
    else:
        gpus = args.gpus == "yes"
    spec = LaunchSpec(run_dir=str(prep.run_dir), cwd=str(cwd),
                      config_file=str(prep.run_dir / "config.yaml"), entry=args.entry,
                      entry_kwargs=parse_entry_args(args.entry_arg), use_gpus=gpus,
                      max_requeues=args.max_requeues, preempt_grace_s=args.preempt_grace_s)
    run_task(spec, cfg=prep.cfg)
    return 0


def _record_launch(prep, args: argparse.Namespace) -> None:
    path = prep.run_dir / "launch.json"
    info = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    job_id = os.environ.get("SLURM_JOB_ID", "")
    jobs = info.get("jobs", [])
    if job_id and all(j.get("job_id") != job_id for j in jobs):
        jobs.append({"job_id": job_id, "launcher": "sbatch"})
    info.update({"name": prep.name, "config": os.path.abspath(prep.config_path),
                 "overrides": prep.overrides, "entry": args.entry, "launcher": "sbatch",
                 "submitit_folder": None, "jobs": jobs, "argv": sys.argv})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
