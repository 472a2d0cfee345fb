"""The SGLang wire format as `megapkl serve` speaks it: the request fields it reads, /generate
request parsing (SGLang's closed `sampling_params` set, per-prompt settings) and the pieces of a
response (finish reasons, log-prob entries, routed experts as base64 int32). Pure functions: the
server state lives in `serve_state`, the routes in `serve`.
"""
from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import Sample
from megapkl.rollout.stops import StopStrings, trim_text
from megapkl.serve.serve_state import RequestError

# Request fields this server reads (all are SGLang fields; tests/rollout/test_sglang_protocol.py).
GENERATE_FIELDS = ("rid", "text", "input_ids", "sampling_params", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                   "return_routed_experts", "routed_experts_start_len", "stream", "log_metrics")
# SGLang fields that would change the answer and that this server does not implement: refused.
UNSUPPORTED_GENERATE_FIELDS = ("input_embeds", "image_data", "video_data", "audio_data",
                               "token_ids_logprob", "return_hidden_states", "lora_path",
                               "custom_logit_processor", "session_params",
                               "return_sampling_mask", "return_indexer_topk")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids",
                   "stop", "ignore_eos", "n", "sampling_seed", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "min_new_tokens",
                   "frequency_penalty", "presence_penalty", "repetition_penalty")
# Sampling fields accepted only at their neutral value (a client may send SGLang's defaults).
_NEUTRAL = {"min_p": 0.0, "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "skip_special_tokens": None,
            "spaces_between_special_tokens": None}
# Body fields per route that this server reads, with the JSON type SGLang's request class gives
# them ("int", "str", "bool", "list"; "?" suffix: null allowed). "*" marks a required field. Names
# are checked against SGLang's classes (tests/rollout/test_sglang_protocol.py), answers against
# SGLang's own app (tests/contract/test_serve_fidelity.py).
ROUTE_FIELDS: dict[str, dict[str, str]] = {
    "/generate": {f: "" for f in GENERATE_FIELDS},
    "/update_weights_from_tensor": {"serialized_named_tensors": "*list", "load_format": "str?",
                                    "flush_cache": "bool", "abort_all_requests": "bool",
                                    "weight_version": "str?"},
    "/update_weights_from_disk": {"model_path": "*str", "load_format": "str?",
                                  "flush_cache": "bool", "abort_all_requests": "bool",
                                  "weight_version": "str?"},
    "/init_weights_update_group": {"master_address": "*str", "master_port": "*int",
                                   "rank_offset": "*int", "world_size": "*int",
                                   "group_name": "str", "backend": "str"},
    "/update_weights_from_distributed": {"names": "*list", "dtypes": "*list", "shapes": "*list",
                                         "group_name": "str", "load_format": "str?",
                                         "flush_cache": "bool", "abort_all_requests": "bool",
                                         "weight_version": "str?"},
    "/destroy_weights_update_group": {"group_name": "str"},
    "/begin_weight_update": {},
    "/end_weight_update": {},
    "/update_weight_version": {"new_version": "*str", "abort_all_requests": "bool"},
    "/pause_generation": {"mode": "str"},
    "/continue_generation": {"torch_empty_cache": "bool"},
    "/abort_request": {"rid": "str", "abort_all": "bool"},
    "/release_memory_occupation": {"tags": "list?"},
    "/resume_memory_occupation": {"tags": "list?"},
    "/get_weights_by_name": {"name": "*str", "truncate_size": "int"},
}
GET_ROUTES = ("/health", "/health_generate", "/model_info", "/server_info", "/get_model_info",
              "/get_server_info", "/flush_cache")


class _Reply(Exception):
    """Answer now with this status and body (a dict -> JSON, a str -> text)."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


def _contract(message: str) -> _Reply:
    """/generate's JSON contract gate refuses the body: SGLang answers {"error": message}."""
    return _Reply(400, {"error": message})


def validation_error(message: str) -> _Reply:
    """A body that does not validate into the route's request class: SGLang's ErrorResponse."""
    return _Reply(400, {"object": "error", "message": message, "type": "Bad Request",
                        "param": None, "code": 400})


_KINDS = {"int": "a valid integer", "str": "a valid string", "bool": "a valid boolean",
          "list": "a valid list"}


def validate_body(route: str, body: Any) -> dict:
    """`body` after the checks SGLang's request-body validation makes on the fields this server
    reads: a JSON object, required fields present, values of the declared type (an integer may
    come as a string of digits, as pydantic's lax mode takes it)."""
    if not isinstance(body, dict):
        raise validation_error(f"1 validation error: body: Input should be a valid dictionary "
                               f"(input: {json.dumps(body)[:200]})")
    out = dict(body)
    for key, kind in ROUTE_FIELDS.get(route, {}).items():
        required, nullable, kind = kind.startswith("*"), kind.endswith("?"), kind.strip("*?")
        if key not in body:
            if required:
                raise validation_error(f"1 validation error: body.{key}: Field required")
            continue
        value = body[key]
        if not kind or (value is None and nullable):
            continue
        if kind == "int" and isinstance(value, str) and value.lstrip("-").isdigit():
            value = out[key] = int(value)
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "str": isinstance(value, str), "bool": isinstance(value, bool),
              "list": isinstance(value, list)}[kind]
        if not ok:
            raise validation_error(f"1 validation error: body.{key}: Input should be "
                                   f"{_KINDS[kind]} (input: {json.dumps(value)[:200]})")
    return out


