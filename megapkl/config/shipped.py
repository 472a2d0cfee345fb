"""Where the shipped configs live: the presets `extends:` names, the model YAMLs the layout rules
read, the demo. One function, below both the loader and the validation rules that read them."""
from __future__ import annotations

import os
from pathlib import Path


def configs_dir() -> Path:
    """The shipped presets: $MEGAPKL_CONFIGS, else the repository's configs/ folder."""
    env = os.environ.get("MEGAPKL_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"
