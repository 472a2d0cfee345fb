"""The CPU demo: a tiny Qwen3-shaped model learns `next_mod10` with Proximal KL under periodic
refresh (configs/demo/cpu_demo.yaml), on the embedded engine, DP = 2 over gloo.

`--compare` runs Proximal KL, GRPO and PG over several seeds through `megapkl compare` and reports
each method's numbers with confidence intervals (one seed is noise, never a ranking). `--lookup`
runs the multi-turn demo instead (configs/demo/cpu_lookup.yaml): the model learns to call a tool
whose answer the prompt does not hold (docs/agents.md).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Sequence

from megapkl.train.metrics_log import read_metrics
from megapkl.analysis.plot import ema, plot_runs

COMPARE_METHODS = ("proximal_kl", "grpo", "pg")


def accuracy_summary(run_dir: Path, alpha: float = 0.2, key: str = "train/accuracy"
                     ) -> tuple[float, float, int]:
    """(mean of `key` over the first 5 updates, its EMA at the end, updates)."""
    acc = [r[key] for r in read_metrics(run_dir)]
    smooth = ema(acc, alpha)
    return sum(acc[:5]) / min(5, len(acc)), smooth[-1], len(acc)


def run_demo(config_path: str, overrides: Sequence[str], compare: bool, seeds: int = 3,
             name: str = "cpu_demo_proximal_kl") -> list[Path]:
    if compare:
        return run_demo_compare(config_path, overrides, seeds)
    from megapkl.config import load_config
    from megapkl.train.local import train_local

    cfg = load_config(config_path, [*overrides, f"name={name}"])
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a demo starts from scratch every time
    t0 = time.time()
    train_local(cfg)
    run, label = Path(cfg.run_dir), cfg.objective.name
    start, end, n = accuracy_summary(run)
    print(f"{label}: {n} updates in {time.time() - t0:.0f} s; training accuracy "
          f"{start:.3f} (first 5 updates) -> {end:.3f} (EMA 0.2, last update); run dir {run}")
    if cfg.env.multi_turn:
        first, last, _ = accuracy_summary(run, key="tool/call_rate")
        print(f"trajectories calling the tool: {first:.3f} (first 5 updates) -> {last:.3f}")
    out = run.parent / f"{run.name}_plots"
    files = plot_runs([run], out, alpha=0.2, labels=[label])
    print(f"plots: {out} ({len(files)} files)")
    return [run]


def run_demo_compare(config_path: str, overrides: Sequence[str], seeds: int) -> list[Path]:
    from megapkl.config import load_config
    from megapkl.analysis.compare import compare, headline

    base = load_config(config_path, list(overrides)).seed
    t0 = time.time()
    summary, report = compare(config_path, COMPARE_METHODS, list(range(base, base + seeds)),
                              overrides, out=Path("runs") / "cpu_demo_compare")
    print(f"{len(COMPARE_METHODS)} methods x {seeds} seeds in {time.time() - t0:.0f} s")
    print("\n".join(headline(summary)))
    print(f"report with intervals and curves: {report}")
    return [report.parent]