# ---------------------------------------------------------------- /generate parsing


@dataclass
class Item:
    """One prompt of a /generate call with its own settings."""

    prompt_ids: list[int]
    rid: str
    sampling: dict
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    routed: bool
    routed_start: int
    text_in_logprobs: bool
    samples: list[Sample] = field(default_factory=list)
    error: Optional[str] = None
    spans: list = field(default_factory=list)
    retractions: int = 0


def _check_type(key: str, value: Any, kind: str) -> None:
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "num": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool)}[kind]
    if not ok:
        raise _contract(f"invalid type: {json.dumps(value)} for `{key}`, expected "
                        f"{ {'int': 'an integer', 'num': 'a number', 'bool': 'a boolean'}[kind]}")


def parse_sampling(sp: Any, vocab: int, eos: tuple[int, ...],
                   tokenizer: Any = None) -> tuple[SamplingParams, int]:
    """SGLang sampling_params (a closed set) -> (SamplingParams, n). Stop strings need the
    server's `tokenizer`, as SGLang's (refused with its message without one)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise _contract("invalid type: sampling_params, expected a map")
    for key in sp:
        if key not in SAMPLING_FIELDS:
            raise _contract(f"unknown field `{key}` in sampling_params, expected one of "
                            + ", ".join(f"`{f}`" for f in SAMPLING_FIELDS))
    kinds = {"max_new_tokens": "int", "temperature": "num", "top_p": "num", "top_k": "int",
             "n": "int", "sampling_seed": "int", "ignore_eos": "bool", "no_stop_trim": "bool"}
    for key, kind in kinds.items():
        if sp.get(key) is not None:
            _check_type(key, sp[key], kind)
    for key, neutral in _NEUTRAL.items():
        if sp.get(key) is not None and neutral is not None and sp[key] != neutral:
            raise RequestError(f"sampling_params.{key}={sp[key]!r} is not supported by megapkl "
                               f"serve (only {neutral!r})")
    stop = sp.get("stop_token_ids")
    if stop is not None and not (isinstance(stop, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in stop)):
        raise _contract("invalid type: `stop_token_ids`, expected a list of integers")
    strings = _stop_strings(sp.get("stop"), tokenizer)
    top_k = sp.get("top_k")
    top_k = -1 if top_k is None or top_k == -1 or top_k >= vocab else top_k
    ignore_eos = bool(sp.get("ignore_eos") or False)
    stops = tuple(sorted(set(eos) | set(stop or ())))  # SGLang stops at EOS and at stop_token_ids
    n = sp.get("n")
    n = 1 if n is None else n
    if n < 1:
        raise RequestError(f"sampling_params.n must be >= 1, got {n}")
    try:
        params = SamplingParams(max_new_tokens=_or(sp.get("max_new_tokens"), 128),
                                temperature=float(_or(sp.get("temperature"), 1.0)),
                                top_p=float(_or(sp.get("top_p"), 1.0)), top_k=top_k,
                                stop_token_ids=stops, ignore_eos=ignore_eos,
                                stop=strings, no_stop_trim=bool(sp.get("no_stop_trim") or False),
                                seed=sp.get("sampling_seed"))
    except ValueError as exc:
        raise RequestError(str(exc).replace("SamplingParams: ", "sampling_params: ")) from None
    return params, n


def _stop_strings(stop: Any, tokenizer: Any) -> tuple[str, ...]:
    """`stop` (a string or a list of strings), checked as SGLang's normalize checks it."""
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(x, str) for x in strings):
        raise _contract(f"invalid type: {json.dumps(stop)[:100]} for `stop`, expected a string "
                        "or an array of strings")
    try:
        StopStrings(strings, tokenizer)  # SGLang's count limit and tokenizer requirement
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    return tuple(strings)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _per_item(body: dict, key: str, count: int, default: Any, kind: str) -> list:
    value = body.get(key)
    if value is None:
        return [default] * count
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise RequestError(f"{key}: {len(values)} values for {count} prompts")
    for v in values:
        _check_type(key, v, kind)
    return values


