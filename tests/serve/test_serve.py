"""`megapkl serve` in-process (real HTTP on a loopback port, the server in a thread): /generate
payloads and errors, routed-experts wire format, the three weight-update paths, pause/continue."""
from __future__ import annotations

import base64
import io
import multiprocessing
import pickle
import sys
import threading
import time
import types
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from rollout_tiny import DENSE, MOE, build_model, teacher_forced
from sglang_fixtures import free_port, http

from megapkl.parallel.forked import collected_before_fork
from megapkl.rollout.embedded import EmbeddedEngine
from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import PromptItem
from megapkl.rollout.embedded import checkpoint_tensors
from megapkl.serve.serve import SGLangCompatServer, make_http_server
from megapkl.serve.serve_protocol import decode_routed_experts
from megapkl.serve.serve_state import InterruptibleEngine, ServeState


class Served:
    def __init__(self, cfg: dict, model, routed: bool = False):
        engine = InterruptibleEngine(cfg, seed=0)
        engine.update_weights(checkpoint_tensors(model), version=0)
        self.state = ServeState(engine, model_path="tiny", served_model_name="tiny",
                                enable_routed_experts=routed)
        self.app = SGLangCompatServer(self.state, port=0)
        self.httpd = make_http_server(self.app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def post(self, path: str, body=None, timeout: float = 120.0):
        return http("POST", self.url + path, {} if body is None else body, timeout=timeout)

    def params(self) -> dict:
        return {n: p.detach().clone() for n, p in self.state.engine.model.named_parameters()}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.state.close()


@pytest.fixture(scope="module")
def dense(dense_model):
    s = Served(DENSE, dense_model)
    yield s
    s.close()


@pytest.fixture(scope="module")
def moe(moe_model):
    s = Served(MOE, moe_model, routed=True)
    yield s
    s.close()


def _new_weights(model, scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(scale * 1000))
    return [(n, (p.detach() + scale * torch.randn(p.shape, generator=g)).contiguous())
            for n, p in model.named_parameters()]  # tied lm_head appears once


def _assert_holds(served: Served, named) -> None:
    held = served.params()
    for name, tensor in named:
        if name in held:
            assert torch.equal(held[name], tensor), name


# ---------------------------------------------------------------- /generate


def test_generate_prompt_major_and_equal_to_engine(dense, dense_model):
    ref = EmbeddedEngine.from_model(dense_model, seed=0)
    prompts = [[5, 9, 17], [3, 4]]
    sampling = SamplingParams(max_new_tokens=5, temperature=0.9, seed=7, topk_logprobs=2,
                              ignore_eos=True)
    want = ref.generate([PromptItem(torch.tensor(p)) for p in prompts], 2, sampling)
    status, out = dense.post("/generate", {
        "input_ids": prompts, "rid": ["a", "b"], "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.9, "n": 2,
                            "sampling_seed": 7, "ignore_eos": True}})
    assert status == 200, out
    assert [o["meta_info"]["id"] for o in out] == ["a_0", "a_1", "b_0", "b_1"]
    for got, ref_s in zip(out, want):
        meta = got["meta_info"]
        assert got["output_ids"] == ref_s.response_ids.tolist()
        assert [e[0] for e in meta["output_token_logprobs"]] == ref_s.logp_behav.tolist()
        assert [[e[1] for e in r] for r in meta["output_top_logprobs"]] == ref_s.topk_ids.tolist()
        assert meta["prompt_tokens"] == ref_s.prompt_len and meta["completion_tokens"] == 5
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert meta["input_token_logprobs"] == []  # logprob_start_len -1: outputs only
    status, one = dense.post("/generate", {"input_ids": [5, 9], "rid": "x",
                                           "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and isinstance(one, dict) and one["meta_info"]["id"] == "x"


def test_a_group_sent_as_seeded_copies_draws_each_copy_from_its_seed(dense):
    """megapkl's client sends a seeded group as n copies of the prompt with a seed each (SGLang
    gives all samples of one request its seed): every copy is drawn as if it had come alone."""
    def sp(seed):
        return {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}

    seeds = (11, 12, 13, 14)
    status, out = dense.post("/generate", {"input_ids": [[5, 9, 17]] * 4,
                                           "sampling_params": [sp(s) for s in seeds]})
    assert status == 200 and len(out) == 4, out
    alone = [dense.post("/generate", {"input_ids": [5, 9, 17], "sampling_params": sp(s)})[1]
             for s in seeds]
    assert [o["output_ids"] for o in out] == [a["output_ids"] for a in alone]
    assert len({tuple(o["output_ids"]) for o in out}) == 4


def test_stop_token_and_prompt_logprobs(dense, dense_model):
    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    status, out = dense.post("/generate", {"input_ids": [7, 8, 9], "sampling_params": greedy,
                                           "return_logprob": True, "logprob_start_len": 0,
                                           "top_logprobs_num": 3})
    assert status == 200, out
    first = out["output_ids"][0]
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 7, None]
    assert meta["input_top_logprobs"][0] is None
    with torch.no_grad():
        logits = dense_model(input_ids=torch.tensor([[7, 8, 9]])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx(
        [logp[0, 8].item(), logp[1, 9].item()], abs=1e-5)
    stop = {**greedy, "stop_token_ids": [first], "ignore_eos": False}
    status, out = dense.post("/generate", {"input_ids": [7, 8, 9], "sampling_params": stop})
    assert out["output_ids"] == [first]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    status, out = dense.post("/generate", {"input_ids": [7, 8, 9],
                                           "sampling_params": {**stop, "ignore_eos": True}})
    assert len(out["output_ids"]) == 4  # ignore_eos also disables stop_token_ids


@pytest.mark.parametrize("body, shape", [
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "bogus": 1}}, str),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "2"}}, str),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, dict),
    ({"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 5}, dict),
    ({"input_ids": [1], "top_logprobs_num": 1000}, dict),
    ({"sampling_params": {}}, dict),
    ({"input_ids": [1], "token_ids_logprob": [3]}, dict),
    ({"input_ids": [1000]}, dict),
    ([1, 2], str),
])
def test_generate_errors_are_400_with_sglang_shapes(dense, body, shape):
    status, out = dense.post("/generate", body)
    assert status == 400, out
    err = out["error"]
    assert isinstance(err, str) if shape is str else isinstance(err["message"], str)


