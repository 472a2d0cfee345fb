import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def user_envs_importable(monkeypatch):
    """tests/envs/user_envs.py importable here and in the worker processes (PYTHONPATH)."""
    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, *sys.path]))
