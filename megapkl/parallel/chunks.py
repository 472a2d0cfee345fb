"""The GPTModel chunks inside DDP / Float16Module wrappers (one per virtual pipeline stage)."""
from __future__ import annotations

from typing import Any


def unwrap(model: Any) -> Any:
    """The innermost module of a wrapper chain (DDP, Float16Module, ...)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_chunks(model: Any) -> list:
    """A model, a wrapper or a list of chunks -> the list of unwrapped GPTModel chunks."""
    return [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
