"""Where a run's wall time went: generation and training per update on a time axis.

Each metrics.jsonl row gives the first start and last end of the update's generation (of the batch
it starts: generated ahead under rollout.async_batches, so possibly during earlier updates) and of
its training, in seconds since the run started (time/generate_from_s, time/generate_to_s,
time/train_from_s, time/train_to_s). The plot has two lanes, the engine's and the trainer's, with a
bar per update in each (alternating shades, numbered when there are few): a synchronous run shows
the lanes taking turns, an asynchronous one shows them overlapping; the gaps in a lane are its idle
time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

LANES = (("generate", "generation", ("#4C72B0", "#8FAADC")),
         ("train", "training", ("#DD8452", "#F4B183")))


def spans(rows: list[dict], name: str) -> list[tuple[int, float, float]]:
    """(update, start, end) of `name` ("generate" or "train") in every row that has it."""
    out = []
    for r in rows:
        t0, t1 = r.get(f"time/{name}_from_s"), r.get(f"time/{name}_to_s")
        if t0 is not None and t1 is not None:
            out.append((int(r["step"]), float(t0), float(t1)))
    return out


def busy_fraction(rows: list[dict], name: str) -> Optional[float]:
    """Share of the run's timeline (first start to last end of any lane) a lane was busy."""
    every = [s for n, _, _ in LANES for s in spans(rows, n)]
    if not every:
        return None
    total = max(t1 for _, _, t1 in every) - min(t0 for _, t0, _ in every)
    return sum(t1 - t0 for _, t0, t1 in spans(rows, name)) / total if total > 0 else None


def plot_timeline(rows: list[dict], path: Path, title: str = "") -> Optional[Path]:
    """The timeline PNG of one run's rows; None when the rows have no timeline fields."""
    if not any(spans(rows, n) for n, _, _ in LANES):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.6))
    for lane, (name, label, shades) in enumerate(LANES):
        bars = spans(rows, name)
        ax.broken_barh([(t0, t1 - t0) for _, t0, t1 in bars], (lane - 0.35, 0.7),
                       facecolors=[shades[u % 2] for u, _, _ in bars], edgecolor="none")
        if len(bars) <= 40:
            for u, t0, t1 in bars:
                ax.text((t0 + t1) / 2, lane, str(u), ha="center", va="center", fontsize=7)
        busy = busy_fraction(rows, name)
        ax.text(1.01, lane, f"{label}\n{busy:.0%} busy" if busy is not None else label,
                transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    ax.set_yticks([0, 1], [label for _, label, _ in LANES])
    ax.set_xlabel("seconds since the run started")
    ax.set_title(title or "timeline: generation and training per update")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
