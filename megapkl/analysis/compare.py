"""`megapkl compare`: every method x seed of one base config, then curves with bootstrap bands, a
table per metric with intervals, pairwise differences, and a Markdown report that says which
differences the seeds resolve.

    megapkl compare configs/demo/cpu_demo.yaml --methods proximal_kl,grpo,pg --seeds 5 train.steps=200

A method is an objective preset (`configs/objectives/NAME.yaml`, or a path to such a file): its
resolved `objective` section replaces the base config's, everything else (protocol, model, data,
steps) stays the base config's, so methods differ only in their objective. Seed s sets the run's
`seed` (model init, data order, sampling). Runs go to `<out>/<method>/seed-<s>/`; analysis reads
their metrics.jsonl only, so `--analyze` redoes the report from finished runs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from megapkl.analysis import compare_stats as st
from megapkl.train.metrics_log import read_metrics


@dataclass(frozen=True)
class Criteria:
    metric: str = "train/accuracy"
    ema_alpha: float = 0.2          # smoothing of curves, thresholds and collapses
    threshold: float = 0.9          # updates until the smoothed metric reaches it
    final_window: float = 0.1       # fraction of the run averaged for the final value
    collapse_drop: float = 0.2      # a fall this far below the running best is a collapse
    level: float = st.LEVEL


@dataclass
class Arm:
    method: str
    seed: int
    overrides: list[str]
    run_dir: Path


@dataclass
class Comparison:
    out: Path
    methods: list[str]
    seeds: list[int]
    criteria: Criteria
    runs: dict[str, dict[int, list[dict]]] = field(default_factory=dict)  # method -> seed -> rows


# ---------------------------------------------------------------- arms

def method_overrides(method: str) -> list[str]:
    """Dotted overrides that set the whole `objective` section to the preset's."""
    from megapkl.config import ConfigError, configs_dir, load_config
    from megapkl.config.typed import to_dict

    path = Path(method)
    if path.suffix not in (".yaml", ".yml"):
        path = configs_dir() / "objectives" / f"{method}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (configs_dir() / "objectives").glob("*.yaml"))
        raise ConfigError(f"unknown method '{method}': no preset {path} (presets: "
                          f"{', '.join(known)})", key="--methods", source="command line")
    objective = to_dict(load_config(path).objective)
    objective.pop("seed", None)  # the SIS draw seed stays the base config's
    return [f"objective.{k}={_yaml(v)}" for k, v in _flatten(objective)]


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _yaml(value: Any) -> str:
    return json.dumps(value)  # JSON scalars and lists are valid YAML flow values


def method_label(method: str) -> str:
    return Path(method).stem


def plan_arms(config: str, methods: Sequence[str], seeds: Sequence[int], overrides: Sequence[str],
              out: Path) -> list[Arm]:
    """Every method x seed, validated before anything runs."""
    from megapkl.config import load_config

    base = load_config(config, list(overrides))
    arms = []
    for m in methods:
        mo = method_overrides(m)
        for s in seeds:
            # the same names and directories as a Slurm sweep over seed (megapkl.launch.compare)
            run_dir = out / method_label(m) / f"seed-{s}"
            own = [*overrides, *mo, f"seed={s}", f"name={base.name}-{method_label(m)}-seed-{s}",
                   f"run_dir={run_dir}"]
            load_config(config, own)
            arms.append(Arm(method_label(m), s, own, run_dir))
    return arms


def run_local(config: str, arms: Sequence[Arm], *, fresh: bool = True) -> None:
    """Train the arms one after another on this machine."""
    from megapkl.config import load_config
    from megapkl.train.local import train_local

    for i, arm in enumerate(arms):
        if fresh:
            shutil.rmtree(arm.run_dir, ignore_errors=True)
        t0 = time.time()
        train_local(load_config(config, arm.overrides))
        print(f"[compare] {i + 1}/{len(arms)} {arm.method} seed {arm.seed}: "
              f"{time.time() - t0:.0f} s ({arm.run_dir})", flush=True)


# ---------------------------------------------------------------- analysis

def load_comparison(out: Path, arms: Sequence[Arm], criteria: Criteria) -> Comparison:
    methods = list(dict.fromkeys(a.method for a in arms))
    seeds = sorted({a.seed for a in arms})
    cmp = Comparison(out, methods, seeds, criteria)
    for a in arms:
        cmp.runs.setdefault(a.method, {})[a.seed] = read_metrics(a.run_dir)
    return cmp