def test_unknown_route_and_sessions(dense):
    assert http("GET", dense.url + "/no_such_route")[0] == 404
    assert http("GET", dense.url + "/health")[0] == 200
    assert http("GET", dense.url + "/health_generate")[0] == 200
    info = http("GET", dense.url + "/model_info")[1]
    assert info["model_type"] == "qwen3" and info["weight_version"] == "default"
    server = http("GET", dense.url + "/server_info")[1]
    assert server["tp_size"] == 1 and server["dp_size"] == 1
    assert dense.post("/end_weight_update")[0] == 400
    assert dense.post("/begin_weight_update")[0] == 200
    assert dense.post("/begin_weight_update")[0] == 400  # already open
    assert dense.post("/end_weight_update")[0] == 200


# ---------------------------------------------------------------- routed experts


def test_routed_experts_wire_format_round_trip(moe, moe_model):
    ref = EmbeddedEngine.from_model(moe_model, seed=0)
    prompt = [4, 8, 15, 16, 23]
    body = {"input_ids": prompt, "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3}}
    status, out = moe.post("/generate", body)
    assert status == 200, out
    want = ref.generate([PromptItem(torch.tensor(prompt))], 1,
                        SamplingParams(max_new_tokens=6, seed=3, return_routed_experts=True))[0]
    c = len(out["output_ids"])
    experts = decode_routed_experts(out["meta_info"]["routed_experts"],
                                    MOE["num_hidden_layers"], MOE["num_experts_per_tok"])
    assert experts.shape == (len(prompt) + c - 1, 2, 2)
    assert torch.equal(torch.from_numpy(experts.copy()), want.routed_experts)
    # The trainer's teacher-forced forward routes every row the same way (replay is exact).
    _, routed = teacher_forced(moe_model, want, temperature=1.0)
    assert torch.equal(torch.from_numpy(experts.copy()), routed)
    status, cut = moe.post("/generate", {**body, "routed_experts_start_len": 2})
    tail = decode_routed_experts(cut["meta_info"]["routed_experts"], 2, 2)
    assert tail.shape[0] == experts.shape[0] - 2 and (tail == experts[2:]).all()


def test_routed_experts_absent_without_server_flag(dense_model):
    served = Served(MOE, build_model(MOE), routed=False)
    try:
        status, out = served.post("/generate", {"input_ids": [3, 4], "return_routed_experts": True,
                                                "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and "routed_experts" not in out["meta_info"]
    finally:
        served.close()


# ---------------------------------------------------------------- weight updates


@dataclass
class FlattenedTensorMetadata:
    """Pickled under SGLang's module path (see _tensor_payload), as SGLang's bucket sends it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


def _tensor_payload(named, flattened: bool = False) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): a ForkingPickler dump
    (shared-memory tensors), base64. CPU tensors need the file_system sharing strategy."""
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")
    obj = _flattened(named) if flattened else named
    # Pickle imports a class's module by name: stand in for the sglang packages during the dump.
    parts = SGLANG_BUCKET_MODULE.split(".")
    names = [".".join(parts[:i + 1]) for i in range(len(parts))]
    assert not any(n in sys.modules for n in names), "a real sglang is imported"
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[SGLANG_BUCKET_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata
    FlattenedTensorMetadata.__module__ = SGLANG_BUCKET_MODULE
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
    finally:
        for n in names:
            del sys.modules[n]
        FlattenedTensorMetadata.__module__ = __name__
    return base64.b64encode(buf.getvalue()).decode()


def _flattened(named):
    """SGLang's FlattenedTensorBucket layout: uint8 concatenation plus per-tensor metadata."""
    meta, flats, start = [], [], 0
    for name, t in named:
        flat = t.flatten().view(torch.uint8)
        meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, start, start + flat.numel(),
                                            flat.numel()))
        flats.append(flat)
        start += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": meta}


@pytest.mark.parametrize("flattened", [False, True])
def test_update_weights_from_tensor_bit_identical(dense, dense_model, flattened):
    named = _new_weights(dense_model, 0.01 if flattened else 0.02)
    payload = _tensor_payload(named, flattened)
    fmt = "flattened_bucket" if flattened else None
    body = {"serialized_named_tensors": [payload], "load_format": fmt,
            "weight_version": f"t{int(flattened)}"}
    status, out = dense.post("/update_weights_from_tensor", body)
    assert status == 400 and out["success"] is False and "begin_weight_update" in out["message"]
    assert dense.post("/begin_weight_update")[0] == 200
    status, out = dense.post("/update_weights_from_tensor", body)
    assert dense.post("/end_weight_update")[0] == 200
    assert status == 200 and out["success"], out
    _assert_holds(dense, named)
    status, gen = dense.post("/generate", {"input_ids": [1, 2], "sampling_params":
                                           {"max_new_tokens": 1}})
    assert gen["meta_info"]["weight_version"] == f"t{int(flattened)}"


def test_tensor_payload_refuses_foreign_globals(dense):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    payload = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    assert dense.post("/begin_weight_update")[0] == 200
    try:
        status, out = dense.post("/update_weights_from_tensor",
                                 {"serialized_named_tensors": [payload]})
    finally:
        dense.post("/end_weight_update")
    assert status == 400 and out["success"] is False and "builtins.print" in out["message"]


def test_update_weights_from_disk_bit_identical(dense, dense_model, tmp_path):
    from safetensors.torch import save_file

    named = _new_weights(dense_model, 0.03)
    save_file({n: t for n, t in named}, str(tmp_path / "model.safetensors"))
    status, out = dense.post("/update_weights_from_disk",
                             {"model_path": str(tmp_path), "weight_version": "d1"})
    assert status == 200 and out["success"] and out["num_paused_requests"] == 0, out
    _assert_holds(dense, named)
    info = http("GET", dense.url + "/model_info")[1]
    assert info["weight_version"] == "d1" and info["model_path"] == str(tmp_path)
    status, out = dense.post("/update_weights_from_disk", {"model_path": str(tmp_path / "no")})
    assert status == 400 and out["success"] is False


def _broadcast_side(port: int, named, group: str, flattened: bool) -> None:
    """Rank 0 of the weight-update group (the trainer): SGLang's rendezvous, then broadcasts."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=60)
    store, rank, size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    store = c10d.PrefixStore(group, store)
    pg, _ = c10d._new_process_group_helper(2, 0, [], c10d.Backend("gloo"), store,
                                           group_name=group, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    if flattened:
        flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
        torch.distributed.broadcast(flat, src=0, group=pg)
    else:
        for _, t in named:
            torch.distributed.broadcast(t, src=0, group=pg)


@pytest.mark.parametrize("flattened", [False, True])
def test_update_weights_from_distributed_bit_identical(dense, dense_model, flattened):
    named = _new_weights(dense_model, 0.04 + flattened)
    port, group = free_port(), f"wug{int(flattened)}"
    ctx = multiprocessing.get_context("fork")
    trainer = ctx.Process(target=_broadcast_side, args=(port, named, group, flattened))
    with collected_before_fork():  # the child must not finalize this process's garbage
        trainer.start()
    try:
        status, out = dense.post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": group, "backend": "gloo"})
        assert status == 200 and out["success"], out
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).replace("torch.", "")
                                                          for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": group,
                "weight_version": "b1", "load_format": "flattened_bucket" if flattened else None}
        assert dense.post("/begin_weight_update")[0] == 200
        status, out = dense.post("/update_weights_from_distributed", body)
        assert dense.post("/end_weight_update")[0] == 200
        assert status == 200 and out["success"], out
        _assert_holds(dense, named)
        assert dense.post("/destroy_weights_update_group", {"group_name": group})[0] == 200
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


# ---------------------------------------------------------------- pause / continue


def _generate_async(served: Served, max_new: int = 120):
    result = {}

    def go():
        result["out"] = served.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.0}})
    thread = threading.Thread(target=go)
    thread.start()
    deadline = time.monotonic() + 60
    while not served.state.busy() and time.monotonic() < deadline:
        time.sleep(0.005)
    return thread, result


def test_pause_abort_aborts_running_and_holds_new(dense):
    thread, result = _generate_async(dense)
    assert dense.post("/pause_generation", {"mode": "abort"}) == (
        200, {"message": "Generation paused successfully.", "status": "ok"})
    thread.join(60)
    status, out = result["out"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    held, held_result = threading.Thread(target=lambda: held_result.update(
        out=dense.post("/generate", {"input_ids": [1], "sampling_params":
                                     {"max_new_tokens": 1}}))), {}
    held.start()
    time.sleep(0.5)
    assert "out" not in held_result  # held while paused
    assert dense.post("/continue_generation")[0] == 200
    held.join(60)
    assert held_result["out"][0] == 200
    assert held_result["out"][1]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_retract_redoes_with_new_weights(dense, dense_model):
    thread, result = _generate_async(dense)
    assert dense.post("/pause_generation", {"mode": "retract"})[0] == 200
    assert not dense.state.busy()
    assert dense.post("/flush_cache")[0] == 200  # retracted requests do not block a flush
    status, _ = dense.post("/update_weight_version", {"new_version": "r2",
                                                      "abort_all_requests": False})
    assert status == 200
    assert dense.post("/continue_generation")[0] == 200
    thread.join(120)
    status, out = result["out"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
    assert out["meta_info"]["weight_version"] == "r2"
    assert out["meta_info"]["num_retractions"] == 1


def test_pause_in_place_keeps_request_across_update(dense, dense_model):
    thread, result = _generate_async(dense)
    deadline = time.monotonic() + 60  # a token decoded before the pause: a non-empty first span
    while dense.state._step < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert dense.post("/pause_generation", {"mode": "in_place"})[0] == 200
    assert dense.state.busy()  # parked, not finished
    status, _ = dense.post("/flush_cache")
    assert status == 400  # a parked request blocks the flush, as in SGLang
    named = _new_weights(dense_model, 0.05)
    assert dense.post("/begin_weight_update")[0] == 200
    status, out = dense.post("/update_weights_from_tensor", {
        "serialized_named_tensors": [_tensor_payload(named)], "flush_cache": False,
        "weight_version": "p2"})
    assert dense.post("/end_weight_update")[0] == 200
    assert status == 200, out
    assert dense.post("/continue_generation")[0] == 200
    thread.join(120)
    meta = result["out"][1]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 120}
    spans = meta["weight_versions"]
    assert meta["weight_version"] == "p2" and [s["version"] for s in spans][-1] == "p2"
    assert len(spans) == 2 and spans[0]["end"] == spans[1]["start"] > 0


def test_tensor_route_refused_beyond_loopback_without_flag(dense):
    from megapkl.rollout.sglang.http import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    app = SGLangCompatServer(dense.state, host="0.0.0.0", allow_tensor_updates=False)
    status, out = app.dispatch("POST", "/update_weights_from_tensor",
                               {"serialized_named_tensors": ["x"]})
    assert status == 400 and out["success"] is False and "not loopback" in out["message"]


def test_build_from_hf_checkpoint_and_model_spec(dense_model, tmp_path):
    from megapkl.serve.serve import build_parser, build_state

    dense_model.save_pretrained(tmp_path, safe_serialization=True)
    state, tok = build_state(build_parser().parse_args(["--hf-checkpoint", str(tmp_path)]))
    held = dict(state.engine.model.named_parameters())
    for name, p in dense_model.named_parameters():
        assert torch.equal(held[name], p.detach()), name
    assert tok is None and state.model_path == str(tmp_path)
    with pytest.raises(SystemExit, match="mixture-of-experts"):
        build_state(build_parser().parse_args(["--model-config", "tiny-qwen3",
                                               "--enable-return-routed-experts"]))


def test_expand_layers_zero_fills_dense_layers():
    from megapkl.serve.serve_protocol import encode_routed_experts, expand_layers

    moe_only = torch.tensor([[[1, 2]], [[3, 0]]], dtype=torch.int32)  # 2 rows, 1 MoE layer
    full = expand_layers(moe_only, [2], 3)
    assert full.shape == (2, 3, 2) and torch.equal(full[:, 2], moe_only[:, 0])
    assert not full[:, :2].any()
    back = decode_routed_experts(encode_routed_experts(full), 3, 2)
    assert torch.equal(torch.from_numpy(back.copy()), full)


def test_abort_request_by_rid(dense):
    result = {}

    def go():
        result["out"] = dense.post("/generate", {"input_ids": [1, 2, 3], "rid": "victim",
                                                 "sampling_params": {"max_new_tokens": 120,
                                                                     "ignore_eos": True}})
    thread = threading.Thread(target=go)
    thread.start()
    deadline = time.monotonic() + 60
    while not dense.state.busy() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert dense.post("/abort_request", {"rid": "victim"})[0] == 200
    thread.join(60)
    meta = result["out"][1]["meta_info"]
    assert meta["id"] == "victim" and meta["finish_reason"]["type"] == "abort"


def test_a_bucket_that_fails_half_written_tears_the_served_weights(dense_model, monkeypatch):
    """megapkl serve checks and writes each tensor in one read (streamed): a NaN after written
    pieces is the request's 400, and the server then refuses to generate (naming the weight)
    until a push has written every parameter again."""
    from megapkl.rollout import weight_write

    monkeypatch.setattr(weight_write, "PIECE_BYTES", 256)
    served = Served(DENSE, dense_model)
    try:
        named = _new_weights(dense_model, 0.03)
        name, bad = next((n, t.clone()) for n, t in named if t.numel() > 64)
        bad.view(-1)[-1] = float("nan")
        assert served.post("/begin_weight_update")[0] == 200
        status, out = served.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [_tensor_payload([(name, bad)], False)]})
        assert status == 400 and f"'{name}': contains NaN or Inf" in out["message"], out
        assert served.post("/end_weight_update")[0] == 200
        status, gen = served.post("/generate", {"input_ids": [1, 2],
                                                "sampling_params": {"max_new_tokens": 1}})
        assert status != 200 and "torn" in str(gen) and name in str(gen), (status, gen)
        assert served.post("/begin_weight_update")[0] == 200
        status, out = served.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [_tensor_payload(named, False)],
            "weight_version": "whole"})
        assert served.post("/end_weight_update")[0] == 200
        assert status == 200, out
        _assert_holds(served, named)
        status, gen = served.post("/generate", {"input_ids": [1, 2],
                                                "sampling_params": {"max_new_tokens": 1}})
        assert status == 200 and gen["meta_info"]["weight_version"] == "whole", gen
    finally:
        served.close()
