"""Work on threads megapkl starts runs on the rank's CUDA device, not on GPU 0.

CUDA's current device belongs to a thread: a new thread starts on device 0 whatever its starter
set. A leader whose local rank is 1 (its main thread on cuda:1) generating ahead of training, or
resyncing a server from the heartbeat, would flatten its weight buckets on GPU 0 and open a second
NCCL communicator there. There is no GPU here, so CUDA's per-thread current device is emulated
(`torch.cuda.set_device` / `current_device` per thread, device 0 for a new thread, as the CUDA
runtime does) and the real components run on it: the producer's thread, the fleet's heartbeat and
its resync, the weight sync's layout thread. tools/gpu_checks/threads_gpu.py checks the same on
two GPUs; tests/test_device_discipline.py checks that every thread megapkl starts goes through the
helpers that set the device."""
from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))  # the SGLang stand-ins


@pytest.fixture
def on_device_1(monkeypatch):
    """This process as local rank 1: its main thread on cuda:1, new threads on device 0."""
    per_thread = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(per_thread, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: setattr(per_thread, "device", int(getattr(d, "index", d))))
    torch.cuda.set_device(1)
    yield
    per_thread.device = 0


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_the_helpers_start_threads_on_the_starters_device(on_device_1):
    from megapkl.parallel.threads import rank_executor, start_thread

    seen = []
    start_thread(lambda: seen.append(torch.cuda.current_device()), name="t").join()
    with rank_executor(2, "p") as pool:
        seen += list(pool.map(lambda _: torch.cuda.current_device(), range(4)))
    bare = []
    t = threading.Thread(target=lambda: bare.append(torch.cuda.current_device()))
    t.start()
    t.join()
    assert seen == [1] * 5 and bare == [0]  # (the emulation: a bare thread starts on device 0)


def test_generation_ahead_runs_on_the_ranks_device(on_device_1):
    from megapkl.train.producer import Producer

    devices = []

    def work(key):
        devices.append(torch.cuda.current_device())
        return key

    producer = Producer(work, versions=lambda k: [], failed=lambda r: False,
                        on_error=lambda e: None)
    try:
        producer.plan(["a", "b"])
        assert producer.take("a") == "a" and producer.take("b") == "b"
    finally:
        producer.stop()
    assert devices == [1, 1]


class _Answers200(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_the_heartbeats_resync_runs_on_the_ranks_device(on_device_1):
    from sglang_fixtures import Owner

    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers200)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    devices = []

    class Recording(Owner):
        def resync(self, workers):
            devices.append(torch.cuda.current_device())

    w = Worker(f"http://127.0.0.1:{server.server_address[1]}", state="stale")
    fleet = Fleet([w], health=HealthSettings(interval_s=0.05, timeout_s=5))
    fleet.bind(Recording(version=0))
    fleet.start_heartbeat()
    try:
        assert _wait(lambda: devices), fleet.events
    finally:
        fleet.close()
        server.shutdown()
        server.server_close()
    assert devices[0] == 1 and w.state == "ready"


def test_the_weight_syncs_threads_run_on_the_ranks_device(on_device_1):
    """The tensor sync lays each bucket out (and runs its transform, the FP8 seam) on a thread
    of its own while the servers load the previous one."""
    from sglang_recorder import Recorder, make_server

    from megapkl.rollout.sglang.weights import SyncSettings, Target, WeightSync

    servers = [make_server(Recorder()) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    devices = []

    def transform(bucket):
        devices.append(torch.cuda.current_device())
        return bucket

    sync = WeightSync(SyncSettings(mode="tensor", bucket_bytes=64, timeout_s=30),
                      transform=transform)
    try:
        weights = [(f"w{i}", torch.full((16,), float(i))) for i in range(3)]
        sync.push([Target(f"http://127.0.0.1:{s.server_address[1]}") for s in servers],
                  weights, version=1)
    finally:
        sync.close()
        for s in servers:
            s.shutdown()
            s.server_close()
    assert devices == [1, 1, 1]
