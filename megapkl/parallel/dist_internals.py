"""The one module that touches torch.distributed's private API. Each use is a registered patch
(`megapkl.parallel.patches`, docs/patches.md), checked against the torch version and the names
and parameters it relies on before its first use, so a torch that moved fails in one line naming
it instead of deep inside a run.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist

from megapkl.parallel.patches import check


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


def process_groups() -> list:
    """Every process group this process has created (the default one included)."""
    check("dist-group-registry")
    return list(_c10d()._world.pg_map) if dist.is_initialized() else []


def default_group() -> Any:
    check("dist-group-registry")
    return _c10d()._get_default_group()


def is_member(group: Any) -> bool:
    """Is this process a rank of `group` (torch keeps a placeholder for groups it is not in)?"""
    check("dist-group-registry")
    return not _c10d()._rank_not_in_group(group)


def set_group_timeout(timeout: timedelta, group: Any) -> None:
    """`dist.set_timeout` (public since torch 2.14); torch 2.13, the lowest torch megapkl admits,
    has the same call under its former private name."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
        return
    check("dist-pg-timeout-2.13")
    _c10d()._set_pg_timeout(timeout, group)


def default_store() -> Any:
    """The store of the default group (every rank of the world reaches it)."""
    check("dist-default-store")
    return _c10d()._get_default_store()


def abort_process_groups() -> None:
    """Abort every process group of this process: a collective waiting under NCCL returns."""
    check("dist-abort")
    _c10d()._abort_process_group()


def group_outside_world(backend: str, url: str, rank: int, world_size: int, group_name: str,
                        timeout_s: float, local_name: Optional[str] = None) -> Any:
    """A process group whose members need not be the default world's (SGLang's weight-update
    group: the trainer and its servers): TCP rendezvous at `url`, a store prefixed by the group
    name, registered with its own ranks so torch's collectives accept it. `local_name`: the name
    it is registered under in this process (two members in one process)."""
    check("dist-group-outside-world")
    c10d = _c10d()
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    with unbound_default_group():
        pg = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                            group_name=local_name or group_name,
                                            timeout=timeout)
    pg = pg[0] if isinstance(pg, tuple) else pg  # (group, store) in torch 2.14
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


_UNBINDING = threading.Lock()


@contextmanager
def unbound_default_group() -> Iterator[None]:
    """The default group shown as unbound to a device for the duration of the block.

    A default group bound to a device (`init_process_group(device_id=...)`, what the Slurm and
    torchrun launch does) makes torch's `_new_process_group_helper` build every new NCCL group by
    `ncclCommSplit` from the default communicator (its split predicate is
    `is_initialized() and _get_default_group().bound_device_id`). A split is collective over the
    trainer's whole world, which the servers are no part of: the first broadcast of the
    weight-update group would wait forever. Hidden, the binding leaves the new group a
    communicator of its own (made by its members only, at its first collective). The binding is
    a plain field of the default group, put back at once; the lock keeps two group makings from
    restoring each other's view."""
    check("dist-unbound-default-group")
    if not dist.is_initialized() or default_group().bound_device_id is None:
        yield
        return
    default = default_group()
    with _UNBINDING:
        bound = default.bound_device_id
        default.bound_device_id = None
        try:
            yield
        finally:
            default.bound_device_id = bound
