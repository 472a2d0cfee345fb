"""The launcher's subcommands for the `megapkl` CLI: submit, sweep, status, cancel, logs.

megapkl/cli.py registers them with `add_subcommands(sub)` (sub = its add_subparsers()); each
handler takes the argparse namespace and returns the exit code. Config errors are raised as
megapkl.config.ConfigError (the main CLI prints them as one line, exit 2); launcher errors print
here and return 1. Imports are lazy (no torch, no submitit until a command runs).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megapkl.config.overrides_cli import _IntermixedParser, add_overrides  # noqa: F401

EXIT_LAUNCH = 1


def _entry_help() -> str:
    return ("entry point 'module:function' called as fn(cfg, ctx) in every task (default "
            "megapkl.train:run; megapkl.launch.toy:run exercises the launch path)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run config YAML")
    add_overrides(p)
    p.add_argument("-p", "--profile", help="cluster profile: a name under slurm/profiles/ or a "
                   "YAML path (default: the config's slurm.profile)")
    p.add_argument("--entry", default=None, help=_entry_help())
    p.add_argument("--entry-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="keyword argument for the entry point (repeatable)")
    p.add_argument("--if-exists", choices=("error", "resume", "overwrite"), default="error",
                   help="when the run directory already holds a run (default: error)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print the sbatch script; submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the job(s) and print results")
    p.add_argument("--force", action="store_true",
                   help="submit even when `megapkl plan` says the run does not fit its GPUs")


def add_subcommands(sub: Any) -> None:
    """Register submit, sweep, status, cancel and logs on an argparse subparsers object."""
    p = sub.add_parser("submit", help="submit a run to Slurm (submitit) with a cluster profile")
    _add_common(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("sweep", help="submit a grid of runs as one Slurm job array")
    _add_common(p)
    p.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2",
                   help="one axis per item, e.g. --grid objective.name=proximal_kl,grpo,pg "
                   "seed=1,2,3 (put plain overrides before --grid)")
    p.add_argument("--parallelism", type=int, default=None,
                   help="array elements running at once (default: the profile's "
                   "array_parallelism)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("plan", help="per-GPU memory, FLOPs and step time of a run on a profile")
    p.add_argument("config", help="run config YAML")
    add_overrides(p)
    p.add_argument("-p", "--profile", help="cluster profile (default: the config's slurm.profile)")
    p.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation for the step "
                   "time (default 0.35)")
    p.add_argument("--response-len", type=int, default=None, help="mean response length for "
                   "the generation time (default: rollout.max_response_len, an upper bound)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("status", help="state of a job, run directory or sweep (no JOB: squeue)")
    p.add_argument("job", nargs="?", help="job id, run directory or sweep directory")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel a job, a run directory's job or a sweep's array")
    p.add_argument("job", help="job id, run directory or sweep directory")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("logs", help="print a task's submitit log")
    p.add_argument("job", help="job id or run directory")
    p.add_argument("--task", type=int, default=0, help="task (rank) whose log to print")
    p.add_argument("--err", action="store_true", help="stderr instead of stdout")
    p.add_argument("-n", "--tail", type=int, default=None, help="only the last N lines")
    p.set_defaults(func=cmd_logs)


def _fail(exc: BaseException) -> int:
    print(f"megapkl: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return EXIT_LAUNCH


def _entry_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from megapkl.launch.submit import parse_entry_args
    return parse_entry_args(args.entry_arg)


def _entry(args: argparse.Namespace) -> str:
    from megapkl.launch.job import DEFAULT_ENTRY
    return args.entry or DEFAULT_ENTRY


def cmd_submit(args: argparse.Namespace) -> int:
    from megapkl.config import ConfigError
    from megapkl.launch.submit import LaunchError, submit
    try:
        sub = submit(args.config, args.profile, args.overrides, entry=_entry(args),
                     entry_kwargs=_entry_kwargs(args), if_exists=args.if_exists,
                     dry_run=args.dry_run, force=args.force)
    except ConfigError:
        raise
    except (LaunchError, ValueError, OSError) as exc:
        return _fail(exc)
    if args.dry_run:
        print(f"# run_dir: {sub.run_dir}\n# submitted, this job: {sub.run_dir_action}\n"
              f"# profile: {sub.profile.name} ({sub.profile.source})")
        print(sub.script)
        return 0
    print(f"submitted job {sub.job_id}: run_dir {sub.run_dir}")
    print(f"  megapkl status {sub.job_id}   megapkl logs {sub.job_id}   "
          f"megapkl cancel {sub.job_id}")
    if args.wait:
        return _wait([sub.job])
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the planner's table; exit 1 when the run does not fit the profile's GPUs."""
    from megapkl.launch.plan import DEFAULT_MFU, plan_config
    p = plan_config(args.config, args.profile, args.overrides, mfu=args.mfu or DEFAULT_MFU,
                    response_len=args.response_len)
    print(p.table())
    return 0 if p.fits else EXIT_LAUNCH


def cmd_sweep(args: argparse.Namespace) -> int:
    from megapkl.config import ConfigError
    from megapkl.launch.submit import LaunchError
    from megapkl.launch.sweep import format_table, sweep, sweep_rows
    try:
        out = sweep(args.config, args.profile, args.grid, args.overrides, entry=_entry(args),
                    entry_kwargs=_entry_kwargs(args), parallelism=args.parallelism,
                    if_exists=args.if_exists, dry_run=args.dry_run)
    except ConfigError:
        raise
    except (LaunchError, ValueError, OSError) as exc:
        return _fail(exc)
    if args.dry_run:
        print(f"# sweep_dir: {out.sweep_dir}")
        for e in out.elements:
            print(f"# [{e.index}] {e.label}: {' '.join(e.overrides)} -> {e.run_dir}")
        print(out.script)
        return 0
    print(f"submitted array {out.array_job_id} ({len(out.elements)} elements): {out.sweep_dir}")
    rc = _wait(out.jobs, quiet=True) if args.wait else 0
    print(format_table(sweep_rows(out.sweep_dir)))
    return rc


def _wait(jobs: list[Any], quiet: bool = False) -> int:
    rc = 0
    for job in jobs:
        try:
            results = job.results()
            if not quiet:
                print(json.dumps(results[0], indent=1, default=str)[:4000])
        except Exception as exc:  # noqa: BLE001 - submitit's FailedJobError and friends
            print(f"job {job.job_id} failed:\n{exc}", file=sys.stderr)
            rc = EXIT_LAUNCH
    return rc


def cmd_status(args: argparse.Namespace) -> int:
    from megapkl.launch import jobs
    try:
        print(jobs.status(args.job) if args.job else jobs.queue(), end="\n")
    except (jobs.JobLookupError, OSError) as exc:
        return _fail(exc)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    import subprocess

    from megapkl.launch import jobs
    try:
        print(f"cancelled {jobs.cancel(args.job)}")
    except (jobs.JobLookupError, OSError, subprocess.CalledProcessError) as exc:
        return _fail(exc)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from megapkl.launch import jobs
    try:
        sys.stdout.write(jobs.logs(args.job, args.task, args.err, args.tail))
    except (jobs.JobLookupError, OSError) as exc:
        return _fail(exc)
    return 0


def main(argv: Any = None) -> int:
    """Standalone: `python -m megapkl.launch.cli submit ...` (same as `megapkl submit ...`)."""
    parser = argparse.ArgumentParser(prog="megapkl")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommands(sub)
    args = parser.parse_args(argv)
    from megapkl.config import ConfigError
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"megapkl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
