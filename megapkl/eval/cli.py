"""`megapkl eval RUN_DIR_OR_CHECKPOINT [--benchmarks ...]` (filled in by runner.py)."""
from __future__ import annotations


def add_subcommands(sub) -> None:
    pass
