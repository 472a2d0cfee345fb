"""The forked gloo harness: results come back in rank order, failures and hangs fail loudly."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megapkl.parallel.forked import WorkerError, WorkerTimeout, run_forked


def sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return rank, t  # tensors travel back by value


def test_results_in_rank_order():
    out = run_forked(sum_ranks, 3, 2.0, install_compat=False)
    assert [r for r, _ in out] == [0, 1, 2]
    assert all(t.item() == 6.0 for _, t in out)


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever: the harness must kill it


def test_worker_exception_carries_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1") as err:
        run_forked(raise_on_rank_one, 2, install_compat=False)
    assert "ValueError: boom on purpose" in str(err.value)
    assert "raise_on_rank_one" in str(err.value)  # the worker's own frame
    assert time.monotonic() - start < 30


def test_hang_times_out_and_kills():
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"\[0, 1\]"):
        run_forked(lambda rank, ws: time.sleep(60), 2, timeout=1.0, install_compat=False)
    assert time.monotonic() - start < 10


def test_crashed_rank_is_reported():
    with pytest.raises(WorkerError, match="exit code 3"):
        run_forked(lambda rank, ws: os._exit(3), 1, install_compat=False)


def test_without_process_group():
    out = run_forked(lambda rank, ws: dist.is_initialized(), 2, init_distributed=False,
                     install_compat=False)
    assert out == [False, False]


def test_busy_port_is_retried(monkeypatch):
    import socket

    from megapkl.parallel import forked

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = iter([busy.getsockname()[1]])
        fresh = forked.free_port
        monkeypatch.setattr(forked, "free_port", lambda: next(ports, None) or fresh())
        assert run_forked(lambda rank, ws: rank, 2, install_compat=False) == [0, 1]


def _collect_garbage(rank, world_size):
    import gc

    return gc.collect() >= 0


def test_a_rank_never_finalizes_the_parents_garbage():
    """An earlier run's gloo group left in a reference cycle of the parent: a rank whose collector
    finalized it would run its C++ destructor where its threads do not exist (it aborts)."""
    import datetime
    import gc

    gc.disable()  # keep the cycle alive until the fork, as an unlucky collection schedule would
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
        group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))
        group.allreduce([torch.ones(2)]).wait()  # its worker threads run now

        class Holder:
            pass

        cycle = Holder()
        cycle.self, cycle.group, cycle.store = cycle, group, store
        del cycle, group, store
        assert run_forked(_collect_garbage, 1, init_distributed=False, timeout=60) == [True]
    finally:
        gc.enable()
