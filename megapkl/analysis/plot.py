"""`megapkl plot RUN_DIR...`: EMA-smoothed curves of one or several runs into PNG files.

One PNG per metric (accuracy, reward, entropy, grad norm, IS statistics, ...), every run a line,
raw values faint behind the smoothed curve (EMA alpha 0.1 by default, docs/spec.md section 11), plus
one `overview.png` grid with the main panels. Evaluation results (`eval/<benchmark>/<metric>` from
in-training evaluation) are drawn against the number of updates applied (`eval/version`), one PNG
each, plus `eval_overview.png`. Each run with timing rows also gets `timeline_<run>.png`:
generation and training per update on a time axis (megapkl.analysis.timeline).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

from megapkl.analysis.timeline import plot_timeline
from megapkl.train.metrics_log import read_metrics

DEFAULT_METRICS = ("train/accuracy", "reward/mean", "entropy", "grad_norm", "is/w_mean", "is/w_max",
                   "is/log_dev", "kl/prox_k3", "clip/frac", "pkl/credit_mean", "sis/accept_rate",
                   "tetpo/alpha_mean", "response_len/mean", "staleness/mean", "loss",
                   # per-update distributions: median with the p10-p90 band
                   "pkl/credit_p50", "sis/accept_rate_p50", "tetpo/alpha_p50", "tetpo/ess_frac_before_p50")
AVERAGES = ("eval/micro_avg", "eval/macro_avg")  # drawn first among the evaluation's metrics


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """s_0 = x_0, s_t = alpha x_t + (1 - alpha) s_{t-1}; non-finite values are carried over."""
    out, s = [], None
    for x in values:
        if x is None or not math.isfinite(x):
            out.append(s if s is not None else math.nan)
            continue
        s = x if s is None else alpha * x + (1 - alpha) * s
        out.append(s)
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    x_key = "eval/version" if key.startswith("eval/") else "step"
    steps, vals = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and x_key in r:
            steps.append(int(r[x_key]))
            vals.append(float(v))
    return steps, vals


def eval_metrics(runs: list[tuple[str, list[dict]]]) -> list[str]:
    """The eval/<benchmark>/<metric> keys present in any run (the averages first)."""
    keys = {k for _, rows in runs for r in rows for k in r
            if k.startswith("eval/") and k != "eval/version" and not k.endswith("/errors")}
    return sorted(keys, key=lambda k: (not k.startswith(AVERAGES), k))


def run_ema_alpha(run_dir: str | Path, default: float = 0.1) -> float:
    """The EMA alpha a run's resolved config asks for (`logging.ema_alpha`), else `default`."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        return default
    logging = (yaml.safe_load(path.read_text()) or {}).get("logging") or {}
    return float(logging.get("ema_alpha", default))


def plot_runs(run_dirs: Iterable[str | Path], out_dir: str | Path, *, alpha: float = 0.1,
              metrics: Sequence[str] = DEFAULT_METRICS, labels: Sequence[str] | None = None) -> list[Path]:
    """Write one PNG per metric present in any run, and overview.png; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(d) for d in run_dirs]
    runs = [(lbl, read_metrics(d)) for lbl, d in zip(labels or [d.name for d in run_dirs], run_dirs)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    present = [m for m in metrics if any(_series(rows, m)[0] for _, rows in runs)]
    evals = eval_metrics(runs)
    written = []
    for m in present + evals:
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, runs, m, alpha)
        path = out / (m.replace("/", "_") + ".png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for name, main in (("overview.png", present[:6]), ("eval_overview.png", _eval_main(evals))):
        if main:
            written.append(_grid(runs, main, alpha, out / name))
    for label, rows in runs:
        timeline = plot_timeline(rows, out / f"timeline_{label}.png", f"{label}: timeline")
        written += [timeline] if timeline else []
    return written


def _eval_main(evals: list[str]) -> list[str]:
    """Per benchmark its headline number (greedy pass@1 or mean@k), and the averages."""
    heads = [k for k in evals if k.rsplit("/", 1)[-1].startswith(("pass@1_greedy", "mean@"))]
    return [k for k in evals if k.startswith(AVERAGES)] + heads[:8]


def _grid(runs, main: list[str], alpha: float, path: Path) -> Path:
    import matplotlib.pyplot as plt

    cols = 3 if len(main) > 2 else len(main)
    rows_n = math.ceil(len(main) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    for ax, m in zip(axes.flat, main):
        _draw(ax, runs, m, alpha)
    for ax in list(axes.flat)[len(main):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _band(ax, rows, metric: str, alpha: float, color: str) -> None:
    """Shade the EMA-smoothed p10-p90 band around a `<name>_p50` quantile curve."""
    if not metric.endswith("_p50"):
        return
    base = metric[: -len("_p50")]
    (s_lo, lo), (s_hi, hi) = _series(rows, base + "_p10"), _series(rows, base + "_p90")
    if s_lo and s_lo == s_hi:
        ax.fill_between(s_lo, ema(lo, alpha), ema(hi, alpha), color=color, alpha=0.15, linewidth=0)


def _draw(ax, runs, metric: str, alpha: float) -> None:
    for i, (label, rows) in enumerate(runs):
        steps, vals = _series(rows, metric)
        if not steps:
            continue
        color = f"C{i % 10}"
        _band(ax, rows, metric, alpha, color)
        ax.plot(steps, vals, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, ema(vals, alpha), color=color, linewidth=1.8, label=label)
    ax.set_title(f"{metric} (EMA {alpha})")
    ax.set_xlabel("updates applied" if metric.startswith("eval/") else "optimizer update")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
