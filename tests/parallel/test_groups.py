"""ParallelGroups reads megatron's groups correctly for the usual layouts."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megapkl.parallel.groups import ParallelGroups, group_rank, group_size

LAYOUTS_4 = [  # (tp, pp, cp, ep); dp is what is left of 4 ranks
    dict(tp=2, pp=1, cp=1, ep=1),
    dict(tp=1, pp=1, cp=2, ep=1),
    dict(tp=2, pp=1, cp=2, ep=1),
    dict(tp=2, pp=2, cp=1, ep=1),
    dict(tp=1, pp=2, cp=1, ep=1),
    dict(tp=1, pp=1, cp=1, ep=2),
    dict(tp=2, pp=1, cp=1, ep=2),
]


def expected_coords(rank, world, tp, pp, cp, ep):
    """Coordinates in megatron's default order "tp-cp-ep-dp-pp" (tp fastest, pp slowest)."""
    dp = world // (tp * pp * cp)
    coords = dict(tp=rank % tp, cp=(rank // tp) % cp, dp=(rank // (tp * cp)) % dp,
                  pp=rank // (tp * cp * dp))
    coords["dp_cp"] = coords["cp"] + cp * coords["dp"]
    coords["ep"] = (rank // tp) % ep  # expert grid: tp (= expert tp), ep, expert-dp, pp
    return coords, dict(tp=tp, pp=pp, cp=cp, dp=dp, dp_cp=dp * cp, ep=ep)


def expected_members(world, layout, dim, rank):
    """Global ranks in this rank's `dim` group: those agreeing on every other coordinate."""
    free = {"dp_cp": ("cp", "dp")}.get(dim, (dim,))

    def key(r):
        if dim == "ep":  # expert grid: expert-tp digit and everything slower than ep stay
            return r % layout["tp"], r // (layout["tp"] * layout["ep"])
        coords, _ = expected_coords(r, world, **layout)
        return tuple(coords[d] for d in ("tp", "cp", "dp", "pp") if d not in free)

    return sorted(r for r in range(world) if key(r) == key(rank))


def layouts_worker(rank, world_size):
    from megapkl.parallel.groups import init_parallel

    report = []
    for layout in LAYOUTS_4:
        groups = init_parallel(**layout)
        members = {}
        for dim in ("tp", "pp", "cp", "dp", "dp_cp", "ep"):
            group = getattr(groups, dim)
            got = [None] * group_size(group)
            dist.all_gather_object(got, rank, group=group)
            members[dim] = sorted(got)
        report.append((groups, members))
    return [(g.rank, g.world_size, {d: (getattr(g, f"{d}_rank"), getattr(g, f"{d}_size"))
                                    for d in ("tp", "pp", "cp", "dp", "dp_cp", "ep")}, m)
            for g, m in report]


def test_layouts_on_four_ranks(dist_run):
    per_rank = dist_run(layouts_worker, 4)
    for rank, reports in enumerate(per_rank):
        for layout, (g_rank, g_world, coords, members) in zip(LAYOUTS_4, reports):
            want, sizes = expected_coords(rank, 4, **layout)
            assert (g_rank, g_world) == (rank, 4)
            for dim, (r, s) in coords.items():
                assert (r, s) == (want[dim], sizes[dim]), (layout, dim)
                assert members[dim] == expected_members(4, layout, dim, rank), (layout, dim)


def test_single_process_bundle():
    g = ParallelGroups.single()
    assert g.tp is None and g.dp_cp is None and g.world is None
    assert (g.rank, g.world_size, g.tp_size, g.pp_rank) == (0, 1, 1, 0)
    assert g.is_first_pp_stage and g.is_last_pp_stage
    assert group_size(None) == 1 and group_rank(None) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.tp_size = 2


def bad_layout_worker(rank, world_size):
    from megapkl.parallel.groups import init_parallel

    messages = []
    for layout in (dict(tp=3), dict(ep=4)):
        with pytest.raises(ValueError) as err:
            init_parallel(**layout)
        messages.append(str(err.value))
    groups = init_parallel(tp=2, seed=3)  # a bad request leaves nothing half-built
    return messages, groups.tp_size


def test_bad_layout_is_named(dist_run):
    messages, tp_size = dist_run(bad_layout_worker, 2)[0]
    assert "tp*pp*cp = 3" in messages[0] and "etp*ep = 1*4" in messages[1]
    assert tp_size == 2


def test_init_parallel_from_env(dist_run):
    """torchrun-style: MASTER_ADDR/PORT, RANK, WORLD_SIZE in the environment."""
    from megapkl.parallel.forked import free_port

    port = free_port()

    def worker(rank, world_size):
        import os

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size))
        from megapkl.parallel.groups import init_parallel

        g = init_parallel(tp=2)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=g.tp)
        return g.tp_rank, x.item()

    assert dist_run(worker, 2, init_distributed=False) == [(0, 3.0), (1, 3.0)]


def test_expected_coords_cover_every_rank_once():
    # guards the test's own model of megatron's layout
    for layout in LAYOUTS_4:
        seen = {tuple(expected_coords(r, 4, **layout)[0][d] for d in ("tp", "cp", "dp", "pp"))
                for r in range(4)}
        assert len(seen) == 4


def test_device_is_cpu_under_gloo_and_compat_is_required(dist_run):
    """Under gloo the bundle's device is the CPU; without CUDA, building megatron groups in a
    process that did not install the compatibility layer is refused with a clear message."""
    def worker(rank, world_size):
        from megapkl.parallel import compat
        from megapkl.parallel.groups import group_device, init_parallel, replica_group

        assert not compat.is_installed()
        with pytest.raises(RuntimeError, match="compat.install"):
            init_parallel(tp=1)
        compat.install()
        g = init_parallel(tp=2)
        replica = replica_group(g)   # the ranks sharing this DP index: here the TP pair
        return str(g.device), str(group_device(g.tp)), dist.get_world_size(replica)

    assert dist_run(worker, 2, install_compat=False) == [("cpu", "cpu", 2)] * 2
    assert ParallelGroups.single().device == torch.device("cpu")
