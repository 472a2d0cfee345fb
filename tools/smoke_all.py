"""`megapkl smoke` on every run config of configs/experiments/ (fragments `_*.yaml` are not runs),
each in a subprocess of its own, then a table of config / engine / result / seconds and totals.

    python tools/smoke_all.py [--out runs/smoke_all] [--steps 4] [KEY=VALUE ...]
    python tools/smoke_all.py --sample          # one config per paper folder, and every engine
    python tools/smoke_all.py --list --sample   # what would run
    python tools/smoke_all.py --folder sis_agent rollout.engine=embedded   # one paper folder

`--sample`: per paper folder one config (the one with routing replay where the folder has it,
else one with SIS, else the first), smoked on its configured engine; a multi-turn pick (the
search agent's) is smoked on every other engine too, each engine generating turns its own way;
an engine no sampled config uses is added by smoking the first sampled config again with
`rollout.engine=ENGINE`. KEY=VALUE
overrides apply to every config. Exit 1 when any smoke failed; each one's full output is in
OUT/<folder>__<config>[__<engine>].out.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "configs" / "experiments"
ENGINES = ("embedded", "sglang")


class Job(NamedTuple):
    path: Path
    engine: str  # the engine the smoke runs on
    override: tuple  # () or ("rollout.engine=...",)

    @property
    def label(self) -> str:
        return str(self.path.relative_to(EXPERIMENTS))

    @property
    def slug(self) -> str:
        tail = f"__{self.engine}" if self.override else ""
        return f"{self.path.parent.name}__{self.path.stem}{tail}"


def run_configs() -> list[Path]:
    return sorted(p for p in EXPERIMENTS.rglob("*.yaml") if not p.name.startswith("_"))


def configured(path: Path, overrides: list[str]):
    from megapkl.config import load_config

    return load_config(path, overrides)


def sample(paths: list[Path], overrides: list[str]) -> list[Job]:
    """One config per paper folder (routing replay, then SIS preferred), a multi-turn one on
    every engine, then each missing engine."""
    jobs, seen = [], set()
    for folder in sorted({p.parent for p in paths}):
        mine = [p for p in paths if p.parent == folder]
        cfgs = {p: configured(p, overrides) for p in mine}
        pick = min(mine, key=lambda p: (not cfgs[p].model.routing_replay,
                                        not cfgs[p].objective.sis.enabled, p.name))
        engine = cfgs[pick].rollout.engine
        jobs.append(Job(pick, engine, ()))
        seen.add(engine)
        if cfgs[pick].env.multi_turn:
            jobs += [Job(pick, e, (f"rollout.engine={e}",)) for e in ENGINES if e != engine]
    for engine in ENGINES:
        if engine not in seen:
            jobs.append(Job(jobs[0].path, engine, (f"rollout.engine={engine}",)))
    return jobs


def every(paths: list[Path], overrides: list[str]) -> list[Job]:
    return [Job(p, configured(p, overrides).rollout.engine, ()) for p in paths]


def smoke_one(job: Job, out: Path, steps: int, overrides: list[str]) -> tuple[bool, float, str]:
    """(ok, seconds, one line: the failed stage's, or the stages' times)."""
    log = out / f"{job.slug}.out"
    cmd = [sys.executable, "-m", "megapkl.cli", "smoke", str(job.path), "--out",
           str(out / job.slug), "--steps", str(steps), *overrides, *job.override]
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    seconds = time.monotonic() - start
    lines = log.read_text(errors="replace").splitlines()
    failed = [ln.strip() for ln in lines if " FAILED " in ln]
    errors = [ln.strip() for ln in lines if ln.startswith("megapkl: error:")]
    if rc == 0:
        return True, seconds, ""
    return False, seconds, (failed or errors or lines[-1:] or ["(no output)"])[0][:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", action="store_true", help="one config per paper and engine")
    ap.add_argument("--list", action="store_true", help="print the configs and stop")
    ap.add_argument("--out", default=str(REPO / "runs" / "smoke_all"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--folder", action="append", metavar="NAME",
                    help="only the configs of this folder of configs/experiments/ (repeatable)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_intermixed_args(argv)
    paths = [p for p in run_configs() if not args.folder or p.parent.name in args.folder]
    if not paths:
        ap.error(f"--folder {' '.join(args.folder)}: no run config there (folders: "
                 f"{', '.join(sorted({p.parent.name for p in run_configs()}))})")
    jobs = (sample if args.sample else every)(paths, args.overrides)
    if args.list:
        print("\n".join(f"{j.label} [{j.engine}]" for j in jobs))
        return 0
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    width = max(len(j.label) for j in jobs) + 2
    print(f"{'config':{width}s} {'engine':9s} {'result':7s} {'seconds':>8s}", flush=True)
    results = []
    for job in jobs:
        ok, seconds, line = smoke_one(job, out, args.steps, args.overrides)
        results.append((ok, seconds))
        print(f"{job.label:{width}s} {job.engine:9s} {'ok' if ok else 'FAILED':7s} "
              f"{seconds:8.1f}" + (f"  {line}" if line else ""), flush=True)
    bad = sum(not ok for ok, _ in results)
    total = sum(s for _, s in results)
    print(f"{len(results) - bad} of {len(results)} passed, {bad} failed, {total:.0f} s in all "
          f"(outputs: {out})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
