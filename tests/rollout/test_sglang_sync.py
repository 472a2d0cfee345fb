"""The weight-sync state machine, unit level: a recording stand-in server (sglang_recorder.py,
started in its own process) that keeps what it receives, enforces the rules SGLang enforces on the
weight and memory routes and joins the broadcast group on its side. End-to-end sync against
`megapkl serve` workers is in test_sglang_fleet.py."""
from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_recorder import read_state, serve
from megapkl.rollout.engine import WeightUpdateError
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.weights import MiB, SyncSettings, Target, WeightSync


class Server:
    def __init__(self, url):
        self.url = url

    def state(self):
        return read_state(self.url)

    def post(self, route, body=None):
        http.request(self.url, "/" + route, body or {}, method="POST", timeout=30)


@pytest.fixture
def server():
    """A server that shares no state with this process. A fork would inherit every lock held by a
    thread here: a torch.distributed lock held by an aborted group's destroy (an earlier test's
    background thread) stays held in the child, and its own group rendezvous never ends."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=serve, args=(q,), daemon=True)
    proc.start()
    try:
        yield Server(f"http://127.0.0.1:{q.get(timeout=120)}")
    finally:
        proc.kill()
        proc.join()


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(64, 32, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(48, 32, generator=g)),
            ("model.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16))]


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_each_mode_leaves_exact_weights_in_order(server, mode, tmp_path):
    sent = _weights()
    seen = []

    def transform(bucket):  # the FP8 seam: called once per bucket before sending
        seen.append([n for n, _ in bucket])
        return bucket

    sync = WeightSync(SyncSettings(mode=mode, bucket_bytes=int(0.01 * MiB), pause_mode="in_place",
                                   timeout_s=30), export_dir=tmp_path, transform=transform)
    sync.push([Target(server.url)], sent, version=5)
    st = server.state()
    assert st["version"] == "5" and not st["paused"] and not st["session"]
    assert set(st["weights"]) == {n for n, _ in sent}
    for n, t in sent:
        assert st["weights"][n].dtype == t.dtype and torch.equal(st["weights"][n], t)
    assert len(seen) == 2 and [n for b in seen for n in b] == [n for n, _ in sent]  # 2 buckets
    update = {"tensor": "update_weights_from_tensor", "disk": "update_weights_from_disk",
              "distributed": "update_weights_from_distributed"}[mode]
    session = mode != "disk"  # a disk load post-processes on its own: no session around it
    expect = ["pause_generation", "flush_cache"] + ["begin_weight_update"] * session
    expect += ["init_weights_update_group"] if mode == "distributed" else []
    expect += [update] * (1 if mode == "disk" else 2)
    expect += ["end_weight_update"] * session + ["update_weight_version", "continue_generation"]
    assert st["routes"] == expect
    assert st["post_processed"] == 1  # SGLang post-processes the pushed weights once
    if mode == "distributed":  # the group is kept for the next sync of the same servers
        server.post("clear")
        sync.push([Target(server.url)], _weights(1), version=6)
        st = server.state()
        assert "init_weights_update_group" not in st["routes"]
        assert torch.equal(st["weights"]["model.norm.weight"], _weights(1)[2][1])
        sync.close_group([Target(server.url)])
    if mode == "disk":
        assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v5"]


def test_tensor_pushes_through_the_kept_segments_stay_exact(server, tmp_path):
    """The tensor sync's two shared segments are rewritten by every bucket and push: a stored
    version in three buckets (the third rewrites the first's segment), other weights, the stored
    version again. The server holds exactly the weights of each push."""
    from megapkl.rollout.version_store import VersionStore

    store = VersionStore(tmp_path / "versions")
    store.save(1, _weights(0))
    sync = WeightSync(SyncSettings(mode="tensor", bucket_bytes=48 * 32 * 4, pause_mode="in_place",
                                   timeout_s=30))
    for version, source, expect in [(1, store.get(1), _weights(0)), (2, _weights(1), _weights(1)),
                                    (3, store.get(1), _weights(0))]:
        server.post("clear")
        sync.push([Target(server.url)], source, version=version)
        st = server.state()
        assert st["version"] == str(version) and st["routes"].count(
            "update_weights_from_tensor") == 3
        for n, t in expect:
            assert st["weights"][n].dtype == t.dtype and torch.equal(st["weights"][n], t), n


def test_a_stored_version_is_pinned_under_the_fleet_lock(server, tmp_path):
    """A resync (the heartbeat's, under the fleet lock) reads the version the servers hold from
    its pinned file, which pinning the next version deletes: the trainer's push pins only once it
    holds the lock. Before: pinned before waiting for it, so a resync running meanwhile found its
    file gone and failed, leaving its server stale for a beat."""
    import threading
    import time

    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
    from megapkl.rollout.version_store import VersionStore

    store = VersionStore(tmp_path / "versions")
    store.save(1, _weights(0))
    store.save(2, _weights(1))
    fleet = Fleet([Worker(server.url, state="ready")], health=HealthSettings(timeout_s=30))
    sync = WeightSync(SyncSettings(mode="tensor", timeout_s=30), export_dir=tmp_path / "sync")
    engine = SGLangEngine(fleet, {}, sync, heartbeat=False)
    try:
        engine.update_weights(store.get(1), 1)
        held = tmp_path / "sync" / "weights" / "v1" / "model.safetensors"
        assert held.is_file()
        with fleet.lock:  # a resync of version 1 runs
            push = threading.Thread(target=engine.update_weights, args=(store.get(2), 2))
            push.start()
            time.sleep(0.5)
            assert held.is_file() and push.is_alive()
        push.join(60)
        assert engine.version == 2 and not held.exists()
        assert torch.equal(server.state()["weights"]["model.norm.weight"], _weights(1)[2][1])
    finally:
        engine.close()


def test_failed_update_names_server_and_lets_generation_continue(server, tmp_path):
    server.post("fail_on", {"route": "update_weights_from_tensor"})
    sync = WeightSync(SyncSettings(mode="tensor", timeout_s=30))
    with pytest.raises(WeightUpdateError, match="unknown weight 'model.bogus'") as info:
        sync.push([Target(server.url)], _weights(), version=1)
    assert server.url in str(info.value) and info.value.unreachable is None  # refused: alive
    st = server.state()
    assert st["routes"][-1] == "continue_generation" and not st["paused"]
    assert st["version"] is None
    dead = "http://127.0.0.1:9"  # nobody listens: the error names the server that is gone
    with pytest.raises(WeightUpdateError, match="127.0.0.1:9") as info:
        sync.push([Target(dead)], _weights(), version=1)
    assert info.value.unreachable == dead


def _colocated(server, **kw):
    """The weight owner of a one-server colocated fleet (what SGLangEngine makes)."""
    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
    from megapkl.rollout.sglang.weight_state import WeightState

    fleet = Fleet([Worker(server.url, state="ready")], health=HealthSettings(timeout_s=30))
    sync = WeightSync(SyncSettings(mode="tensor", colocate=True, timeout_s=30))
    return WeightState(fleet, sync, colocate=True, **kw)


def test_colocated_release_then_resume_before_the_push(server):
    """Each release is preceded by an aborting pause and a flush (SGLang asserts an idle
    scheduler), and generation continues after it; a push resumes the memory first, once."""
    state = _colocated(server)
    state.push(_weights(), version=1)
    server.post("clear")
    state.release()
    state.release()  # already released: no second call
    state.push(_weights(), version=2)
    state.push(_weights(), version=3)  # not released: nothing to resume
    routes = server.state()["routes"]
    assert routes[:5] == ["pause_generation", "flush_cache", "release_memory_occupation",
                          "continue_generation", "resume_memory_occupation"]
    assert routes.count("release_memory_occupation") == 1
    assert routes.count("resume_memory_occupation") == 1
    assert routes.index("resume_memory_occupation") < routes.index("begin_weight_update")


def test_the_cache_is_freed_before_the_server_resumes(server):
    """torch_memory_saver re-creates a resumed server's memory with fresh allocations: the
    trainer's cached blocks must be handed back first. The hook sees what the server has been
    asked when it runs: the release, not yet the resume."""
    from megapkl.rollout.sglang.weights import free_cached_memory

    routes_at_free = []
    state = _colocated(server, free_memory=lambda: routes_at_free.append(
        list(server.state()["routes"])))
    assert _colocated(server).free_memory is free_cached_memory
    state.push(_weights(), version=1)
    state.release()
    state.push(_weights(), version=2)
    assert len(routes_at_free) == 1 and "release_memory_occupation" in routes_at_free[0]
    assert "resume_memory_occupation" not in routes_at_free[0]
    assert "resume_memory_occupation" in server.state()["routes"]
    state.push(_weights(), version=3)  # nothing to resume: nothing freed
    assert len(routes_at_free) == 1
    free_cached_memory()  # on this host: no CUDA, no group, nothing to do and no error


def test_bad_settings():
    with pytest.raises(ValueError, match="rollout.sglang.weight_sync"):
        SyncSettings(mode="nccl")
    with pytest.raises(ValueError, match="rollout.sglang.pause_mode"):
        SyncSettings(pause_mode="stop")
    with pytest.raises(ValueError, match="disk needs a run directory"):
        WeightSync(SyncSettings(mode="disk"))


def test_fp8_distributed_sync_over_gloo_is_received_as_sglang_allocates(server):
    """SGLang allocates its receive buffers with the declared dtypes and broadcasts into them;
    gloo cannot broadcast float8. The bucket travels flattened (SGLang's flattened_bucket: one
    uint8 buffer), FP8 declared as float8_e4m3fn, and arrives bit for bit."""
    from megapkl.rollout.fp8 import FP8Transform

    g = torch.Generator().manual_seed(3)
    plain = [("model.layers.0.self_attn.q_proj.weight", torch.randn(130, 70, generator=g)),
             ("model.layers.0.mlp.down_proj.weight", torch.randn(33, 129, generator=g)),
             ("model.norm.weight", torch.randn(70, generator=g).to(torch.bfloat16))]
    sent = list(FP8Transform()(plain))
    assert {t.dtype for _, t in sent} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    sync = WeightSync(SyncSettings(mode="distributed", pause_mode="in_place", timeout_s=30))
    sync.push([Target(server.url)], sent, version=1)
    got = server.state()["weights"]
    assert set(got) == {n for n, _ in sent}
    for n, t in sent:
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
    sync.close_group([Target(server.url)])


def test_the_group_backend_follows_the_gpu():
    from megapkl.rollout.sglang.weights import group_backend

    assert group_backend(cuda=True) == "nccl" and group_backend(cuda=False) == "gloo"
    assert group_backend("gloo", cuda=True) == "gloo"


def test_disk_sync_names_a_loader_a_dummy_started_server_accepts(server, tmp_path):
    """Servers started without weights run `--load-format dummy`; a disk update that names no
    load_format gets the server's own, which SGLang's disk updater refuses (HTTP 400)."""
    sync = WeightSync(SyncSettings(mode="disk", pause_mode="in_place", timeout_s=30),
                      export_dir=tmp_path)
    sync.push([Target(server.url)], _weights(), version=2)
    st = server.state()
    assert st["version"] == "2" and set(st["weights"]) == {n for n, _ in _weights()}


def test_a_refused_bucket_fails_the_push_at_once(server):
    """A server that refuses a distributed update never joins its broadcast: the push raises the
    server's error without waiting the sync timeout for it, and the next push makes a new group."""
    import time

    sync = WeightSync(SyncSettings(mode="distributed", pause_mode="in_place", timeout_s=60))
    sync.push([Target(server.url)], _weights(), version=1)
    server.post("fail_on", {"route": "update_weights_from_distributed"})
    t0 = time.monotonic()
    with pytest.raises(WeightUpdateError, match="unknown weight 'model.bogus'"):
        sync.push([Target(server.url)], _weights(1), version=2)
    assert time.monotonic() - t0 < 30, "waited for the broadcast the server refused"
    st = server.state()
    assert "destroy_weights_update_group" in st["routes"] and not st["paused"]
    server.post("fail_on", {"route": None})
    server.post("clear")
    sync.push([Target(server.url)], _weights(2), version=3)
    st = server.state()
    assert "init_weights_update_group" in st["routes"] and st["version"] == "3"
    assert torch.equal(st["weights"]["model.norm.weight"], _weights(2)[2][1])
    sync.close_group([Target(server.url)])


def test_a_server_refusing_the_group_fails_the_push_at_once(server):
    """A server that refuses /init_weights_update_group never joins the rendezvous: the push
    raises its error without waiting the sync timeout, and generation continues."""
    import time

    server.post("fail_on", {"route": "init_weights_update_group"})
    sync = WeightSync(SyncSettings(mode="distributed", pause_mode="in_place", timeout_s=60))
    t0 = time.monotonic()
    with pytest.raises(WeightUpdateError, match="unknown weight 'model.bogus'"):
        sync.push([Target(server.url)], _weights(), version=1)
    assert time.monotonic() - t0 < 30, "waited for a rendezvous the server refused"
    st = server.state()
    assert st["routes"][-1] == "continue_generation" and not st["paused"]


def test_a_group_made_before_a_refusal_is_destroyed_on_both_sides(server):
    """A server that joins the group and then answers /init_weights_update_group with an error:
    the push fails, and the group our rendezvous made anyway is destroyed (not left registered
    in this process), and the server is told to leave it."""
    import time

    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)  # (groups of earlier tests may still be going)
    server.post("fail_after", {"route": "init_weights_update_group"})
    sync = WeightSync(SyncSettings(mode="distributed", pause_mode="in_place", timeout_s=30))
    with pytest.raises(WeightUpdateError, match="init_weights_update_group done, then failed"):
        sync.push([Target(server.url)], _weights(), version=1)
    deadline = time.monotonic() + 30  # a rendezvous thread that completes late destroys its own
    while set(c10d._world.pg_map) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(c10d._world.pg_map) - before, "the group made for the failed push is left"
    routes = server.state()["routes"]
    assert routes.index("init_weights_update_group") < routes.index("destroy_weights_update_group")
    server.post("fail_after", {"route": None})


_BOUND_DEFAULT_GROUP = r'''
import sys, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from megapkl.rollout.sglang.weights import free_port, open_update_group

seen = []
def make(opts, backend_options):  # a real gloo backend; records what torch hands a plugin
    seen.append(opts.split_from)
    return c10d.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, timeout=opts.timeout)
dist.Backend.register_backend("splitprobe", make, extended_api=True, devices=["cpu", "cuda"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
default = c10d._get_default_group()
# init_process_group(device_id=cuda:i) binds the default group by setting this field (torch
# refuses a CPU device_id); the gloo default backend supports splitting, as NCCL does.
default.bound_device_id = torch.device("cuda", 0)
assert c10d._get_split_source(default) is not None
pg = open_update_group("splitprobe", "127.0.0.1", free_port(), 1, 0, "weights-probe", 30)
assert seen == [None], f"the update group was split from the default group's backend: {seen}"
assert default.bound_device_id == torch.device("cuda", 0), "the binding was not put back"
t = torch.ones(3)
dist.broadcast(t, src=0, group=pg)
print("ok")
'''


def test_the_update_group_is_never_split_from_a_bound_default_group():
    """A default group bound to a device (the Slurm/torchrun launch) must not make torch build the
    trainer-to-servers group by splitting the default communicator: the split is collective over
    the trainer's world, where the servers are not, and the first broadcast hangs. Run in a fresh
    process with a real default group; the backend plugin sees what torch would hand NCCL."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BOUND_DEFAULT_GROUP], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


SIGNALED_MANAGER = r"""
import gc, os, signal, subprocess, sys, tempfile, time
import torch
from megapkl.rollout.sglang.weights import SyncSettings, WeightSync, serialize_named_tensors
from megapkl.rollout.version_store import VersionStore
if sys.argv[1] == "stored":  # the first shared segment: a stored version read into the sync's
    store = VersionStore(tempfile.mkdtemp())
    store.save(1, [("w", torch.randn(1000))])
    sync = WeightSync(SyncSettings(mode="tensor"))
    alive = next(sync._tensor_buckets(store.get(1), sync._buffers))
    del sync  # the segment goes with the last holder: `alive`, below
else:
    _, alive = serialize_named_tensors([("w", torch.randn(1000))])
managers = subprocess.run(["pgrep", "-f", "torch_shm_manager", "-P", str(os.getpid())],
                          capture_output=True, text=True).stdout.split()
assert managers, "no shared-memory manager was started"
for pid in managers:  # what a preemption or scancel does to every process of the step
    os.kill(int(pid), signal.SIGTERM)
time.sleep(0.5)
del alive
gc.collect()
_, alive = serialize_named_tensors([("w", torch.randn(1000))])
del alive
print("alive")
"""


@pytest.mark.parametrize("first", ["serialized", "stored"])
def test_a_job_signal_to_torchs_shared_memory_manager_does_not_abort_the_trainer(first):
    """The tensor sync's shared memory is tracked by torch's `torch_shm_manager`, a child of
    the trainer that a preemption's SIGTERM reaches too. If it dies, the next freed segment aborts
    the trainer (`std::system_error: Broken pipe`, exit 134) before its preemption checkpoint;
    started deaf to job signals (megapkl/rollout/shm.py), it outlives them, whichever shared
    segment comes first (a weight payload, or a stored version read for a per-node push)."""
    out = subprocess.run([sys.executable, "-c", SIGNALED_MANAGER, first], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and "alive" in out.stdout, (out.returncode, out.stderr[-2000:])
