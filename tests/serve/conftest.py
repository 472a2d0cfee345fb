"""The serve tests share the rollout tests' tiny models and server fixtures (tests/rollout)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))

from rollout_tiny import DENSE, MOE, build_model  # noqa: E402


@pytest.fixture(scope="module")
def dense_model():
    return build_model(DENSE)


@pytest.fixture(scope="module")
def moe_model():
    return build_model(MOE)