def series(rows: list[dict], metric: str) -> list[float]:
    vals = [r.get(metric) for r in rows]
    return [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]


def run_summary(values: list[float], c: Criteria) -> dict[str, float]:
    """One run's numbers (updates to threshold: the run length + 1 when never reached)."""
    smooth = st.ema(values, c.ema_alpha)
    window = max(1, int(round(c.final_window * len(values))))
    reached = st.updates_to(smooth, c.threshold)
    return {"final": st.final_value(values, window),
            "updates_to_threshold": float(reached if reached is not None else len(values) + 1),
            "reached": float(reached is not None),
            "auc": st.area_under_curve(values),
            "collapses": float(st.collapses(smooth, c.collapse_drop))}


SUMMARY_NAMES = {
    "final": "final {metric} (mean of the last {window:.0%} of updates)",
    "updates_to_threshold": "updates until EMA {metric} >= {threshold} (run length + 1 if never)",
    "auc": "area under the {metric} curve (mean over all updates)",
    "collapses": "collapses (EMA falls > {drop} below its running best)",
}


def summarize(cmp: Comparison) -> dict[str, Any]:
    """Per method and summary: per-seed values and the interval; per pair: the difference."""
    c = cmp.criteria
    per = {m: {s: run_summary(series(rows, c.metric), c) for s, rows in cmp.runs[m].items()}
           for m in cmp.methods}
    out: dict[str, Any] = {"criteria": dataclasses.asdict(c), "methods": cmp.methods,
                           "seeds": cmp.seeds, "metrics": {}}
    for key in SUMMARY_NAMES:
        table: dict[str, Any] = {"methods": {}, "pairs": []}
        for m in cmp.methods:
            vals = [per[m][s][key] for s in sorted(per[m])]
            iv = st.mean_interval(vals, level=c.level)
            table["methods"][m] = {"values": vals, "mean": iv.mean, "low": iv.low, "high": iv.high,
                                   "reached": [per[m][s]["reached"] for s in sorted(per[m])]}
        for i, a in enumerate(cmp.methods):
            for b in cmp.methods[i + 1:]:
                iv = st.difference_interval(table["methods"][a]["values"],
                                            table["methods"][b]["values"], level=c.level)
                table["pairs"].append({"a": a, "b": b, "diff": iv.mean, "low": iv.low,
                                       "high": iv.high, "resolved": iv.excludes_zero})
        out["metrics"][key] = table
    return out


# ---------------------------------------------------------------- outputs

