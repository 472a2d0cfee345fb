"""SGLang's native HTTP API as megapkl uses it: the routes, the request fields, and pure functions
that build request bodies and decode responses into `Sample`s.

Everything the client sends is declared here as module-level data (`ROUTES`, `GENERATE_FIELDS`,
`SAMPLING_FIELDS`, `REQUEST_FIELDS`) so a test can check it against SGLang's own request classes.

Wire facts (SGLang 0.5.x):
- `/generate` answers one object per request, or a list in prompt-major order when `n > 1` or
  for a batch (`input_ids` a list of prompts, `sampling_params` one dict each, in that order).
- `sampling_seed` is read only under `--enable-deterministic-inference`, and a request's
  `sampling_params` is copied to each of its `n` samples, seed included: the n responses would all
  be the same. To such servers a seeded group goes as a batch of n copies of the prompt, with a
  seed each (`generate_payload(..., seed_each=True)`).
- `meta_info.output_token_logprobs`: [[logprob, token_id, text|null], ...] per response token;
  `output_top_logprobs`: per response token a list of [logprob, id, text] sorted descending.
- `meta_info.routed_experts`: base64 of int32 [P + C - 1 - S, num_hidden_layers, top_k] (C counts
  the stop token, S is `routed_experts_start_len`: the rows of positions S..P+C-2); the layer
  axis covers every hidden layer, dense layers' slots are zeros.
- `stop` (strings) ends a response once the decoded text of its last tokens holds one
  (rollout/stops.py): `finish_reason` {"type": "stop", "matched": "<the string>"} (a stop token:
  "matched" is its id); `output_ids` always keep the stop string, the text only with
  `no_stop_trim`. A server started with --skip-tokenizer-init refuses stop strings.
- `meta_info.weight_version`: a string, the version set by `/update_weight_version`.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from megapkl.errors import MegapklError
from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import FINISH_REASONS
from megapkl.rollout.seeds import prompt_seed

# ---------------------------------------------------------------- what the client calls

# (method, path) of every route the client, the weight sync and the fleet use.
ROUTES: dict[str, tuple[str, str]] = {
    "generate": ("POST", "/generate"),
    "health": ("GET", "/health"),
    "health_generate": ("GET", "/health_generate"),
    "model_info": ("GET", "/model_info"),
    "server_info": ("GET", "/server_info"),
    "flush_cache": ("POST", "/flush_cache"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "begin_weight_update": ("POST", "/begin_weight_update"),
    "end_weight_update": ("POST", "/end_weight_update"),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
    "init_weights_update_group": ("POST", "/init_weights_update_group"),
    "update_weights_from_distributed": ("POST", "/update_weights_from_distributed"),
    "destroy_weights_update_group": ("POST", "/destroy_weights_update_group"),
    "update_weight_version": ("POST", "/update_weight_version"),
    "release_memory_occupation": ("POST", "/release_memory_occupation"),
    "resume_memory_occupation": ("POST", "/resume_memory_occupation"),
}

# Top-level fields of a /generate body (SGLang's GenerateReqInput).
GENERATE_FIELDS = frozenset({"input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                             "top_logprobs_num", "return_routed_experts",
                             "routed_experts_start_len", "stream"})
# Keys of `sampling_params` (SGLang's closed SamplingParams set; an unknown key is HTTP 400).
SAMPLING_FIELDS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                             "ignore_eos", "n", "sampling_seed", "stop", "no_stop_trim"})
# Body fields per route (SGLang's request class of that route); routes absent here send `{}`.
REQUEST_FIELDS: dict[str, frozenset] = {
    "generate": GENERATE_FIELDS,
    "pause_generation": frozenset({"mode"}),
    "update_weights_from_tensor": frozenset({"serialized_named_tensors", "load_format",
                                             "flush_cache", "weight_version"}),
    "update_weights_from_disk": frozenset({"model_path", "load_format", "flush_cache",
                                           "weight_version"}),
    "init_weights_update_group": frozenset({"master_address", "master_port", "rank_offset",
                                            "world_size", "group_name", "backend"}),
    "update_weights_from_distributed": frozenset({"names", "dtypes", "shapes", "group_name",
                                                  "load_format", "flush_cache",
                                                  "weight_version"}),
    "destroy_weights_update_group": frozenset({"group_name"}),
    "update_weight_version": frozenset({"new_version", "abort_all_requests"}),
    "release_memory_occupation": frozenset({"tags"}),
    "resume_memory_occupation": frozenset({"tags"}),
}
PAUSE_MODES = ("retract", "abort", "in_place")


class ProtocolError(MegapklError, RuntimeError):
    """A response that does not follow SGLang's wire format (or contradicts the request)."""


