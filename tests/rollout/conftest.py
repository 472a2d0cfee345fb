"""Fixtures of the rollout tests (helpers live in rollout_tiny.py, importable by test modules)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_tiny import DENSE, MOE, build_model  # noqa: E402


@pytest.fixture(scope="module")
def dense_model():
    return build_model(DENSE)


@pytest.fixture(scope="module")
def moe_model():
    return build_model(MOE)
