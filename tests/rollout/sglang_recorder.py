"""A recording stand-in for the weight-sync side of an SGLang server (stdlib HTTP), for unit tests
of `WeightSync`, the fleet and the engine's memory handling.

It keeps what it receives and enforces the rules SGLang 0.5.23 enforces on these routes (read from
its source; the contract tests in tests/contract/ run SGLang's own code for the parts that run on
CPU):
- tensor and distributed updates only between /begin_weight_update and /end_weight_update, and
  only while paused (managers/scheduler_components/weight_updater.py);
- /update_weights_from_disk without `load_format` uses the server's own (`--load-format`, here
  `load_format` of the constructor); a loader other than the default one (dummy) is refused with
  HTTP 400 (model_runner_components/weight_updater.py: "Only support DefaultModelLoader");
- /update_weights_from_distributed allocates each receive buffer with the *declared* dtype and
  broadcasts into it; with `load_format: flattened_bucket` one uint8 buffer for the bucket whose
  tensors must start at a multiple of their element size (weight_sync/tensor_bucket.py);
- /release_memory_occupation asserts the server is idle (a /health_generate probe counts as a
  request) and /resume_memory_occupation of tags that were never released raises in the
  scheduler: either exits the scheduler, and the server answers nothing after that ("dead");
- weights are post-processed once by /update_weights_from_disk and once by /end_weight_update
  (`postprocess_weights` runs there whatever the session loaded): `post_processed` counts them;
- a server started while `gpu_busy_file` exists (the trainer holds the GPU) sizes its memory from
  what the trainer left free: `started_beside_trainer`.

Run in a child process (`serve(port_queue)`) or as a script: `python sglang_recorder.py PORT
[--health-delay S] [--gpu-busy-file PATH]`. GET /state returns the recorded state (pickled,
base64).
"""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

DEFAULT_LOADERS = ("auto", "pt", "safetensors")  # formats SGLang's DefaultModelLoader takes


