"""The weight-sync state machine, unit level: a recording stand-in server (stdlib HTTP, in this
process) that keeps what it receives, checks the session rules SGLang enforces (tensor and
distributed updates only between begin/end, updates only while paused) and joins the broadcast
group on its side. End-to-end sync against `megapkl serve` workers is in test_sglang_fleet.py."""
from __future__ import annotations

import base64
import json
import pickle
import multiprocessing as mp
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megapkl.rollout.engine import WeightUpdateError
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.weights import (MiB, SyncSettings, Target, WeightSync,
                                            open_update_group)


class Recorder:
    def __init__(self):
        self.routes: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.version = None
        self.paused = self.session = False
        self.group = None
        self.fail_on: str | None = None

    def handle(self, route: str, body: dict):
        self.routes.append(route)
        if route == self.fail_on:
            return 400, {"success": False, "message": f"unknown weight 'model.bogus'"}
        if route == "pause_generation":
            self.paused = True
        elif route == "continue_generation":
            self.paused = False
        elif route == "begin_weight_update":
            self.session = True
        elif route == "end_weight_update":
            self.session = False
        elif route == "update_weight_version":
            self.version = body["new_version"]
        elif route.startswith("update_weights_from"):
            if not self.paused or (route != "update_weights_from_disk" and not self.session):
                return 400, {"success": False, "message": "update outside a paused session"}
            self._update(route, body)
        elif route == "init_weights_update_group":
            self.group = open_update_group(body["backend"], body["master_address"],
                                           body["master_port"], body["world_size"],
                                           body["rank_offset"], body["group_name"], 30)
        return 200, {"success": True, "message": "ok"}

    def _update(self, route, body):
        if route == "update_weights_from_tensor":
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        elif route == "update_weights_from_disk":
            from megapkl.rollout.embedded import iter_safetensors
            named = list(iter_safetensors(body["model_path"]))
        else:
            named = []
            for n, dt, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dt))
                torch.distributed.broadcast(t, src=0, group=self.group)
                named.append((n, t))
        self.weights.update({n: t.clone() for n, t in named})


def _serve(port_queue):
    """The stand-in server, in its own process (a broadcast group has one member per process)."""
    rec = Recorder()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # /state: what the test inspects
            state = {"routes": rec.routes, "version": rec.version, "paused": rec.paused,
                     "session": rec.session, "weights": rec.weights}
            self._send(200, {"pickle": base64.b64encode(pickle.dumps(state)).decode()})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            route = self.path.strip("/")
            if route == "fail_on":
                rec.fail_on = body["route"]
                return self._send(200, {})
            if route == "clear":
                rec.routes.clear()
                return self._send(200, {})
            self._send(*rec.handle(route, body))

        def _send(self, status, out):
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    port_queue.put(httpd.server_address[1])
    httpd.serve_forever()


class Server:
    def __init__(self, url):
        self.url = url

    def state(self):
        return pickle.loads(base64.b64decode(http.request(self.url, "/state", method="GET",
                                                          timeout=30)["pickle"]))

    def post(self, route, body=None):
        http.request(self.url, "/" + route, body or {}, method="POST", timeout=30)


@pytest.fixture
def server():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(q,), daemon=True)
    proc.start()
    yield Server(f"http://127.0.0.1:{q.get(timeout=30)}")
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
    expect = ["pause_generation", "flush_cache", "begin_weight_update"]
    expect += ["init_weights_update_group"] if mode == "distributed" else []
    expect += [update] * (1 if mode == "disk" else 2)
    expect += ["end_weight_update", "update_weight_version", "continue_generation"]
    assert st["routes"] == expect
    if mode == "distributed":  # the group is kept for the next sync of the same servers
        server.post("clear")
        sync.push([Target(server.url)], _weights(1), version=6)
        st = server.state()
        assert "init_weights_update_group" not in st["routes"]
        assert torch.equal(st["weights"]["model.norm.weight"], _weights(1)[2][1])
        sync.close_group([Target(server.url)])
    if mode == "disk":
        assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v5"]


def test_failed_update_names_server_and_lets_generation_continue(server, tmp_path):
    server.post("fail_on", {"route": "update_weights_from_tensor"})
    sync = WeightSync(SyncSettings(mode="tensor", timeout_s=30))
    with pytest.raises(WeightUpdateError, match="unknown weight 'model.bogus'") as info:
        sync.push([Target(server.url)], _weights(), version=1)
    assert server.url in str(info.value)
    st = server.state()
    assert st["routes"][-1] == "continue_generation" and not st["paused"]
    assert st["version"] is None


def test_colocated_release_then_resume_before_the_push(server):
    sync = WeightSync(SyncSettings(mode="tensor", colocate=True, timeout_s=30))
    sync.release_memory([Target(server.url)])
    sync.release_memory([Target(server.url)])  # already released: no second call
    sync.push([Target(server.url)], _weights(), version=2)
    sync.push([Target(server.url)], _weights(), version=3)  # not released: nothing to resume
    routes = server.state()["routes"]
    assert routes.count("release_memory_occupation") == 1
    assert routes.count("resume_memory_occupation") == 1
    assert routes.index("resume_memory_occupation") < routes.index("begin_weight_update")


def test_bad_settings():
    with pytest.raises(ValueError, match="rollout.sglang.weight_sync"):
        SyncSettings(mode="nccl")
    with pytest.raises(ValueError, match="rollout.sglang.pause_mode"):
        SyncSettings(pause_mode="stop")
    with pytest.raises(ValueError, match="disk needs a run directory"):
        WeightSync(SyncSettings(mode="disk"))
