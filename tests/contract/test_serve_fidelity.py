"""`megapkl serve` answers as SGLang does: the same requests go to a `megapkl serve` app and to
SGLang's own HTTP app (reference_backend.py: SGLang's routes, body validation, error handlers and
scheduler-side weight-update logic, run on CPU), and status, content type and body must agree.

Compared exactly (status and body): weight-update session errors and successes, a tensor or
distributed update outside a session, unknown group, pause / continue, flush_cache (plain text),
update_weight_version, a tensor update inside a session, resuming memory that was never
released, request-body validation errors
(SGLang's `ErrorResponse` shape; the message text is pydantic's and is compared by its fields),
unknown routes and wrong methods. /model_info: the same keys. /server_info: every key megapkl
serve answers is one SGLang answers, with a value of the same JSON type, and the same value where
both describe the same launch (tp_size, dp_size, skip_tokenizer_init, ...). /generate is not
compared here (no model runs in SGLang on CPU); tests/serve and tests/rollout cover it. Not
compared: a successful /release_memory_occupation (SGLang's ends in a device synchronize that
needs a GPU), and /model_info's `embedding` plan (SGLang describes embedding execution even for a
generation model; megapkl serve serves generation only and leaves it out).
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

TINY = "tiny-qwen3"


def call(method: str, url: str, body=None, raw: bytes | None = None):
    """(status, content type, parsed body) of one request; errors are answers too."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, kind, text = resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        status, kind, text = exc.code, exc.headers.get("Content-Type", ""), exc.read()
    text = text.decode()
    kind = kind.split(";")[0].strip()
    if kind == "application/json":
        return status, kind, json.loads(text) if text else None
    return status, kind, text


@pytest.fixture(scope="module")
def servers(sglang, tmp_path_factory):
    """(megapkl serve URL, SGLang URL) for one tiny dense model, launched alike."""
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.serve.serve import SGLangCompatServer, make_http_server
    from megapkl.serve.serve_state import InterruptibleEngine, ServeState

    model_dir = Path(tmp_path_factory.mktemp("model"))
    cfg = hf_config_dict(load_spec(TINY), dtype="float32")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    engine = InterruptibleEngine(cfg, seed=0)
    engine.update_weights(list(engine.model.state_dict().items()), version=0)
    state = ServeState(engine, model_path=str(model_dir), served_model_name=str(model_dir))
    app = SGLangCompatServer(state, port=0)
    httpd = make_http_server(app, "127.0.0.1", 0)
    app.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    argv = ["--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(app.port),
            "--skip-tokenizer-init", "--dtype", "float32"]
    try:
        yield f"http://127.0.0.1:{app.port}", lambda: sglang.call("start_front", argv), engine
    finally:
        httpd.shutdown()
        httpd.server_close()
        state.close()


def both(servers, steps):
    """Run `steps` [(method, path, body)] on a fresh SGLang app and on megapkl serve (ending any
    session it opened); the two lists of answers."""
    mine, start_reference, _ = servers
    reference = start_reference()
    out = []
    for url in (reference, mine):
        out.append([call(m, url + p, b) for m, p, b in steps])
        call("POST", url + "/end_weight_update", {})  # leave no session behind
        call("POST", url + "/continue_generation", {})
    return out


SCENARIOS = {
    "session_errors": [("POST", "/end_weight_update", {}), ("POST", "/begin_weight_update", {}),
                       ("POST", "/begin_weight_update", {}), ("POST", "/end_weight_update", {})],
    "tensor_outside_session": [("POST", "/update_weights_from_tensor",
                                {"serialized_named_tensors": ["AAAA"], "flush_cache": False})],
    "distributed_outside_session": [("POST", "/update_weights_from_distributed",
                                     {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]],
                                      "group_name": "g", "flush_cache": False})],
    "destroy_unknown_group": [("POST", "/destroy_weights_update_group", {"group_name": "nope"})],
    "pause_continue": [("POST", "/pause_generation", {}),
                       ("POST", "/pause_generation", {"mode": "retract"}),
                       ("POST", "/continue_generation", {})],
    "flush_cache": [("POST", "/flush_cache", None), ("GET", "/flush_cache", None)],
    "weight_version": [("POST", "/update_weight_version", {"new_version": "3"}),
                       ("POST", "/update_weight_version",
                        {"new_version": "4", "abort_all_requests": False})],
    "resume_never_released": [("POST", "/resume_memory_occupation", {})],
    "unknown_route_and_method": [("GET", "/no_such_route", None),
                                 ("GET", "/update_weights_from_tensor", None)],
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_answers_equal_sglangs(servers, scenario):
    reference, mine = both(servers, SCENARIOS[scenario])
    for step, want, got in zip(SCENARIOS[scenario], reference, mine):
        assert got == want, f"{step}: megapkl serve {got} != SGLang {want}"


