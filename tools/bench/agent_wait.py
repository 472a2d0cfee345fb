"""Benchmark: the share of a search-agent update spent waiting on the retriever, on the embedded
engine.

The smoke run of a search-agent config (`megapkl smoke`'s plan: the tiny twin scripted to call the
search tool, a generated corpus and its BM25 index, which the run serves itself) is trained in
this process with the turn driver's environment rounds timed: on the embedded engine a round
decodes every trajectory's turn, then the engine waits while the round's searches run (the
retriever's answers, their passages formatted and tokenized: `TurnDriver.react`). Printed: the
update wall time (`time/update_s`), generation (`time/generate_s`) and the time waiting on those
rounds, as shares, beside the run's own `time/env_step_s` (the mean wall time of one search).

    python tools/bench/agent_wait.py                      # qwen3_8b_grpo_sis, 8 updates (2 batches)
    python tools/bench/agent_wait.py --steps 16 KEY=VALUE ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

CONFIG = "configs/experiments/sis_agent/qwen3_8b_grpo_sis.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    from megapkl.cli import main as megapkl
    from megapkl.launch.smoke import make_plan
    from megapkl.rollout import turns

    work = Path(args.dir or tempfile.mkdtemp(prefix="megapkl-bench-agent-"))
    plan = make_plan(args.config, ["rollout.engine=embedded", "eval.every=0", *args.overrides],
                     out_dir=str(work), steps=args.steps)
    rounds: list[float] = []
    react = turns.TurnDriver.react

    def timed(self, trajs):
        t0 = time.perf_counter()
        try:
            return react(self, trajs)
        finally:
            rounds.append(time.perf_counter() - t0)

    turns.TurnDriver.react = timed
    rc = megapkl(["train", args.config, *plan.overrides, "--if-exists", "overwrite"])
    if rc:
        raise SystemExit(f"megapkl train exited {rc}; see {plan.run_dir}")
    rows = [json.loads(x) for x in (plan.run_dir / "metrics.jsonl").read_text().splitlines() if x]
    wall = sum(r["time/update_s"] for r in rows)
    gen = sum(r["time/generate_s"] for r in rows)
    waited = sum(rounds)
    steps = [r["time/env_step_s"] for r in rows if r.get("time/generate_s")]
    calls = [r["tool/calls"] for r in rows if r.get("time/generate_s")]
    print(f"{args.config} on the embedded engine, {len(rows)} updates "
          f"({len(steps)} batches generated), {os.cpu_count()} CPUs")
    print(f"  update wall       {wall:8.2f} s")
    print(f"  generation        {gen:8.2f} s  {100 * gen / wall:5.1f}% of the update wall")
    print(f"  waiting on search {waited:8.3f} s  {100 * waited / wall:5.2f}% of the update wall, "
          f"{100 * waited / gen:5.2f}% of generation ({len(rounds)} rounds)")
    print(f"  time/env_step_s   {1000 * sum(steps) / len(steps):8.2f} ms (mean of one search's wall "
          f"time); tool/calls {sum(calls) / len(calls):.2f} per trajectory")


if __name__ == "__main__":
    main()