class Recorder:
    def __init__(self, load_format: str = "dummy", health_delay: float = 0.0,
                 gpu_busy_file: str | None = None):
        self.routes: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.version = None
        self.paused = self.session = False
        self.group = None
        self.fail_on: str | None = None
        self.fail_after: str | None = None  # handled, then answered with an error
        self.load_format = load_format
        self.health_delay = health_delay
        self.busy = 0  # requests being generated (health probes included)
        self.released = False
        self.dead = False
        self.post_processed = 0
        self.started_beside_trainer = bool(gpu_busy_file and os.path.exists(gpu_busy_file))
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def handle(self, route: str, body: dict):
        if self.dead:
            return 503, {"error": "the scheduler exited"}
        self.routes.append(route)
        if route == self.fail_on:
            return 400, {"success": False, "message": "unknown weight 'model.bogus'"}
        if route in ("health_generate", "generate"):
            return self._generate(route)
        if route == "release_memory_occupation":
            with self.lock:
                if self.busy:
                    self.violations.append("release while a request runs")
                    self.dead = True  # the scheduler's assertion ends it
                    return 500, {"error": "release_memory_occupation should be called only "
                                          "when server is idle."}
                self.released = True
        elif route == "resume_memory_occupation":
            if not self.released:
                self.violations.append("resume of memory that was never released")
                self.dead = True  # offload_tags.remove(tag) raises; the scheduler exits
                return 500, {"error": "KeyError: 'weights'"}
            self.released = False
        elif route == "pause_generation":
            self.paused = True
        elif route == "continue_generation":
            self.paused = False
        elif route == "begin_weight_update":
            self.session = True
        elif route == "end_weight_update":
            self.session = False
            self.post_processed += 1
        elif route == "update_weight_version":
            self.version = body["new_version"]
        elif route.startswith("update_weights_from"):
            if not self.paused or (route != "update_weights_from_disk" and not self.session):
                return 400, {"success": False, "message": "update outside a paused session"}
            return self._update(route, body)
        elif route == "init_weights_update_group":
            from megapkl.rollout.sglang.weights import open_update_group

            self.group = open_update_group(body["backend"], body["master_address"],
                                           body["master_port"], body["world_size"],
                                           body["rank_offset"], body["group_name"], 30)
        elif route == "destroy_weights_update_group":
            if self.group is not None:
                torch.distributed.destroy_process_group(self.group)
                self.group = None
        elif route == "model_info":
            return 200, {"weight_version": self.version}
        return 200, {"success": True, "message": "ok"}

    def _generate(self, route: str):
        with self.lock:
            if self.released:
                self.violations.append(f"{route} while the memory is released")
                return 500, {"error": "generation on released memory"}
            self.busy += 1
        try:
            time.sleep(self.health_delay if route == "health_generate" else 0.0)
        finally:
            with self.lock:
                self.busy -= 1
        return 200, {}

    def _update(self, route, body):
        if route == "update_weights_from_tensor":
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        elif route == "update_weights_from_disk":
            fmt = body.get("load_format") or self.load_format
            if fmt not in DEFAULT_LOADERS:
                return 400, {"success": False, "message": "Failed to get model loader: "
                                                          f"<{fmt} loader>."}
            from megapkl.rollout.embedded import iter_safetensors
            named = list(iter_safetensors(body["model_path"]))
            self.post_processed += 1
        else:
            try:
                named = self._receive(body)
            except Exception as exc:  # noqa: BLE001 - SGLang answers the failure
                return 400, {"success": False, "message": f"Failed to receive weights: {exc}"}
        self.weights.update({n: t.clone() for n, t in named})
        return 200, {"success": True, "message": "ok"}

    def _receive(self, body):
        specs = [(n, getattr(torch, d), torch.Size(s))
                 for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
        if body.get("load_format") == "flattened_bucket":
            offset, where = 0, []
            for n, d, s in specs:
                if offset % d.itemsize:
                    raise ValueError(f"Unaligned received tensor {n}: byte offset {offset}")
                where.append((n, d, s, offset))
                offset += s.numel() * d.itemsize
            flat = torch.empty(offset, dtype=torch.uint8)
            torch.distributed.broadcast(flat, src=0, group=self.group)
            return [(n, flat[o:o + s.numel() * d.itemsize].view(d).reshape(s))
                    for n, d, s, o in where]
        named = []
        for n, d, s in specs:
            t = torch.empty(s, dtype=d)
            torch.distributed.broadcast(t, src=0, group=self.group)
            named.append((n, t))
        return named

    def state(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.weights, buf)  # (plain pickle cannot carry float8 tensors)
        return {"routes": list(self.routes), "version": self.version, "paused": self.paused,
                "session": self.session, "weights": buf.getvalue(), "released": self.released,
                "violations": list(self.violations), "dead": self.dead,
                "post_processed": self.post_processed,
                "started_beside_trainer": self.started_beside_trainer}


def read_state(url: str) -> dict:
    """GET /state of a recorder: its state with the received weights as tensors."""
    from megapkl.rollout.sglang import http

    st = pickle.loads(base64.b64decode(http.request(url, "/state", method="GET",
                                                    timeout=30)["pickle"]))
    st["weights"] = torch.load(io.BytesIO(st["weights"]))
    return st


def make_server(rec: Recorder, port: int = 0) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            route = self.path.strip("/")
            if route == "state":  # what the test inspects
                return self._send(200, {"pickle": base64.b64encode(pickle.dumps(rec.state()))
                                        .decode()})
            if route == "health":
                return self._send(503 if rec.dead else 200, {})
            self._send(*rec.handle(route, {}))

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            route = self.path.strip("/")
            if route == "fail_on":
                rec.fail_on = body["route"]
                return self._send(200, {})
            if route == "fail_after":
                rec.fail_after = body["route"]
                return self._send(200, {})
            if route == "clear":
                rec.routes.clear()
                return self._send(200, {})
            status, out = rec.handle(route, body)
            if route == rec.fail_after:
                status, out = 400, {"success": False, "message": f"{route} done, then failed"}
            self._send(status, out)

        def _send(self, status, out):
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), H)


def serve(port_queue, **kwargs) -> None:
    """In a child process: serve on a free port and put it on `port_queue`."""
    httpd = make_server(Recorder(**kwargs))
    port_queue.put(httpd.server_address[1])
    httpd.serve_forever()


def _arg(name: str, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    make_server(Recorder(health_delay=float(_arg("--health-delay", 0.0)),
                         gpu_busy_file=_arg("--gpu-busy-file")), int(sys.argv[1])).serve_forever()
