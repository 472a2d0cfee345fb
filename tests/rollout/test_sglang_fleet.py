"""SGLangEngine end to end: two `megapkl serve` workers launched through rollout.sglang's own
launcher (server_command) behind the real sglang-router; generation, the three weight-sync modes,
faults (SIGSTOP / SIGKILL mid-batch, a restarted worker with stale weights) and bad input."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time

import pytest
import torch

from megapkl.rollout.engine import RolloutEngineError, SamplingParams, WeightUpdateError
from megapkl.rollout.sample import PromptItem
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.fleet import EnginesUnavailable, Fleet, HealthSettings, Worker
from megapkl.rollout.sglang.launch import ServerLaunchError

pytestmark = pytest.mark.skipif(shutil.which("true") is None, reason="needs a POSIX shell")
SERVE = ["{python}", "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3",
         "--host", "{host}", "--port", "{port}"]


def _cfg(tmp, extra=()):
    from megapkl.config.loader import load_config

    return load_config("configs/demo/cpu_demo.yaml", [
        "rollout.engine=sglang", f"rollout.sglang.server_command={json.dumps(SERVE)}",
        "rollout.sglang.num_engines=2", f"run_dir={tmp}", "rollout.sglang.health_interval_s=0.5",
        "rollout.sglang.health_timeout_s=3", "rollout.sglang.startup_timeout_s=240",
        "rollout.sglang.no_engine_timeout_s=120", "rollout.sglang.base_port=30200",
        "rollout.sglang.bucket_mb=0.05", *extra])


def _hf():
    from megapkl.models.spec import hf_config_dict, load_spec

    return hf_config_dict(load_spec("tiny-qwen3"), dtype="float32")


def _build(cfg):
    from engine_contexts import context_of
    from megapkl.rollout.sglang.build import build_sglang_engine

    return build_sglang_engine(cfg.rollout, context_of(cfg, _hf()))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not os.path.isdir("configs/demo"):
        pytest.skip("run from the repository root")
    eng = _build(_cfg(tmp_path_factory.mktemp("fleet")))
    yield eng
    eng.close()
    assert all(not w.process.alive() for w in eng.fleet.workers) and not eng.fleet.router.alive()


@pytest.fixture(scope="module")
def reference():
    from megapkl.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(_hf(), seed=0)


def _weights(reference, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g) * 0.1) for n, p in
            reference.model.state_dict().items()]


def _prompts(k, length=3):
    return [PromptItem(torch.arange(1 + i, 1 + i + length) % 100 + 3) for i in range(k)]


def _recompute(reference, weights, sample):
    reference.update_weights(weights, version=0)
    seq = sample.sequence[:-1][None]
    with torch.no_grad():
        logits = reference.model(input_ids=seq).logits[0, sample.prompt_len - 1:].float()
    return torch.log_softmax(logits / sample.temperature, -1)


def test_generate_through_router_matches_trainer_recompute(engine, reference):
    w = _weights(reference, 1)
    engine.update_weights(w, version=1)
    s = SamplingParams(max_new_tokens=5, temperature=0.8, topk_logprobs=4, seed=7)
    out = engine.generate(_prompts(3), n=3, sampling=s)
    assert len(out) == 9 and [x.uid for x in out] == list(range(out[0].uid, out[0].uid + 9))
    assert [x.group_id for x in out] == [out[0].group_id + i // 3 for i in range(9)]
    assert {x.version for x in out} == {1} and all(x.response_len == 5 for x in out)
    assert len({tuple(x.response_ids.tolist()) for x in out}) > 3  # n draws differ
    for x in out:
        logp = _recompute(reference, w, x)
        assert torch.allclose(x.logp_behav, logp.gather(1, x.response_ids[:, None])[:, 0],
                              atol=1e-4)
        assert torch.allclose(x.topk_logp, logp.topk(4, -1).values, atol=1e-4)


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_each_sync_mode_servers_hold_trainer_weights(engine, reference, mode):
    version = {"tensor": 11, "distributed": 12, "disk": 13}[mode]
    w = _weights(reference, version)
    engine.sync.s.mode = mode
    try:
        engine.update_weights(w, version=version)
    except WeightUpdateError:
        print(engine.sync.trace[-30:], engine.fleet.events)
        raise
    finally:
        engine.sync.s.mode = "tensor"
    for wk in engine.fleet.workers:
        assert http.request(wk.url, "model_info", timeout=10)["weight_version"] == str(version)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    reference.update_weights(w, version=version)
    expect = reference.generate(_prompts(1), n=1, sampling=greedy)[0]
    for wk in engine.fleet.workers:  # ask each worker directly: both must hold exactly w
        from megapkl.rollout.sglang.protocol import decode_response, generate_payload

        body = generate_payload(_prompts(1)[0].prompt_ids.tolist(), greedy, 1)
        d = decode_response(http.request(wk.url, "generate", body, timeout=60), prompt_len=3,
                            sampling=greedy)
        assert d.version == version and torch.equal(d.response_ids, expect.response_ids)
        assert torch.equal(d.logp, expect.logp_behav)  # same floats: same weights, bit for bit


def test_pushes_add_no_listed_worker_and_a_readmitted_one_is_routed_on_return(engine,
                                                                               reference):
    """Every push admits its targets, which the router lists already: no second add, a job of
    the router's that probes the server's /health (a generation on SGLang, fatal to a colocated
    server whose memory is released by the time it lands) and is then refused ("already
    exists"). A worker retired and re-admitted is listed again when `admit` returns: the
    router's remove and add are jobs it runs later, and the add once met the remove not yet
    done."""
    router_log = engine.fleet.router.log_path

    def refused() -> int:
        return router_log.read_text(errors="replace").count("already exists")

    before = refused()
    engine.update_weights(_weights(reference, 21), version=21)
    engine.update_weights(_weights(reference, 22), version=22)
    time.sleep(1.0)  # the router's jobs run in the background
    assert refused() == before

    def listed() -> set:
        got = http.request(engine.fleet.router_url, "/workers", method="GET", timeout=10)
        return {e["url"] for e in got["workers"]}

    w = engine.fleet.workers[0]
    for _ in range(5):
        engine.fleet.retire(w, "stale", "taken out by the test")
        assert w.url not in listed()
        engine.fleet.admit([w])
        assert w.url in listed() and w.state == "ready"


def test_trainer_runs_through_router(engine, dist_run, tmp_path):
    """`rollout.engine: sglang` in the real trainer (megatron-core learner), against the fixture's
    workers and router given as urls/router_url (the fixture's heartbeat pauses meanwhile)."""
    from megapkl.config import load_config
    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    fleet = engine.fleet
    _pause_heartbeat(fleet)  # the trainer's own engine manages the workers meanwhile
    urls = json.dumps([w.url for w in engine.fleet.workers])
    cfg = load_config("configs/demo/cpu_demo.yaml", [
        "logging.tensorboard=false", "logging.progress_bar=false", "checkpoint.every=0",
        "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4", "parallel.data=1",
        "parallel.micro_batch_size=4", "train.steps=5", "rollout.refresh_every=2",
        f"run_dir={tmp_path / 'run'}", "rollout.engine=sglang", f"rollout.sglang.urls={urls}",
        f"rollout.sglang.router_url={engine.fleet.router_url}",
        "rollout.sglang.weight_sync=distributed"])
    try:
        with _holding(engine):
            dist_run(_rank_main, 1, cfg, timeout=300)
    finally:
        fleet.start_heartbeat()  # the workers now hold version 4: the fixture resyncs them
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 5 and all(math.isfinite(r["loss"]) for r in rows)
    assert [r["staleness/max"] for r in rows] == [0, 1, 0, 1, 0]  # versions as the servers report
    for w in engine.fleet.workers:
        assert http.request(w.url, "model_info", timeout=10)["weight_version"] == "4"


@contextlib.contextmanager
def _holding(engine):
    """The fixture's colocated servers hold their memory for the block (released again after it
    if they were before): another engine connects to them by `urls`, and its /health probe is a
    generation, which ends a released server."""
    released = any(w.held.released for w in engine.fleet.workers)
    engine.weight_state.hold()
    try:
        yield
    finally:
        if released:
            engine.idle()


def _pause_heartbeat(fleet):
    """Stop the fixture's heartbeat while another engine drives its workers (start_heartbeat
    resumes it and resyncs them). A stop is meant for the way out and closes the fleet's
    connections: they are opened again here."""
    fleet.stop_heartbeat()
    fleet._stop, fleet._thread = threading.Event(), None
    fleet.connections.closed = False


def _left_over(threads_before, groups_before, deadline_s=10.0):
    """(threads, process groups) that appeared since and are still there; a shut request pool's
    idle threads and an aborted group's destroy take a moment to go."""
    from torch.distributed import distributed_c10d as c10d

    t0 = time.monotonic()
    while True:
        threads = [t.name for t in threading.enumerate() if t not in threads_before]
        groups = set(c10d._world.pg_names.values()) - groups_before
        if not (threads or groups) or time.monotonic() - t0 > deadline_s:
            return threads, groups
        time.sleep(0.1)


def test_closed_engines_leave_no_thread_group_or_membership(engine, reference):
    """An engine over the fixture's servers, after a normal run (a distributed sync; seeded
    groups sent as to servers under --enable-deterministic-inference, a seed per response) and
    after a failed push (a bucket the servers refuse once received): close leaves none of its
    threads or process groups, and the servers have left its groups. (Its launched servers: see
    the fixture's teardown and the next test.)"""
    from torch.distributed import distributed_c10d as c10d

    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync

    fleet = engine.fleet
    _pause_heartbeat(fleet)
    threads, groups = set(threading.enumerate()), set(c10d._world.pg_names.values())
    seeded = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    try:
        for failing in (False, True):
            eng = SGLangEngine(Fleet([Worker(w.url) for w in fleet.workers], deterministic=True,
                                     health=HealthSettings(interval_s=0.5, timeout_s=10)),
                               _hf(), WeightSync(SyncSettings(mode="distributed", timeout_s=60)))
            eng.update_weights(_weights(reference, 41), version=41)
            out = eng.generate(_prompts(2), n=3, sampling=seeded)
            assert len(out) == 6 and {x.version for x in out} == {41}
            assert len({tuple(x.response_ids.tolist()) for x in out[:3]}) > 1  # own seeds
            name = eng.sync._group[2]
            if failing:
                with pytest.raises(WeightUpdateError, match="model.layers.0.bogus"):
                    eng.update_weights([("model.layers.0.bogus", torch.zeros(3))], version=42)
                assert eng.sync._group is None and name not in c10d._world.pg_names.values()
            eng.close()
            assert _left_over(threads, groups) == ([], set()), f"failing={failing}"
            for w in fleet.workers:  # the server left the group: it has none of that name
                with pytest.raises(http.ServerError, match="does not exist"):
                    http.request(w.url, "destroy_weights_update_group", {"group_name": name},
                                 timeout=30)
    finally:
        fleet.start_heartbeat()


STUB = ["{python}", "-c", "import http.server as h, sys\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "h.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()",
        "{host}", "{port}"]


def test_servers_launched_for_an_engine_that_fails_to_build_are_stopped(tmp_path):
    """The fleet is launched, then the engine's constructor raises: the launched server does not
    outlive the error."""
    import psutil

    cfg = _cfg(tmp_path, [f"rollout.sglang.server_command={json.dumps(STUB)}",
                          "rollout.sglang.num_engines=1", "rollout.sglang.use_router=false",
                          "rollout.sglang.base_port=30400"])
    cfg.rollout.sglang.max_concurrency = 0  # past the config's check: the request pool refuses it
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with pytest.raises(ValueError, match="max_workers"):
        _build(cfg)
    assert [p.cmdline() for p in me.children(recursive=True) if p.pid not in before] == []


def _signal_soon(proc, sig, delay):
    t = threading.Timer(delay, lambda: os.killpg(proc.popen.pid, sig))
    t.start()
    return t


def test_faults_hung_and_killed_workers_mid_batch(engine, reference):
    w = _weights(reference, 21)
    engine.update_weights(w, version=21)
    s = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    w0, w1 = engine.fleet.workers
    # A hung worker (SIGSTOP) mid-batch: declared dead by the heartbeat, its requests retried.
    _signal_soon(w1.process, signal.SIGSTOP, 1.0).join()
    out = engine.generate(_prompts(6), n=2, sampling=s)
    assert len(out) == 12 and {x.version for x in out} == {21}
    assert all(x.response_len == 24 for x in out)
    # It is killed, restarted with stale (random) weights, resynced, then re-admitted.
    t0 = time.monotonic()
    while w1.state != "ready" or w1.restarts < 1:
        assert time.monotonic() - t0 < 150, "\n".join(map(str, engine.fleet.events))
        time.sleep(0.5)
    assert http.request(w1.url, "model_info", timeout=10)["weight_version"] == "21"
    events = [e for _, url, e in engine.fleet.events if url == w1.url]
    assert any(e.startswith("dead") for e in events) and "restart 1" in events
    # A killed worker (SIGKILL) mid-batch: the batch completes on the other one.
    killer = _signal_soon(w0.process, signal.SIGKILL, 1.0)
    out = engine.generate(_prompts(6), n=2, sampling=s)
    killer.join()
    assert len(out) == 12 and {x.version for x in out} == {21}
    x = out[0]
    logp = _recompute(reference, w, x)
    assert torch.allclose(x.logp_behav, logp.gather(1, x.response_ids[:, None])[:, 0], atol=1e-4)


def test_bad_input_names_the_key(engine, reference):
    w = _weights(reference, 31)
    engine.update_weights(w, version=31)
    with pytest.raises(WeightUpdateError, match="model.layers.0.bogus"):
        engine.update_weights([("model.layers.0.bogus", torch.zeros(3))], version=32)
    name, t = w[1]
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.update_weights([(name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))], version=32)
    assert engine.version == 31
    with pytest.raises(ValueError, match="model.routing_replay"):
        engine.generate(_prompts(1), n=1, sampling=SamplingParams(max_new_tokens=2,
                                                                 return_routed_experts=True))
    with pytest.raises(ValueError, match="rollout.topk_logprobs"):
        engine.generate(_prompts(1), n=1, sampling=SamplingParams(max_new_tokens=2,
                                                                 topk_logprobs=100000))


def test_urls_serving_other_flags_are_refused_before_any_request(engine, tmp_path):
    """Servers named by urls are compared with the run config when the engine connects
    (served.py, contract-tested against SGLang's own /server_info in tests/contract): the
    fixture's workers are `megapkl serve` stand-ins at TP 1 serving tiny-qwen3."""
    urls = [f"rollout.sglang.urls={json.dumps([w.url for w in engine.fleet.workers])}"]
    with _holding(engine):
        _build(_cfg(tmp_path, urls)).close()  # the same flags: it connects
        with pytest.raises(ServerLaunchError, match=r"^rollout.sglang.urls\[0\]: http://\S+ "
                           r"was started with --tp-size 1, rollout.sglang.tp is 2 "):
            _build(_cfg(tmp_path, [*urls, "rollout.sglang.tp=2"]))


def test_router_unreachable_and_unhealthy_servers(engine, tmp_path):
    live = engine.fleet.workers[1].url
    fast = ["rollout.sglang.startup_timeout_s=2", "rollout.sglang.health_interval_s=0.2"]
    cfg = _cfg(tmp_path, [f"rollout.sglang.urls=[\"{live}\"]",
                          "rollout.sglang.router_url=http://127.0.0.1:9", *fast])
    with _holding(engine), pytest.raises(ServerLaunchError,
                                         match=r"rollout.sglang.router_url: http://127.0.0.1:9"):
        _build(cfg)
    cfg = _cfg(tmp_path, ["rollout.sglang.urls=[\"http://127.0.0.1:9\"]", *fast])
    with pytest.raises(ServerLaunchError, match=r"rollout.sglang.urls\[0\]"):
        _build(cfg)
    never = json.dumps([sys.executable, "-c", "import time; print('compiling'); time.sleep(60)"])
    cfg = _cfg(tmp_path, [f"rollout.sglang.server_command={never}", "rollout.sglang.num_engines=1",
                          "rollout.sglang.base_port=30300", *fast])
    with pytest.raises(ServerLaunchError, match="not healthy after 2 s") as info:
        _build(cfg)
    assert "engine0.log" in str(info.value) and "compiling" in str(info.value)
    crash = json.dumps([sys.executable, "-c", "raise SystemExit('bad flag --x')"])
    cfg = _cfg(tmp_path, [f"rollout.sglang.server_command={crash}", "rollout.sglang.num_engines=1",
                          "rollout.sglang.base_port=30300", *fast])
    with pytest.raises(ServerLaunchError, match="exited with code 1") as info:
        _build(cfg)
    assert "bad flag --x" in str(info.value)


def test_no_engine_for_too_long_names_engines_and_logs(tmp_path):
    from megapkl.rollout.sglang.launch import ServerSpec

    spec = ServerSpec(0, "http://127.0.0.1:9", ["true"], tmp_path / "engine0.log")
    w = Worker(spec.url, spec=spec, state="dead", restarts=3, last_error="3 failed checks")
    fleet = Fleet([w], health=HealthSettings(no_engine_timeout_s=0.3, interval_s=0.1,
                                             max_restarts=3))
    with pytest.raises(EnginesUnavailable) as info:
        fleet.pick()
    msg = str(info.value)
    assert "rollout.sglang.no_engine_timeout_s" in msg and "engine0.log" in msg
    assert "http://127.0.0.1:9 (dead" in msg and "3 failed checks" in msg
    assert isinstance(info.value, RolloutEngineError)



def test_a_fleet_fails_loudly_before_an_engine_binds_it():
    """The owner of the servers' weights (asleep, restarted, resync, may_recover) comes once, by
    bind; a fleet used before has no way to probe or resync a server, and says so."""
    from sglang_fixtures import Owner

    w = Worker("http://127.0.0.1:9", state="ready")
    fleet = Fleet([w], health=HealthSettings(timeout_s=1))
    for use in (fleet.start_heartbeat, lambda: fleet.report_failure(w.url, OSError("reset"))):
        with pytest.raises(RolloutEngineError, match="before an engine bound its weight owner"):
            use()
    owner = Owner()
    fleet.bind(owner)
    with pytest.raises(RolloutEngineError, match="bound to an engine already"):
        fleet.bind(owner)
    fleet.report_failure(w.url, OSError("reset"))  # bound: nobody answers there, it is dead
    assert w.state == "dead"


def test_weights_wait_for_a_server_still_starting(tmp_path):
    """A push finds no server ready yet (still starting, or slow on a busy machine): it waits up to
    no_engine_timeout_s for one to answer, as a request does. Before: EnginesUnavailable at once,
    naming a timeout it had not waited."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sglang_fixtures import free_port

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def log_message(self, *args):  # quiet
            pass

    port = free_port()
    w = Worker(f"http://127.0.0.1:{port}")  # stale: no weights yet
    fleet = Fleet([w], health=HealthSettings(no_engine_timeout_s=0.3, interval_s=0.05,
                                             timeout_s=2))
    from sglang_fixtures import Owner

    fleet.bind(Owner())
    with pytest.raises(EnginesUnavailable, match="no_engine_timeout_s"):
        with fleet.weight_targets():
            pass
    fleet.health.no_engine_timeout_s = 60
    servers = []

    def start_late():  # refused until then
        servers.append(ThreadingHTTPServer(("127.0.0.1", port), Healthy))
        servers[0].serve_forever()

    later = threading.Thread(target=lambda: (time.sleep(1.0), start_late()), daemon=True)
    t0 = time.monotonic()
    later.start()
    try:
        with fleet.weight_targets() as targets:
            assert targets == [w]
            assert time.monotonic() - t0 >= 1.0
            assert fleet.lock._is_owned()  # the push runs under the fleet lock
    finally:
        while not servers:
            time.sleep(0.05)
        servers[0].shutdown()
        servers[0].server_close()


def test_a_stopping_run_waits_for_no_server_and_restarts_none(tmp_path):
    """A stop signal or a Slurm preemption reaches the servers the trainer launched too: once the
    run is stopping, a request or a weight push finding no server gives up at once (the trainer
    checkpoints its finished updates) instead of waiting no_engine_timeout_s, and the heartbeat
    restarts nobody."""
    from megapkl.rollout.sglang.launch import ServerSpec

    spec = ServerSpec(0, "http://127.0.0.1:9", ["true"], tmp_path / "engine0.log")
    w = Worker(spec.url, spec=spec, state="dead", last_error="killed by SIGTERM")
    stopping = threading.Event()
    fleet = Fleet([w], health=HealthSettings(no_engine_timeout_s=600, interval_s=0.1),
                  stopping=stopping.is_set)
    threading.Timer(0.5, stopping.set).start()
    t0 = time.monotonic()
    with pytest.raises(EnginesUnavailable, match="the run is stopping") as info:
        fleet.pick()
    assert time.monotonic() - t0 < 5 and "killed by SIGTERM" in str(info.value)
    with pytest.raises(EnginesUnavailable, match="the run is stopping"):
        with fleet.weight_targets():
            pass
    fleet.beat()
    assert w.restarts == 0 and w.state == "dead"
    stopping.clear()  # nor does a beat that runs on once the heartbeat was told to stop (close)
    from sglang_fixtures import Owner

    fleet.bind(Owner())
    fleet.stop_heartbeat()
    fleet.beat()
    assert w.restarts == 0 and w.state == "dead"


def test_a_version_read_across_a_push_retires_nobody():
    """The heartbeat reads a ready server's weight version, and a push runs meanwhile: the
    server answers with the version it held before the push, the fleet's has moved on. That
    says nothing about the server (the push just gave it the new weights): it stays ready. Before:
    retired as stale ("reports weight version 4, current is 5") and resynced."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sglang_fixtures import free_port

    fleet_of: list = []

    class Server(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b"{}"
            if self.path == "/model_info":  # read at version 4, then a push to 5 completes
                body = json.dumps({"weight_version": "4"}).encode()
                with fleet_of[0].weight_targets():
                    fleet_of[0].owner.version = 5
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        w = Worker(f"http://127.0.0.1:{server.server_address[1]}", state="ready")
        fleet = Fleet([w], health=HealthSettings(interval_s=60, timeout_s=5))
        from sglang_fixtures import Owner

        owner = Owner(version=4)
        fleet.bind(owner)
        fleet_of.append(fleet)
        fleet.beat()
        assert fleet.version == 5 and w.state == "ready", fleet.events
        assert owner.resynced == [] and fleet.events == [], fleet.events
    finally:
        server.shutdown()
        server.server_close()


_ANSWERS_200 = """import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    do_POST = do_GET
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_the_heartbeat_restarted_outlives_the_heartbeat(tmp_path):
    """Linux sends a launched server its parent-death signal when the thread that started it
    ends. A server the heartbeat restarts is started by a thread of the fleet's own, which
    ends after the fleet has stopped its servers: it survives the heartbeat's stop, and the
    fleet's close stops it. Before: SIGKILLed (its process group left behind) the moment the
    heartbeat stopped."""
    from megapkl.rollout.sglang.launch import ServerSpec

    from sglang_fixtures import free_port

    script = tmp_path / "answers_200.py"
    script.write_text(_ANSWERS_200)
    port = free_port()
    spec = ServerSpec(0, f"http://127.0.0.1:{port}", [sys.executable, str(script), str(port)],
                      tmp_path / "engine0.log")
    w = Worker(spec.url, spec=spec, state="dead", last_error="killed")
    fleet = Fleet([w], health=HealthSettings(interval_s=0.1, timeout_s=5))
    from sglang_fixtures import Owner

    fleet.bind(Owner(version=0))
    fleet.start_heartbeat()
    try:
        deadline = time.monotonic() + 60
        while w.state != "ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.state == "ready" and w.restarts == 1, fleet.events
        fleet.stop_heartbeat()
        time.sleep(0.5)  # the signal is immediate
        assert w.process.alive(), f"exited with {w.process.popen.returncode}"
    finally:
        fleet.close()
    assert not w.process.alive()


def test_a_server_that_dies_while_stale_is_restarted(tmp_path):
    """A server waiting for weights (stale) whose process then exits (a colocated server dies
    when its resume finds no GPU memory, in the very resync that would re-admit it) is dead:
    restarted, resynced and admitted. Before: left stale for good, its process gone, while the
    run waited no_engine_timeout_s for it."""
    from megapkl.rollout.sglang.launch import ServerSpec

    from sglang_fixtures import free_port

    script = tmp_path / "answers_200.py"
    script.write_text(_ANSWERS_200)
    port = free_port()
    spec = ServerSpec(0, f"http://127.0.0.1:{port}", [sys.executable, str(script), str(port)],
                      tmp_path / "engine0.log")
    gone = ServerSpec(0, spec.url, [sys.executable, "-c", "pass"], spec.log_path).process()
    gone.start().popen.wait(30)
    w = Worker(spec.url, spec=spec, process=gone, state="stale", last_error="resync failed")
    from sglang_fixtures import Owner

    fleet = Fleet([w], health=HealthSettings(interval_s=0.1, timeout_s=5))
    owner = Owner(version=0)
    fleet.bind(owner)
    try:
        fleet.beat()
        assert w.restarts == 1 and w.state == "ready" and owner.resynced == [[w]], fleet.events
        assert w.process is not gone and w.process.alive()
    finally:
        fleet.close()


def test_a_restarted_server_that_lost_its_port_is_neither_synced_nor_admitted(tmp_path):
    """While a server is dead, another process of the host may take its port (another job's
    server). The restarted server then cannot bind, and the URL answers all the same: the
    fleet sees that the listener is not the process it launched, stops its own and leaves the
    worker dead (retried next beat). Before: the other process was resynced and admitted."""
    from megapkl.rollout.sglang.launch import ServerProcess, ServerSpec, holds_port

    from sglang_fixtures import free_port

    script = tmp_path / "answers_200.py"
    script.write_text(_ANSWERS_200)
    port = free_port()
    other = ServerProcess("other", f"http://127.0.0.1:{port}", [sys.executable, str(script),
                                                                 str(port)], tmp_path / "o.log")
    spec = ServerSpec(0, other.url, [sys.executable, "-c", "import time; time.sleep(60)"],
                      tmp_path / "engine0.log")  # alive, never binds: as one that lost the race
    w = Worker(spec.url, spec=spec, state="dead", last_error="killed")
    from sglang_fixtures import Owner

    fleet = Fleet([w], health=HealthSettings(interval_s=0.1, timeout_s=5))
    owner = Owner(version=0)
    fleet.bind(owner)
    other.start()
    try:
        deadline = time.monotonic() + 60
        while holds_port(other, port) is not True and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.beat()
        assert w.restarts == 1 and w.state == "dead" and owner.resynced == [], fleet.events
        assert "lost its port" in w.last_error and not w.process.alive()
    finally:
        fleet.close()
        other.stop()
