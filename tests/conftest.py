"""Shared fixtures for multi-process tests (see megapkl/parallel/forked.py for the harness).

    def test_something(dist_run):
        def worker(rank, world_size):          # runs in each forked gloo rank
            ...                                # megatron imported, compat installed, gloo up
            return small_result
        results = dist_run(worker, 2)          # rank-ordered results; worker errors re-raise
"""

import pytest


@pytest.fixture(scope="session")
def megatron_loaded():
    """Import megatron-core once in the pytest process; forked ranks inherit it (~5 s once)."""
    from megapkl.parallel.forked import preload_megatron

    preload_megatron()


@pytest.fixture
def dist_run(megatron_loaded):
    """`run_forked(fn, world_size, *args, timeout=120, **kwargs)` from megapkl.parallel.forked."""
    from megapkl.parallel.forked import run_forked

    return run_forked
