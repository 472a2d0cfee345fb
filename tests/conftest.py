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
# other worker takes the in-process tests meanwhile. That group is the largest: xdist sends it
# first. (A scheduler of our own rather than xdist_group markers: under pytest 9 xdist 3.8 no
# longer tags the marked tests' ids, and the markers group nothing.)
SERVERS = tuple(f"tests/{p}" for p in (
    "launch/", "journey/", "serve/", "contract/", "rollout/test_sglang_",
    "reliability/test_engine_outage.py", "reliability/test_failure_agreement.py",
    "train/test_async_identity.py", "train/test_mismatch_routing.py"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ServersTogether(LoadScopeScheduling):
        """One work unit for the SERVERS tests; every other test is a unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            return "servers" if nodeid.startswith(SERVERS) else nodeid

    return ServersTogether(config, log)
