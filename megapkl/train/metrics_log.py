"""Per-update metrics to JSONL, TensorBoard and W&B, and a one-line progress display (docs/spec.md
section 9).

Rank 0 writes; other ranks construct the logger with `enabled=False`. Each JSONL row is one
optimizer update: {"step": u, "time": seconds since start, <metric>: value, ...}.
"""
from __future__ import annotations

import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional, TextIO

METRICS_FILE = "metrics.jsonl"


def wall_clock(key: str) -> bool:
    """Is metric `key` a wall-clock measurement (different in any two runs of one config)? All
    other metrics are the same for a parallel layout, an engine placement or a restart."""
    return key in ("time", "tokens_per_s") or key.startswith("time/")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 progress: bool = True, total_steps: Optional[int] = None, resume: bool = False,
                 stream: TextIO = sys.stderr, wandb: Any = None, run_name: str = "megapkl") -> None:
        self.enabled, self.total, self.stream = enabled, total_steps, stream
        self.progress = progress and enabled
        self.start = time.time()
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if resume else "w", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: heavy import

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if wandb is not None and wandb.mode != "disabled":
            self._wandb = start_wandb(wandb, Path(run_dir), run_name)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self.start, 3)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self.progress:
            self.stream.write(progress_line(step, self.total, metrics) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            self._wandb = None
            wandb.teardown()  # its service process ends with the run, not with the interpreter


def start_wandb(cfg: Any, run_dir: Path, run_name: str):
    """A W&B run for `logging.wandb` (imported only here). The run id is kept in
    <run_dir>/wandb_id so a resumed or requeued run continues the same W&B run."""
    try:
        import wandb
    except ImportError:
        raise ImportError("logging.wandb.mode is set but wandb is not installed: "
                          "pip install -e .[wandb] (or set logging.wandb.mode: disabled)") from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir),
                      name=run_name, id=run_id, resume="allow")


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def progress_line(step: int, total: Optional[int], m: dict[str, float]) -> str:
    """`step 12/60 | reward -0.41 | acc 0.30 | entropy 2.1 | 153 tok/s`"""
    head = f"step {step + 1}/{total}" if total else f"step {step + 1}"
    parts = [head]
    for key, label, fmt in (("reward/mean", "reward", "{:+.3f}"), ("train/accuracy", "acc", "{:.3f}"),
                            ("loss", "loss", "{:+.4f}"), ("entropy", "entropy", "{:.3f}"),
                            ("staleness/mean", "stale", "{:.1f}"), ("tokens_per_s", "tok/s", "{:.0f}")):
        if key in m and isinstance(m[key], (int, float)):
            parts.append(f"{label} {fmt.format(m[key])}")
    return " | ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Rows of a run's metrics.jsonl; a malformed line is an error naming file and line."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a megapkl run directory?)")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: malformed metrics row ({exc.msg})") from None
    return rows
