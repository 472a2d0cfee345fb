"""The CPU demo: a tiny Qwen3-shaped model learns `add_mod10` with Proximal KL under periodic
refresh (configs/demo/cpu_demo.yaml), on the embedded engine, DP = 2 over gloo.

`--compare` trains Proximal KL, GRPO and PG with the same seed and plots their curves together.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Sequence

from megapkl.train.metrics_log import read_metrics
from megapkl.train.plot import ema, plot_runs

COMPARE = {"proximal_kl": [], "grpo": ["objective.name=grpo"], "pg": ["objective.name=pg"]}


def accuracy_summary(run_dir: Path, alpha: float = 0.2) -> tuple[float, float, int]:
    """(EMA accuracy over the first 5 updates, EMA accuracy at the end, updates)."""
    acc = [r["train/accuracy"] for r in read_metrics(run_dir)]
    smooth = ema(acc, alpha)
    return sum(acc[:5]) / min(5, len(acc)), smooth[-1], len(acc)


def run_demo(config_path: str, overrides: Sequence[str], compare: bool) -> list[Path]:
    from megapkl.config import load_config
    from megapkl.train.local import train_local

    arms = COMPARE if compare else {"proximal_kl": []}
    runs = []
    for name, extra in arms.items():
        cfg = load_config(config_path, [*overrides, *extra, f"name=cpu_demo_{name}"])
        shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a demo starts from scratch every time
        t0 = time.time()
        train_local(cfg)
        start, end, n = accuracy_summary(Path(cfg.run_dir))
        print(f"{name}: {n} updates in {time.time() - t0:.0f} s; training accuracy "
              f"{start:.3f} (first 5 updates) -> {end:.3f} (EMA 0.2, last update); run dir {cfg.run_dir}")
        runs.append(Path(cfg.run_dir))
    out = runs[0].parent / ("cpu_demo_compare_plots" if compare else f"{runs[0].name}_plots")
    files = plot_runs(runs, out, alpha=0.2, labels=list(arms))
    print(f"plots: {out} ({len(files)} files)")
    return runs
