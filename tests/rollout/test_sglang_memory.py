"""Colocated memory handling against servers that behave as SGLang does on its memory routes
(sglang_recorder.py, launched through the fleet's own restart path): a restarted server is never
asked to resume memory it never released (SGLang's scheduler dies of it), a release never meets a
running /health_generate probe (SGLang asserts it is idle), and a released server is only probed
with /health."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sglang_recorder import read_state
from megapkl.rollout.sglang.client import SGLangEngine
from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
from megapkl.rollout.sglang.launch import ServerSpec, wait_healthy
from megapkl.rollout.sglang.weights import SyncSettings, WeightSync, free_port

RECORDER = Path(__file__).with_name("sglang_recorder.py")


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.mlp.up_proj.weight", torch.randn(48, 32, generator=g)),
            ("model.norm.weight", torch.randn(32, generator=g))]


_state = read_state


@pytest.fixture
def colocated(tmp_path):
    """An engine over one launched recorder server (colocated: memory released after use)."""
    made = []

    def make(health_delay=0.0, mode="tensor"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, str(RECORDER), str(port), "--health-delay", str(health_delay)]
        w = Worker(url, spec=ServerSpec(0, url, cmd, tmp_path / "engine0.log"))
        w.process = w.spec.process().start()
        fleet = Fleet([w], health=HealthSettings(interval_s=0.2, timeout_s=10, max_failures=1,
                                                 deadline_s=120))
        wait_healthy(w.process, url, first_wait_s=0, interval_s=0.1, timeout_s=5,
                     deadline_s=120)
        sync = WeightSync(SyncSettings(mode=mode, colocate=True, pause_mode="in_place",
                                       timeout_s=30))
        engine = SGLangEngine(fleet, {}, sync, heartbeat=False)
        made.append(engine)
        return engine, w

    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_a_restarted_server_gets_the_weights_without_a_resume(colocated, mode):
    """...and, syncing by broadcast, in a new update group (the fresh server is in no group)."""
    engine, w = colocated(mode=mode)
    engine.update_weights(_weights(), version=1)
    engine._colocated_memory(release=True)  # after a generate: the trainer has the GPU
    assert engine.sync.released == {w.url}
    w.process.stop(grace_s=1.0)  # the server dies while its memory is released
    engine.fleet.beat()  # dead -> restarted -> resynced -> ready
    assert w.state == "ready" and w.restarts == 1, w.describe()
    st = _state(w.url)
    assert not st["violations"] and not st["dead"], st["violations"]
    assert "resume_memory_occupation" not in st["routes"]
    assert st["version"] == "1" and set(st["weights"]) == {n for n, _ in _weights()}


def test_a_release_waits_for_a_running_health_probe(colocated):
    engine, w = colocated(health_delay=1.0)
    engine.update_weights(_weights(), version=1)
    probe = threading.Thread(target=engine.fleet._alive, args=(w,))
    probe.start()
    time.sleep(0.3)  # the heartbeat's /health_generate is generating now
    engine._colocated_memory(release=True)
    probe.join()
    engine.fleet.beat()  # released: probed with /health, not a generation
    st = _state(w.url)
    assert not st["violations"], st["violations"]
    assert st["released"] and w.state == "ready"
    after = st["routes"][st["routes"].index("release_memory_occupation"):]
    assert "health_generate" not in after, st["routes"]