VALIDATION = {
    "missing_field": ("/update_weights_from_tensor", {"flush_cache": False}),
    "wrong_type": ("/init_weights_update_group",
                   {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                    "world_size": 2}),
    "not_an_object": ("/update_weight_version", [1, 2]),
}


@pytest.mark.parametrize("case", sorted(VALIDATION))
def test_validation_errors_have_sglangs_shape(servers, case):
    path, body = VALIDATION[case]
    [want], [got] = both(servers, [("POST", path, body)])
    assert got[:2] == want[:2], (got, want)
    assert isinstance(want[2], dict) and isinstance(got[2], dict), (got, want)
    assert set(got[2]) == set(want[2]), (got, want)
    for key in ("object", "type", "param", "code"):
        assert got[2].get(key) == want[2].get(key), (key, got, want)
    assert isinstance(got[2]["message"], str) and got[2]["message"]


SAME_VERSION = ("POST", "/update_weight_version", {"new_version": "info"})


def test_model_info_has_sglangs_keys(servers):
    [_, want], [_, got] = both(servers, [SAME_VERSION, ("GET", "/model_info", None)])
    assert got[:2] == want[:2] == (200, "application/json")
    assert set(got[2]) == set(want[2]) - {"embedding"}
    for key in ("is_generation", "model_type", "architectures", "weight_version",
                "load_format", "has_image_understanding", "has_audio_understanding",
                "model_path", "served_model_name"):
        assert got[2][key] == want[2][key], key


def test_server_info_keys_are_sglangs(servers):
    [_, want], [_, got] = both(servers, [SAME_VERSION, ("GET", "/server_info", None)])
    assert got[:2] == want[:2] == (200, "application/json")
    extra = sorted(set(got[2]) - set(want[2]))
    assert not extra, f"megapkl serve answers keys SGLang does not: {extra}"
    for key, value in got[2].items():
        assert type(value) is type(want[2][key]) or want[2][key] is None, (key, value,
                                                                          want[2][key])
    for key in ("model_path", "tp_size", "dp_size", "pp_size", "ep_size", "skip_tokenizer_init",
                "enable_return_routed_experts", "host", "port", "load_format",
                "weight_version"):
        if key in got[2]:
            assert got[2][key] == want[2][key], key
    for key in ("model_path", "served_model_name", "tp_size", "dp_size"):  # what the router reads
        assert key in got[2], key


def test_tensor_update_in_a_session_answers_as_sglang(servers):
    """A payload made by megapkl's client (the served model's own norm weight, so nothing
    changes) inside a session, with a weight version: the same success body."""
    from megapkl.rollout.sglang.weights import serialize_named_tensors

    engine = servers[2]
    weight = engine.model.model.norm.weight.detach().clone()
    payload, alive = serialize_named_tensors([("model.norm.weight", weight)])
    steps = [("POST", "/begin_weight_update", {}),
             ("POST", "/update_weights_from_tensor",
              {"serialized_named_tensors": [payload], "flush_cache": False,
               "weight_version": "5"}),
             ("POST", "/end_weight_update", {})]
    reference, mine = both(servers, steps)
    del alive
    for step, want, got in zip(steps, reference, mine):
        assert got == want, f"{step[1]}: megapkl serve {got} != SGLang {want}"
