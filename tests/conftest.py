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


# Under pytest-xdist (tools/test.sh runs two workers: many tests wait on processes, servers and
# Slurm): every test that starts servers, kills them or submits to the local Slurm cluster runs in
# one worker, one at a time, so no two of them race for ports or for the cluster's two CPUs; the
# other worker takes the in-process tests meanwhile. That group is the longest: it goes first.
SERVERS = ("launch/", "journey/", "serve/", "contract/", "rollout/test_sglang_",
           "reliability/test_engine_outage.py", "reliability/test_failure_agreement.py",
           "train/test_async_identity.py", "train/test_mismatch_routing.py")


def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "numprocesses", None):  # one process: nothing to group
        return
    from pathlib import Path

    root = Path(__file__).parent

    def servers(item) -> bool:
        return Path(str(item.fspath)).relative_to(root).as_posix().startswith(SERVERS)

    for item in items:
        if servers(item):
            item.add_marker(pytest.mark.xdist_group("servers"))
    items.sort(key=lambda item: not servers(item))  # stable: file order kept otherwise