def check_fields(route: str, body: dict) -> dict:
    """`body` unchanged, after checking it sends only the fields declared for `route` (keeps the
    declared sets honest: the fidelity test checks the sets, this checks what is really sent)."""
    allowed = REQUEST_FIELDS.get(route, frozenset())
    extra = set(body) - allowed
    if extra:
        raise AssertionError(f"{route}: sends undeclared fields {sorted(extra)}")
    if route == "generate":
        sps = body.get("sampling_params", {})
        extra = set().union(*(sps if isinstance(sps, list) else [sps])) - SAMPLING_FIELDS
        if extra:
            raise AssertionError(f"generate: sends undeclared sampling_params {sorted(extra)}")
    return body


# ---------------------------------------------------------------- /generate request

def sample_seed(seed: int, index: int) -> int:
    """The sampling_seed of response `index` of a prompt seeded `seed`: the rollout's own
    per-item seed mix (`seeds.prompt_seed`), kept below 2**31."""
    return prompt_seed(seed, index) & 0x7FFFFFFF


def sampling_payload(sampling: SamplingParams, n: int, seed: Optional[int]) -> dict[str, Any]:
    """SGLang `sampling_params` for one prompt's `n` responses."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "ignore_eos": bool(sampling.ignore_eos),
        "n": int(n),
    }
    if sampling.stop_token_ids is not None:
        params["stop_token_ids"] = [int(i) for i in sampling.stop_token_ids]
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.no_stop_trim:
        params["no_stop_trim"] = True
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def generate_payload(prompt_ids: Sequence[int], sampling: SamplingParams, n: int,
                     seed: Optional[int] = None, seed_each: bool = False,
                     routed_start: int = 0) -> dict[str, Any]:
    """A /generate body: one prompt, `n` responses, log-probs of the response tokens only
    (`logprob_start_len` -1), top-K when `sampling.topk_logprobs`, routed experts when asked
    (from position `routed_start` on: `routed_experts_start_len`).

    One request with `n`, unless `seed_each` (servers that draw from the seed alone) with a
    `seed` and n > 1: then a batch of n copies of the prompt whose response j is seeded
    `sample_seed(seed, j)` (n = 1 each), since SGLang gives every sample of one request the
    request's seed."""
    ids = [int(i) for i in prompt_ids]
    if seed_each and seed is not None and n > 1:
        prompts: Any = [ids] * n
        params: Any = [sampling_payload(sampling, 1, sample_seed(seed, j)) for j in range(n)]
    else:
        prompts, params = ids, sampling_payload(sampling, n, seed)
    body: dict[str, Any] = {
        "input_ids": prompts,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if sampling.topk_logprobs:
        body["top_logprobs_num"] = int(sampling.topk_logprobs)
    if sampling.return_routed_experts:
        body["return_routed_experts"] = True
        if routed_start:
            body["routed_experts_start_len"] = int(routed_start)
    return check_fields("generate", body)


def is_batch(body: dict) -> bool:
    """A /generate body with one sampling_params per sample (`seed_each`): sglang-router 0.3.2
    refuses those (HTTP 422, it reads sampling_params as one object)."""
    return isinstance(body.get("sampling_params"), list)


# ---------------------------------------------------------------- /generate response

@dataclass
class Decoded:
    """One response decoded from the wire (before it becomes a Sample)."""

    response_ids: Tensor  # [R] int64
    logp: Tensor  # [R] float32
    finish_reason: str
    version: int
    topk_ids: Optional[Tensor] = None  # [R, K]
    topk_logp: Optional[Tensor] = None
    routed_experts: Optional[Tensor] = None  # [P + R - 1 - start, moe_layers, top_k] int32
    text: Optional[str] = None
    matched: Optional[str] = None  # the stop string that ended the response, when one did


def as_response_list(payload: Any, n: int) -> list[dict]:
    """The `n` response objects of one prompt's /generate answer."""
    items = payload if isinstance(payload, list) else [payload]
    if len(items) != n or not all(isinstance(i, dict) for i in items):
        raise ProtocolError(f"/generate: expected {n} response object(s), got "
                            f"{len(items) if isinstance(payload, list) else type(payload).__name__}")
    return items


def parse_version(meta: dict) -> int:
    v = meta.get("weight_version")
    try:
        return int(str(v))
    except (TypeError, ValueError):
        raise ProtocolError(f"/generate: meta_info.weight_version {v!r} is not an integer version "
                            "(the servers must receive weights from megapkl first)") from None


def parse_finish(meta: dict) -> str:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in FINISH_REASONS:
        raise ProtocolError(f"/generate: unknown finish_reason {fr!r}")
    return kind


def matched_string(meta: dict) -> Optional[str]:
    """The stop string a `finish_reason` names (a stop token's "matched" is its id: None)."""
    fr = meta.get("finish_reason")
    matched = fr.get("matched") if isinstance(fr, dict) else None
    return matched if isinstance(matched, str) else None


def decode_token_logprobs(meta: dict, output_ids: Optional[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """(response ids [R], log-probs [R]) from `output_token_logprobs`, checked against output_ids."""
    rows = meta.get("output_token_logprobs")
    if rows is None:
        raise ProtocolError("/generate: meta_info has no output_token_logprobs (return_logprob)")
    ids = torch.tensor([int(r[1]) for r in rows], dtype=torch.int64)
    logp = torch.tensor([float(r[0]) for r in rows], dtype=torch.float32)
    if output_ids is not None and list(output_ids) != ids.tolist():
        raise ProtocolError(f"/generate: output_ids ({len(output_ids)}) and output_token_logprobs "
                            f"({len(rows)}) disagree")
    return ids, logp


def decode_top_logprobs(meta: dict, k: int, length: int) -> tuple[Tensor, Tensor]:
    """([R, K] ids, [R, K] log-probs) from `output_top_logprobs` (sorted descending)."""
    rows = meta.get("output_top_logprobs")
    if rows is None or len(rows) != length:
        raise ProtocolError(f"/generate: output_top_logprobs has "
                            f"{'no rows' if rows is None else len(rows)} rows, expected {length}")
    short = [len(r) for r in rows if r is None or len(r) < k]
    if short:
        raise ValueError(f"rollout.topk_logprobs: asked for K={k} top log-probs per token but the "
                         f"server returned {min(short)}; lower K or raise the server's limit")
    ids = torch.tensor([[int(e[1]) for e in r[:k]] for r in rows], dtype=torch.int64)
    logp = torch.tensor([[float(e[0]) for e in r[:k]] for r in rows], dtype=torch.float32)
    return ids.view(length, k), logp.view(length, k)


def moe_layer_indices(hf_config: dict) -> list[int]:
    """Hidden-layer indices that hold a sparse MoE block (Qwen3-MoE rules: not in
    `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0); [] for a dense model."""
    if not hf_config.get("num_experts"):
        return []
    step = int(hf_config.get("decoder_sparse_step", 1) or 1)
    dense = set(hf_config.get("mlp_only_layers") or [])
    return [i for i in range(int(hf_config["num_hidden_layers"]))
            if i not in dense and (i + 1) % step == 0]


def decode_routed_experts(meta: dict, *, prompt_len: int, response_len: int, num_hidden_layers: int,
                          moe_layers: Sequence[int], top_k: int, start: int = 0) -> Tensor:
    """int32 [P + R - 1 - start, len(moe_layers), top_k]: the trainer's replay rows of positions
    start.. (row i = the token at position start + i, whose successor was predicted), the MoE
    layers picked out of SGLang's all-layer axis."""
    raw = meta.get("routed_experts")
    if raw is None:
        raise ValueError("model.routing_replay: the server returned no routed_experts; start it "
                         "with --enable-return-routed-experts and serve a mixture-of-experts model")
    flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    rows = prompt_len + response_len - 1 - start
    if flat.size != rows * num_hidden_layers * top_k:
        raise ProtocolError(f"/generate: routed_experts holds {flat.size} ints, expected "
                            f"{rows} rows x {num_hidden_layers} layers x top-{top_k} "
                            f"(prompt {prompt_len} + response {response_len} - 1 rows"
                            + (f" from position {start})" if start else ")"))
    full = torch.from_numpy(flat.copy()).view(rows, num_hidden_layers, top_k)
    return full[:, list(moe_layers)].contiguous()


def decode_response(item: dict, *, prompt_len: int, sampling: SamplingParams,
                    hf_config: Optional[dict] = None, routed_start: int = 0) -> Decoded:
    """One response object of /generate -> `Decoded` (raises ProtocolError / ValueError);
    `routed_start`: the request's routed_experts_start_len."""
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError("/generate: response without meta_info")
    ids, logp = decode_token_logprobs(meta, item.get("output_ids"))
    out = Decoded(response_ids=ids, logp=logp, finish_reason=parse_finish(meta),
                  version=parse_version(meta), text=item.get("text"),
                  matched=matched_string(meta))
    if sampling.topk_logprobs:
        out.topk_ids, out.topk_logp = decode_top_logprobs(meta, sampling.topk_logprobs, len(ids))
    if sampling.return_routed_experts:
        cfg = hf_config or {}
        if not cfg.get("num_experts"):
            raise ValueError("model.routing_replay: return_routed_experts needs a "
                             "mixture-of-experts model (the trainer's model is dense)")
        out.routed_experts = decode_routed_experts(
            meta, prompt_len=prompt_len, response_len=len(ids),
            num_hidden_layers=int(cfg["num_hidden_layers"]), moe_layers=moe_layer_indices(cfg),
            top_k=int(cfg["num_experts_per_tok"]), start=routed_start)
    return out


def error_message(status: int, body: Any) -> str:
    """The human part of an SGLang error body ({"error": str | {"message": str}} or text)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return f"HTTP {status}: {err}"
    return f"HTTP {status}: {str(body)[:500]}"
