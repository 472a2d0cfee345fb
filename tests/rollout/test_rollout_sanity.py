"""Smoke test of the REINFORCE sanity script (the learning curve itself is recorded by running
`python tests/rollout/sanity.py`; it takes minutes, too long for the test suite)."""
from __future__ import annotations

from sanity import run  # tests/rollout/sanity.py


def test_sanity_script_runs_and_reports():
    out = run(steps=3, prompts_per_step=4, n=4, max_new_tokens=4, quiet=True)
    assert len(out["accuracy"]) == 3
    assert all(0.0 <= a <= 1.0 for a in out["accuracy"])
    assert 0.0 < out["chance"] < 0.1
