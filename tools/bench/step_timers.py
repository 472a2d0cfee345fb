"""Benchmark: how much of each update's wall time the trainer's timers account for.

The trainer times the work of an update where it happens (`time/export_s`, `time/sync_s`,
`time/generate_s`, `time/reward_s`, `time/reference_s`, `time/train_s`, `time/eval_s`,
`time/checkpoint_s`, `time/log_s`) and logs the wall time between two rows (`time/update_s`).
This prints, per update and in total, their sum against the wall time; the goal is a sum within
5% of the wall time (what the timers miss is bookkeeping between them).

    python tools/bench/step_timers.py                      # the CPU demo, 60 updates, one rank
    python tools/bench/step_timers.py --steps 300 KEY=VALUE ...
    python tools/bench/step_timers.py --run RUN_DIR        # an existing run's metrics.jsonl
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

TIMERS = ("export", "sync", "generate", "reward", "reference", "train", "eval", "checkpoint",
          "log")


def report(run_dir: Path) -> dict:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    rows = rows[1:]  # the first update also pays for warming up (imports, first allocations)
    parts = {t: sum(r[f"time/{t}_s"] for r in rows) for t in TIMERS}
    timed, wall = sum(parts.values()), sum(r["time/update_s"] for r in rows)
    worst = min(sum(r[f"time/{t}_s"] for t in TIMERS) / r["time/update_s"] for r in rows)
    print(f"{len(rows)} updates (the first left out): timers {timed:.2f} s of {wall:.2f} s wall "
          f"= {100 * timed / wall:.1f}% (worst update {100 * worst:.1f}%)")
    print("  " + ", ".join(f"{t} {v:.2f} s" for t, v in parts.items() if v > 0))
    return {"updates": len(rows), "timed_s": timed, "wall_s": wall, "ratio": timed / wall,
            "worst_ratio": worst, "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="an existing run directory instead of a new run")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    if args.run is None:
        from megapkl.config import load_config
        from megapkl.train.local import train_local

        args.run = Path(tempfile.mkdtemp(prefix="step_timers_")) / "run"
        cfg = load_config("configs/demo/cpu_demo.yaml", [
            f"train.steps={args.steps}", "parallel.data=1", "logging.progress_bar=false",
            f"run_dir={args.run}", *args.overrides])
        train_local(cfg)
    report(args.run)


if __name__ == "__main__":
    main()
