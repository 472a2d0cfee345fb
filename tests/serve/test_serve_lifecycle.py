"""`megapkl serve` lives SGLang's memory and health lifecycle (each rule read in the pinned SGLang's
source by tests/contract/test_serve_lifecycle_contract.py): /health generates unless
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false, a forward while memory is released ends the
server, a resume without GPU room ends it, and the health route answers 503 while the scheduler is
blocked in a weight load for longer than SGLANG_HEALTH_CHECK_TIMEOUT."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from rollout_tiny import DENSE
from sglang_fixtures import free_port, http

from megapkl.rollout.embedded import checkpoint_tensors
from megapkl.serve.serve import SGLangCompatServer, make_http_server
from megapkl.serve.serve_state import InterruptibleEngine, ServeState


class Died(Exception):
    pass


def _die(message: str) -> None:
    raise Died(message)


@pytest.fixture
def served(dense_model, monkeypatch):
    made = []

    def make(env=None, **kw):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        engine = InterruptibleEngine(DENSE, seed=0)
        engine.update_weights(checkpoint_tensors(dense_model), version=0)
        state = ServeState(engine, model_path="tiny", served_model_name="tiny")
        app = SGLangCompatServer(state, port=0, die=_die, **kw)
        httpd = make_http_server(app, "127.0.0.1", 0)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        made.append(httpd)
        return app, f"http://127.0.0.1:{httpd.server_address[1]}"

    yield make
    for httpd in made:
        httpd.shutdown()
        httpd.server_close()


def test_health_generates_and_kills_a_released_server(served):
    app, url = served()
    assert app.health_generates
    assert http("POST", url + "/release_memory_occupation", {})[0] == 200
    for route in ("/health", "/health_generate"):
        with pytest.raises(Died, match="released"):
            app.dispatch("GET", route, None)
    with pytest.raises(Died, match="released"):
        app.dispatch("POST", "/generate", {"input_ids": [1, 2], "sampling_params":
                                           {"max_new_tokens": 1}})
    assert app.dispatch("GET", "/model_info", None)[0] == 200  # no forward: answers
    assert app.dispatch("GET", "/server_info", None)[0] == 200
    assert http("POST", url + "/resume_memory_occupation", {})[0] == 200
    assert app.dispatch("GET", "/health", None) == (200, "")


def test_health_without_generation_when_sglangs_switch_is_off(served):
    app, url = served(env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"})
    assert http("POST", url + "/release_memory_occupation", {})[0] == 200
    assert app.dispatch("GET", "/health", None) == (200, "")
    with pytest.raises(Died):
        app.dispatch("GET", "/health_generate", None)


def test_a_resume_without_gpu_room_ends_the_server(served, tmp_path):
    flag = tmp_path / "no_room"
    app, url = served(no_memory_file=str(flag))
    assert http("POST", url + "/release_memory_occupation", {})[0] == 200
    flag.write_text("")
    with pytest.raises(Died, match="out of memory"):
        app.dispatch("POST", "/resume_memory_occupation", {})
    flag.unlink()
    assert app.dispatch("POST", "/resume_memory_occupation", {})[0] == 200


def test_health_answers_503_while_a_weight_load_blocks_the_scheduler(served, tmp_path):
    app, url = served(env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    assert app.health_timeout_s == 1.0
    app.state.load_delay_s = 3.0
    load = threading.Thread(target=http, args=("POST", url + "/update_weights_from_disk",
                                               {"model_path": str(tmp_path)}))
    load.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    status, _ = http("GET", url + "/health_generate")
    assert status == 503 and time.monotonic() - t0 >= 0.9
    load.join()
    assert http("GET", url + "/health_generate")[0] == 200


def _status(url: str, timeout: float = 5.0):
    try:
        return http("GET", url, timeout=timeout)[0]
    except OSError:  # refused (not listening yet) or dropped (the server died)
        return None


def test_the_process_exits_with_a_log_line_when_probed_while_released(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megapkl.serve.serve", "--model-config",
                                 "tiny-qwen3", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while _status(url + "/model_info") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        assert http("POST", url + "/release_memory_occupation", {})[0] == 200
        assert _status(url + "/health", timeout=30) is None  # the connection drops
        assert proc.wait(timeout=60) != 0
        assert "a forward pass ran while the memory" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_weights_are_read_by_the_scheduler_never_half_way_through_a_load(served, dense_model,
                                                                          tmp_path):
    """SGLang answers /get_weights_by_name from its scheduler, which a weight load blocks: a read
    sent during a load returns the loaded weights. Before: read at once, from the weights as the
    load had left them so far."""
    from safetensors.torch import save_file

    app, url = served()
    new = {n: t + 1.0 for n, t in checkpoint_tensors(dense_model)}
    save_file({n: t.contiguous() for n, t in new.items()}, str(tmp_path / "model.safetensors"))
    name = "model.norm.weight"
    app.state.load_delay_s = 1.5  # the scheduler blocked first, as a large checkpoint's read
    load = threading.Thread(target=http, args=("POST", url + "/update_weights_from_disk",
                                               {"model_path": str(tmp_path)}))
    load.start()
    time.sleep(0.3)
    status, held = http("POST", url + "/get_weights_by_name", {"name": name, "truncate_size": 8})
    load.join()
    assert status == 200 and held == new[name][:8].tolist()
