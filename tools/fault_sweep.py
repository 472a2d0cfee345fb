#!/usr/bin/env python
"""Fault injection at every call site of update 2 of a DP=2 tiny run (tests/reliability/sweep.py).

    python tools/fault_sweep.py            # every traced site (about 15 s a site on 2 CPUs)
    python tools/fault_sweep.py --sample   # the CI sample (tests/reliability/test_fault_sweep.py)
    python tools/fault_sweep.py --limit 20 --only megapkl.train

Prints one row per site (target, rank, result, the last rank's exit seconds after the fault) as
it goes, then the totals: sites traced, skipped (by reason), tried, passing, not reached, worst
exit. `--out FILE` also appends each result there (a JSON line with the error line: a partial sweep's
results survive an interrupt).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", action="store_true", help="only the CI test's fixed sample")
    ap.add_argument("--limit", type=int, default=0, help="at most N sites (0: all)")
    ap.add_argument("--only", default="", help="only targets starting with this")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N sites")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (only 1 is supported)")
    ap.add_argument("--out", type=Path, help="append each row to this file too")
    args = ap.parse_args(argv)
    if args.jobs != 1:
        ap.error("--jobs: only 1 (each run is two ranks on the machine's cores)")

    import os
    import signal

    def interrupted(signum, frame):  # noqa: ARG001 - as KeyboardInterrupt: run_forked kills its ranks
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)
    os.chdir(ROOT)  # the config's paths are relative to the repository
    from megapkl.parallel.forked import run_forked, preload_megatron
    from tests.reliability import sweep
    from tests.reliability.test_fault_sweep import SAMPLE

    preload_megatron()
    with tempfile.TemporaryDirectory(prefix="fault_sweep_") as tmp:
        t0 = time.time()
        sites, skipped = sweep.trace(run_forked, Path(tmp) / "trace")
        traced = len(sites) + sum(map(len, skipped.values()))
        print(f"traced {traced} functions called in update {sweep.UPDATE} "
              f"({time.time() - t0:.0f} s); skipped {sum(map(len, skipped.values()))}: "
              + ", ".join(f"{why} {len(t)}" for why, t in sorted(skipped.items())), flush=True)
        if args.sample:
            sites = [s for s in sites if s.target in {t for t, _ in SAMPLE}]
        random.Random(0).shuffle(sites)  # a fixed order, so that a partial sweep is a fair sample
        sites = [s for s in sites if s.target.startswith(args.only)][args.skip:]
        sites = sites[: args.limit] if args.limit else sites
        results = []
        for i, site in enumerate(sites):
            r = sweep.try_site(run_forked, site, Path(tmp) / f"site{i}")
            results.append(r)
            row = (f"{site.target:<64} rank {site.rank} call {site.call:<4} "
                   f"{r.exit_s if r.exit_s is not None else '-':>6}  {r.outcome}"
                   + (f"  [{r.checkpoint}]" if r.checkpoint else ""))
            print(row, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({**dataclasses.asdict(r), "row": row}) + "\n")
        _totals(traced, skipped, results)
    return 0


def _totals(traced, skipped, results) -> None:
    passing = [r for r in results if r.outcome == "pass"]
    unreached = [r for r in results if r.outcome == "not reached"]
    failing = [r for r in results if r.outcome.startswith("fail")]
    exits = [r.exit_s for r in results if r.exit_s is not None]
    print(f"\nsites traced {traced}, skipped {sum(map(len, skipped.values()))}, tried "
          f"{len(results)}, passing {len(passing)}, not reached {len(unreached)}, failing "
          f"{len(failing)}; worst exit {max(exits, default=0):.1f} s after the fault", flush=True)
    named = sum(r.checkpoint.startswith("named") for r in passing)
    print(f"passing with a checkpoint written on the way out: {named}; with the newest earlier "
          f"checkpoint named as intact (a save that failed, or collective work: nothing newer "
          f"can be saved): {len(passing) - named}", flush=True)
    for r in failing:
        print(f"  FAIL {r.site.target} (rank {r.site.rank}): {r.outcome}; error: {r.error}")


if __name__ == "__main__":
    sys.exit(main())
