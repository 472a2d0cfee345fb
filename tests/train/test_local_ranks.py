"""`megapkl train` with several ranks on one machine with GPUs starts one process per GPU the way
torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*), so each rank's
process group and model land on cuda:LOCAL_RANK. The same start runs here on CPU (gloo)."""
from __future__ import annotations

import os

import pytest


def _probe(rank, world, cfg):
    import torch
    import torch.distributed as dist

    from megapkl.train.loop import init_groups

    g = init_groups(cfg.parallel, cfg.model, cfg.train.seed)  # what the trainer does first
    t = torch.tensor([float(rank)], device=g.device)
    dist.all_reduce(t)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return {"local_rank": os.environ["LOCAL_RANK"], "local_world": os.environ["LOCAL_WORLD_SIZE"],
            "rank": dist.get_rank(), "dp_rank": g.dp_rank, "sum": float(t.item()),
            "backend": dist.get_backend(), "device": device}


def test_started_ranks_get_torchrun_environment():
    from megapkl.config import load_config
    from megapkl.train.local import run_ranks

    cfg = load_config("configs/demo/cpu_demo.yaml", ["parallel.data=2"])
    out = run_ranks(_probe, 2, cfg)
    assert [o["local_rank"] for o in out] == ["0", "1"] and {o["local_world"] for o in out} == {"2"}
    assert [o["rank"] for o in out] == [0, 1] and [o["dp_rank"] for o in out] == [0, 1]
    assert {o["sum"] for o in out} == {1.0}
    for r, o in enumerate(out):  # NCCL on cuda:LOCAL_RANK where there are GPUs, gloo here
        assert (o["backend"], o["device"]) in (("nccl", r), ("gloo", None))


def _fails(rank, world):
    if rank == 1:
        raise ValueError("rank one broke")
    import time
    time.sleep(60)


def test_a_failing_rank_ends_the_others_with_its_error():
    from megapkl.train.local import run_ranks

    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*rank one broke"):
        run_ranks(_fails, 2)