def parse_generate(body: Any, tokenizer: Any) -> tuple[list[Item], bool]:
    """(items, batched) from a /generate body; `batched` when the prompts came as a list."""
    if not isinstance(body, dict):
        raise _contract("invalid type: request body, expected a map")
    for key in UNSUPPORTED_GENERATE_FIELDS:
        if body.get(key) not in (None, False, [], {}):
            raise RequestError(f"{key}: not supported by megapkl serve (it serves "
                               f"{', '.join(GENERATE_FIELDS)})")
    # Other keys are ignored, as SGLang ignores unknown top-level keys (sglang-router adds some).
    if body.get("stream"):
        raise RequestError("stream: streaming responses are not supported by megapkl serve")
    prompts, batched = _prompts(body, tokenizer)
    count = len(prompts)
    rids = _rids(body.get("rid"), count, batched)
    sps = body.get("sampling_params")
    sps = sps if isinstance(sps, list) else [sps] * count
    if len(sps) != count:
        raise RequestError(f"sampling_params: {len(sps)} entries for {count} prompts")
    logprob = _per_item(body, "return_logprob", count, False, "bool")
    start = _per_item(body, "logprob_start_len", count, -1, "int")
    topk = _per_item(body, "top_logprobs_num", count, 0, "int")
    routed = body.get("return_routed_experts", False)
    _check_type("return_routed_experts", routed, "bool")
    routed_start = body.get("routed_experts_start_len", 0)
    _check_type("routed_experts_start_len", routed_start, "int")
    text_lp = body.get("return_text_in_logprobs", False)
    _check_type("return_text_in_logprobs", text_lp, "bool")
    return [Item(p, r, sp or {}, lp, s, k, routed, routed_start, text_lp)
            for p, r, sp, lp, s, k in zip(prompts, rids, sps, logprob, start, topk)], batched


def _prompts(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise RequestError("Either text or input_ids should be provided (exactly one).")
    if text is not None:
        if tokenizer is None:
            raise RequestError("text: this server has no tokenizer (started without one); send "
                               "input_ids")
        texts = text if isinstance(text, list) else [text]
        return [list(tokenizer.encode(t)) for t in texts], isinstance(text, list)
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    rows = ids if batched else [ids]
    for row in rows:
        if not isinstance(row, list) or not row or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in row):
            raise _contract("invalid type: `input_ids`, expected a non-empty list of integers "
                            "or a list of such lists")
    return rows, batched


def _rids(rid: Any, count: int, batched: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [rid] if not batched else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        return rid
    raise RequestError("The specified rids length mismatch with the batch_size for batch "
                       "processing.")


# ---------------------------------------------------------------- /generate responses


def finish_reason(sample: Sample) -> dict:
    if sample.finish_reason == "stop" and sample.matched is not None:  # a stop string
        return {"type": "stop", "matched": sample.matched}
    if sample.finish_reason == "stop":
        return {"type": "stop", "matched": int(sample.response_ids[-1])}
    return {"type": "length", "length": sample.response_len}


def _lp_entry(logp: Optional[float], token: int, text: bool, tokenizer: Any) -> list:
    t = tokenizer.decode([token]) if text and tokenizer is not None else None
    return [logp, token, t]


def expand_layers(experts: torch.Tensor, moe_layers: list[int], num_layers: int) -> torch.Tensor:
    """[rows, moe_layers, k] -> [rows, num_hidden_layers, k]: SGLang's layer axis covers every
    hidden layer; dense layers' slots stay 0."""
    out = torch.zeros(experts.shape[0], num_layers, experts.shape[2], dtype=torch.int32)
    out[:, moe_layers] = experts.to(torch.int32)
    return out


def encode_routed_experts(experts: torch.Tensor) -> str:
    """base64 of little-endian int32 [rows, layers, k] (np.frombuffer(..., np.int32) decodes)."""
    return base64.b64encode(experts.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
                            ).decode("ascii")


def decode_routed_experts(text: str, num_layers: int, top_k: int) -> np.ndarray:
    """The client side of `encode_routed_experts` (SGLang's documented decoding)."""
    return np.frombuffer(base64.b64decode(text), dtype=np.int32).reshape(-1, num_layers, top_k)


# ---------------------------------------------------------------- small response helpers


def _spans(spans: list, length: int) -> list[dict]:
    out = []
    for i, (version, start) in enumerate(spans):
        end = spans[i + 1][1] if i + 1 < len(spans) else length
        start, end = min(start, length), min(end, length)
        if end > start or not out:
            out.append({"version": version, "start": start, "end": end})
    return out


def response_text(sample: Sample, sampling: dict, tokenizer: Any) -> str:
    """The response's text as SGLang's detokenizer gives it: a stop token left out unless
    no_stop_trim, the text cut at a stop string (after it with no_stop_trim)."""
    keep = bool(sampling.get("no_stop_trim") or False)
    ids = sample.response_ids.tolist()
    if sample.finish_reason == "stop" and sample.matched is None and not keep:
        ids = ids[:-1]
    return trim_text(tokenizer.decode(ids, skip_special_tokens=True), sample.matched, keep)
