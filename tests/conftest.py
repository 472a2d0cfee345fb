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


# Under pytest-xdist (tools/test.sh runs two workers: these tests wait on processes, servers and
# Slurm much of the time): a file's tests stay in one worker, so a module's servers start once,
# and every test that submits to the local Slurm cluster runs in one worker, one job at a time as
# its two CPUs expect. That group is the longest: it goes first.
SLURM_DIRS = ("launch", "journey")


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist") or not getattr(config.option, "numprocesses",
                                                                     None):
        return
    from pathlib import Path

    root = Path(__file__).parent

    def group(item) -> str:
        rel = Path(str(item.fspath)).relative_to(root)
        return "slurm" if rel.parts[0] in SLURM_DIRS else rel.as_posix()

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=lambda item: group(item) != "slurm")  # stable: file order kept otherwise
