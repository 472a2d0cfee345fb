"""Trainer state and results are layout independent: a run saved at DP = 2 resumes at DP = 1 and at
TP = 2 with the same prompt order, the same samples and the same metrics (up to float summation
order) from then on."""
import pytest

from megapkl.train.metrics_log import read_metrics
from megapkl.train.loop_state import my_share

from .conftest import comparable, tiny_cfg

# A batch of 2 minibatches (one per update): the checkpoint after update 0 holds the batch whose
# second minibatch update 1 trains on. Proximal KL with a snapshot reference exercises the snapshots.
MB2 = ["rollout.minibatches_per_batch=2", "checkpoint.every=1"]


def _close(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), (x["step"], k, x[k], y[k])


def test_my_share_keeps_each_minibatch_whole():
    mbs = [list(range(0, 8)), list(range(8, 16))]
    assert my_share(mbs, 0, 2) + my_share(mbs, 1, 2) == [0, 1, 2, 3, 8, 9, 10, 11,
                                                          4, 5, 6, 7, 12, 13, 14, 15]
    assert my_share(mbs, 0, 1) == list(range(16))
    with pytest.raises(ValueError, match="do not split over data-parallel size 3"):
        my_share(mbs, 0, 3)


def test_resume_at_another_data_and_tensor_parallel_size(train, tmp_path):
    """Saved at DP = 2 after update 0; resumed at DP = 1 and at TP = 2: update 1 (the rest of the
    saved batch) gives the metrics of the uninterrupted DP = 2 run, and so does update 2, whose
    batch is generated at the new layout: each prompt group's draws are seeded by its place in
    the global batch, not by the rank that generates it (rollout/seeds.py)."""
    full = tiny_cfg(tmp_path / "full", *MB2, "train.steps=3", data=2)
    train(full, world=2)
    ref = comparable(read_metrics(full.run_dir))
    for name, world, layout in (("dp1", 1, ["parallel.data=1"]),
                                ("tp2", 2, ["parallel.data=1", "parallel.tensor=2"])):
        part = tiny_cfg(tmp_path / name, *MB2, "train.steps=1", data=2)
        train(part, world=2)
        resumed = tiny_cfg(tmp_path / name, *MB2, "train.steps=3", "checkpoint.resume=true",
                           *layout)
        train(resumed, world=world)
        rows = comparable(read_metrics(resumed.run_dir))
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert rows[0] == ref[0]
        _close(rows[1:], ref[1:])
