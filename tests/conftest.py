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
# Slurm) the tests that start servers, kill them or submit to the local Slurm cluster are two work
# units, one per worker at first: the Slurm ones run one at a time (the cluster has two CPUs), and so
# do the server ones (a port a killed server freed is not taken by another test's server). Every
# other test is a unit of its own and fills in. (A scheduler of our own rather than xdist_group
# markers: under pytest 9, xdist 3.8's markers no longer change the test ids and group nothing.)
GROUPS = {
    "slurm": ("launch/", "journey/"),
    "servers": ("serve/", "contract/", "retriever/", "rollout/test_sglang_", "reliability/test_engine_outage.py",
                "reliability/test_failure_agreement.py", "train/test_async_identity.py",
                "train/test_config_sections.py",
                "train/test_mismatch_routing.py"),
}


def work_unit(nodeid: str) -> str:
    for name, prefixes in GROUPS.items():
        if nodeid.startswith(tuple(f"tests/{p}" for p in prefixes)):
            return name
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        """LoadScope over work_unit(): the largest units go out first."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Grouped(config, log)
