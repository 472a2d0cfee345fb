"""Colocated memory handling (megapkl/rollout/sglang/weight_state.py) against servers that behave
as SGLang does on its memory routes (sglang_recorder.py, launched through the fleet's own restart
path, and `megapkl serve` for a generation in flight):

- a colocated server is restarted only while the trainer has handed its GPU memory over (SGLang
  sizes its KV cache from the memory free at its start), and released again before the trainer
  takes the GPU back; a restarted server is never asked to resume memory it never released;
- a release or resume is kept per server exactly as each answered: a partly failed one probes
  nobody with a generation and resumes nobody twice (either ends an SGLang server);
- a release never meets a running /health_generate probe, nor a generation left running by a
  failed request (SGLang asserts an idle scheduler there, and the assertion ends the server)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sglang_fixtures import free_port
from sglang_recorder import read_state
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.client import SGLangEngine
from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
from megapkl.rollout.sglang.launch import ServerSpec, wait_healthy
from megapkl.rollout.sglang.weights import SyncSettings, WeightSync

RECORDER = Path(__file__).with_name("sglang_recorder.py")


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.mlp.up_proj.weight", torch.randn(48, 32, generator=g)),
            ("model.norm.weight", torch.randn(32, generator=g))]


_state = read_state


@pytest.fixture
def colocated(tmp_path):
    """An engine over `n` launched recorder servers (colocated: memory released after use)."""
    made = []

    def make(n=1, health_delay=0.0, mode="tensor", busy_file=None):
        workers = []
        for i in range(n):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, str(RECORDER), str(port), "--health-delay", str(health_delay)]
            if busy_file is not None:
                cmd += ["--gpu-busy-file", str(busy_file)]
            w = Worker(url, spec=ServerSpec(i, url, cmd, tmp_path / f"engine{i}.log"))
            w.process = w.spec.process().start()
            workers.append(w)
        fleet = Fleet(workers, health=HealthSettings(interval_s=0.2, timeout_s=10,
                                                     max_failures=1, deadline_s=120))
        for w in workers:
            wait_healthy(w.process, w.url, first_wait_s=0, interval_s=0.1, timeout_s=5,
                         deadline_s=120)
        sync = WeightSync(SyncSettings(mode=mode, colocate=True, pause_mode="in_place",
                                       timeout_s=30))
        engine = SGLangEngine(fleet, {}, sync, heartbeat=False)
        made.append(engine)
        return (engine, *workers)

    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_a_restarted_server_gets_the_weights_without_a_resume(colocated, mode):
    """...and, syncing by broadcast, in a new update group (the fresh server is in no group)."""
    engine, w = colocated(mode=mode)
    engine.update_weights(_weights(), version=1)
    engine.idle()  # the trainer has the GPU
    assert w.held.released
    w.process.stop(grace_s=1.0)  # the server dies while its memory is released
    engine.weight_state.hold()  # the next generation: the trainer hands the memory over
    engine.fleet.beat()  # dead -> restarted -> resynced -> ready
    assert w.state == "ready" and w.restarts == 1, w.describe()
    st = _state(w.url)
    assert not st["violations"] and not st["dead"], st["violations"]
    assert "resume_memory_occupation" not in st["routes"]
    assert st["version"] == "1" and set(st["weights"]) == {n for n, _ in _weights()}


def test_a_colocated_server_restarts_only_while_the_trainer_has_handed_its_memory_over(
        colocated, tmp_path):
    """SGLang sizes its memory pools from the GPU memory free when it starts: a server restarted
    beside the training trainer would get a tiny KV cache (or none). The recorder notes whether
    the trainer held the GPU (the busy file) when it started. Before: the heartbeat restarted it
    at once, mid-step, and it was never released before training went on."""
    busy = tmp_path / "trainer_holds_the_gpu"
    engine, w = colocated(busy_file=busy)
    engine.update_weights(_weights(), version=1)
    engine.idle()
    busy.write_text("")  # training
    w.process.stop(grace_s=1.0)
    for _ in range(2):
        engine.fleet.beat()
    assert w.state == "dead" and w.restarts == 0, engine.fleet.events  # not beside training
    busy.unlink()
    engine.weight_state.hold()  # a generation: the trainer's memory is handed over
    engine.fleet.beat()
    assert w.state == "ready" and w.restarts == 1, engine.fleet.events
    engine.idle()
    st = _state(w.url)
    assert not st["started_beside_trainer"] and st["released"] and w.held.released, st
    assert not st["violations"], st["violations"]


def test_a_push_to_a_fleet_whose_servers_all_died_during_training_restarts_them(colocated):
    """The fleet's only server dies while the trainer trains (no restart then: not beside
    training). The next push is the trainer handing its memory over: the server is restarted and
    takes the new version. Before: the push waited for a server to push to, the restart for the
    push to open the window, until no_engine_timeout_s (a two-node Slurm job hung on it)."""
    engine, w = colocated()
    engine.update_weights(_weights(), version=1)
    engine.idle()
    w.process.stop(grace_s=1.0)
    engine.fleet.beat()
    assert w.state == "dead" and w.restarts == 0, engine.fleet.events
    engine.fleet.start_heartbeat()
    push = threading.Thread(target=engine.update_weights, args=(_weights(), 2), daemon=True)
    push.start()
    push.join(timeout=90)
    assert not push.is_alive(), f"the push waits: {engine.fleet.events}"
    assert w.state == "ready" and w.restarts == 1 and w.held.version == 2, engine.fleet.events
    assert _state(w.url)["version"] == "2"


def test_a_release_waits_for_a_restart_under_way_and_releases_it_too(colocated):
    """The trainer takes the GPU back while the heartbeat is restarting a server (inside the
    window): the release waits for it and releases it, so the trainer never trains beside a
    server that holds memory."""
    engine, w = colocated()
    engine.update_weights(_weights(), version=1)
    w.process.stop(grace_s=1.0)
    engine.weight_state.hold()
    beat = threading.Thread(target=engine.fleet.beat)
    beat.start()
    deadline = time.monotonic() + 30
    while w.restarts == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.idle()  # while the restart waits for the server to answer
    beat.join()
    assert w.state == "ready" and w.held.released, engine.fleet.events
    assert _state(w.url)["released"]


def test_a_partly_failed_release_is_kept_per_server(colocated):
    """Two servers: the first refuses the release. Each is kept as it answered: the second is
    released (and not probed with a generation, which would end it), the first, whose memory is in
    an unknown state, is declared dead. Before: nothing was recorded as released and every ready
    worker got a /health_generate probe, the released one included."""
    engine, a, b = colocated(n=2)
    engine.update_weights(_weights(), version=1)
    http.request(a.url, "/fail_on", {"route": "release_memory_occupation"}, method="POST",
                 timeout=10)
    engine.idle()
    assert a.state == "dead" and not a.process.alive(), a.describe()
    assert b.held.released and b.state == "ready", b.describe()
    engine.fleet.beat()  # a released server is probed without a generation
    st = _state(b.url)
    assert not st["violations"] and not st["dead"], st["violations"]
    engine.weight_state.hold()  # the next generation: b resumes once, a comes back
    engine.fleet.beat()
    engine.idle()
    st = _state(b.url)
    assert st["routes"].count("resume_memory_occupation") == 1 and not st["violations"], st
    assert a.state == "ready" and a.restarts == 1, engine.fleet.events


def test_a_partly_failed_resume_resumes_nobody_twice(colocated):
    """The first server refuses its resume; the second takes its memory back. A later resume
    must not ask the second again: SGLang's `offload_tags.remove` raises for a tag that is not
    released and its scheduler dies. Before: the released set kept both, and the next resume
    killed the second."""
    engine, a, b = colocated(n=2)
    engine.update_weights(_weights(), version=1)
    engine.idle()
    http.request(a.url, "/fail_on", {"route": "resume_memory_occupation"}, method="POST",
                 timeout=10)
    engine.weight_state.hold()
    assert a.state == "dead" and not b.held.released, (a.describe(), b.describe())
    engine.weight_state.hold()  # a second hold (a push after a generation): nothing to resume
    engine.idle()
    st = _state(b.url)
    assert not st["violations"] and not st["dead"], st["violations"]
    assert st["routes"].count("resume_memory_occupation") == 1 and st["released"]


def test_a_release_waits_for_a_running_health_probe(colocated):
    engine, w = colocated(health_delay=1.0)
    engine.update_weights(_weights(), version=1)
    probe = threading.Thread(target=engine.fleet._alive, args=(w,))
    probe.start()
    time.sleep(0.3)  # the heartbeat's /health_generate is generating now
    engine.idle()
    probe.join()
    engine.fleet.beat()  # released: probed with /model_info, not a generation
    st = _state(w.url)
    assert not st["violations"], st["violations"]
    assert st["released"] and w.state == "ready"
    after = st["routes"][st["routes"].index("release_memory_occupation"):]
    assert "health_generate" not in after, st["routes"]


def test_a_failed_generation_leaves_its_server_idle_before_the_release(tmp_path):
    """A request times out on the client while `megapkl serve` still generates it (each decode
    step slowed). The release that follows must not meet it: SGLang asserts an idle scheduler
    and its assertion ends the server, which the stand-in does too. The server is made idle
    first (an aborting pause, a flush), released, and lives on."""
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import EmbeddedEngine
    from megapkl.rollout.engine import RolloutEngineError, SamplingParams
    from megapkl.rollout.sample import PromptItem

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3",
           "--port", str(port), "--step-delay-s", "0.2", "--log-level", "warning"]
    w = Worker(url, spec=ServerSpec(0, url, cmd, tmp_path / "engine0.log"))
    w.process = w.spec.process().start()
    hf = hf_config_dict(load_spec("tiny-qwen3"), dtype="float32")
    fleet = Fleet([w], health=HealthSettings(interval_s=60, timeout_s=20, max_failures=1,
                                             deadline_s=240, no_engine_timeout_s=5))
    engine = SGLangEngine(fleet, hf, WeightSync(SyncSettings(mode="tensor", colocate=True,
                                                             timeout_s=60)),
                          heartbeat=False, request_timeout_s=1.0, max_retries=0)
    try:
        wait_healthy(w.process, url, first_wait_s=0, interval_s=0.2, timeout_s=20,
                     deadline_s=240, route="model_info")
        weights = list(EmbeddedEngine(hf, seed=0).model.state_dict().items())
        engine.update_weights(weights, version=1)
        with pytest.raises(RolloutEngineError):
            engine.generate([PromptItem(torch.tensor([3, 4, 5]))], 1,
                            SamplingParams(max_new_tokens=60, ignore_eos=True, seed=1))
        info = http.request(url, "server_info", timeout=20)
        assert w.process.alive(), (tmp_path / "engine0.log").read_text()[-2000:]
        assert info["internal_states"][0]["released_tags"] and w.held.released, info
        assert info["internal_states"][0]["paused"] is None  # generation let continue
    finally:
        engine.close()


def _changes_of_held(tree) -> list[int]:
    """Lines that assign what a server holds: `x.held = ...`, `x.held.version = ...`, ... (plain,
    augmented or annotated assignments, tuple targets included)."""
    import ast

    def held(node) -> bool:
        return isinstance(node, ast.Attribute) and (
            node.attr == "held" or (isinstance(node.value, ast.Attribute)
                                    and node.value.attr == "held"))

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            if any(held(n) for n in ast.walk(t)):
                found.append(node.lineno)
    return found


def test_what_each_server_holds_is_changed_by_its_owner_alone():
    """One owner of each server's weight state (its version, whether its memory is released):
    weight_state.py, under the fleet's lock. The fleet, the engine and the weight sync ask it and
    never change it themselves (where they did, a partly failed release or resume left the
    state of one server kept in several places, none of them as the server answered)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "megapkl"
    owner = root / "rollout" / "sglang" / "weight_state.py"
    elsewhere = {str(p.relative_to(root)): lines for p in sorted(root.rglob("*.py"))
                 if p != owner and (lines := _changes_of_held(ast.parse(p.read_text())))}
    assert not elsewhere, f"a server's weight state changed outside weight_state.py: {elsewhere}"
    assert _changes_of_held(ast.parse(owner.read_text()))  # (the check sees the owner's changes)
    assert _changes_of_held(ast.parse("w.held.released = True\na, w.held = 1, 2\n")) == [1, 2]