def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def report_markdown(cmp: Comparison, summary: dict[str, Any], plots: Sequence[Path]) -> str:
    c = cmp.criteria
    names = {k: t.format(metric=c.metric, window=c.final_window, threshold=c.threshold,
                         drop=c.collapse_drop) for k, t in SUMMARY_NAMES.items()}
    n = len(cmp.seeds)
    lines = [f"# Method comparison: {', '.join(cmp.methods)}", "",
             f"{n} seeds per method ({', '.join(map(str, cmp.seeds))}); every number below is the "
             f"mean over seeds with a {c.level:.0%} percentile-bootstrap interval (seeds resampled "
             f"with replacement; exact enumeration up to {st.EXACT_LIMIT} resamples). Curves are "
             f"EMA-smoothed with alpha {c.ema_alpha}.", "",
             f"With {n} seeds a bootstrap interval is narrower than the truth: a difference whose "
             "interval excludes 0 is evidence, one whose interval includes 0 is not resolved.", ""]
    resolved, unresolved = [], []
    for key, table in summary["metrics"].items():
        lines += [f"## {names[key]}", "", "| method | mean | interval | per seed |",
                  "|---|---|---|---|"]
        for m, r in table["methods"].items():
            never = key == "updates_to_threshold"
            seeds = ", ".join(_fmt(v) + (" (never)" if never and not ok else "")
                              for v, ok in zip(r["values"], r["reached"]))
            lines.append(f"| {m} | {_fmt(r['mean'])} | [{_fmt(r['low'])}, {_fmt(r['high'])}] "
                         f"| {seeds} |")
        lines += ["", "| difference | mean | interval | resolved |", "|---|---|---|---|"]
        for p in table["pairs"]:
            text = f"{p['a']} - {p['b']}"
            lines.append(f"| {text} | {_fmt(p['diff'])} | [{_fmt(p['low'])}, {_fmt(p['high'])}] "
                         f"| {'yes' if p['resolved'] else 'no'} |")
            (resolved if p["resolved"] else unresolved).append(
                f"{names[key]}: {text} = {_fmt(p['diff'])} [{_fmt(p['low'])}, {_fmt(p['high'])}]")
        lines.append("")
    lines += [f"## What {n} seeds resolve", ""]
    lines += [f"- resolved: {r}" for r in resolved] or ["- no difference is resolved"]
    lines += [f"- not resolved: {r}" for r in unresolved]
    if plots:
        lines += ["", "## Curves", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_bands(cmp: Comparison, metrics: Sequence[str]) -> list[Path]:
    """One PNG per metric: each method's mean EMA curve over seeds with its bootstrap band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, written = cmp.criteria, []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for i, m in enumerate(cmp.methods):
            curves = [st.ema(series(rows, metric), c.ema_alpha) for rows in cmp.runs[m].values()]
            curves = [x for x in curves if len(x)]
            if not curves:
                continue
            T = min(len(x) for x in curves)
            mean, low, high = st.curve_band(np.stack([x[:T] for x in curves]), level=c.level)
            steps = np.arange(T)
            ax.plot(steps, mean, color=f"C{i % 10}", linewidth=1.8, label=f"{m} (n={len(curves)})")
            ax.fill_between(steps, low, high, color=f"C{i % 10}", alpha=0.2, linewidth=0)
            drawn = True
        if drawn:
            ax.set_title(f"{metric}: mean over seeds, {c.level:.0%} bootstrap band "
                         f"(EMA {c.ema_alpha})", fontsize=9)
            ax.set_xlabel("optimizer update")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = cmp.out / f"curve_{metric.replace('/', '_')}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written


def analyze(out: Path, arms: Sequence[Arm], criteria: Criteria) -> tuple[dict[str, Any], Path]:
    """Read the runs, write summary.json, the curves and report.md into `out`."""
    cmp = load_comparison(out, arms, criteria)
    missing = [str(a.run_dir) for a in arms if not cmp.runs[a.method][a.seed]]
    if missing:
        raise RuntimeError(f"no metrics in {len(missing)} run(s): {', '.join(missing[:3])}")
    summary = summarize(cmp)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plots = plot_bands(cmp, [criteria.metric, "reward/mean"])
    report = out / "report.md"
    report.write_text(report_markdown(cmp, summary, plots))
    return summary, report


def compare(config: str, methods: Sequence[str], seeds: Sequence[int], overrides: Sequence[str] = (),
            *, out: Optional[str | os.PathLike] = None, criteria: Criteria = Criteria(),
            runner: Optional[Callable[[str, Sequence[Arm]], None]] = None, analyze_only: bool = False
            ) -> tuple[dict[str, Any], Path]:
    """Run every method x seed (unless `analyze_only`) and write the comparison."""
    from megapkl.config import load_config

    if len(seeds) < 2:
        from megapkl.config import ConfigError

        raise ConfigError("a comparison needs at least 2 seeds per method (one seed is noise)",
                          key="--seeds", source="command line")
    base = load_config(config, list(overrides))
    out = Path(out) if out else Path(base.run_dir).parent / f"{base.name}_compare"
    arms = plan_arms(config, methods, seeds, overrides, out)
    if not analyze_only:
        (runner or run_local)(config, arms)
    return analyze(out, arms, criteria)


def headline(summary: dict[str, Any]) -> list[str]:
    """One line per method: final metric and updates to threshold with intervals."""
    fin = summary["metrics"]["final"]["methods"]
    upd = summary["metrics"]["updates_to_threshold"]["methods"]
    c = summary["criteria"]
    return [f"{m}: final {c['metric']} {fin[m]['mean']:.3f} [{fin[m]['low']:.3f}, "
            f"{fin[m]['high']:.3f}], updates to {c['threshold']} {upd[m]['mean']:.0f} "
            f"[{upd[m]['low']:.0f}, {upd[m]['high']:.0f}] (n={len(fin[m]['values'])})"
            for m in summary["methods"]]
