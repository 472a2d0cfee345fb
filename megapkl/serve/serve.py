"""`megapkl serve`: the embedded torch engine behind SGLang's native HTTP API (it is not SGLang).

    megapkl serve --model-config tiny-qwen3 --port 30000
    megapkl serve --hf-checkpoint DIR --port 30000 --enable-return-routed-experts

Routes, payloads, response shapes and error bodies follow SGLang 0.5.x (`docs/serve.md` lists
them); `serve_protocol` declares the request fields this server reads and parses/encodes the
wire format, `serve_state` holds the engine, pause state and weight paths (and builds them from
the command line), `serve_http` is the HTTP layer (the standard library's ThreadingHTTPServer, one thread per
connection); this module has the routes, a semaphore bounding the requests in flight (generation
serialized through the engine) and the CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch

from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sglang.http import is_loopback
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.serve.serve_protocol import (Item, _contract, _lp_entry, _Reply, _spans,
                                            encode_routed_experts, expand_layers, finish_reason,
                                            parse_generate, parse_sampling, response_text,
                                            validate_body, validation_error)
from megapkl.serve.serve_http import _Untyped, make_http_server
from megapkl.serve.serve_state import (InterruptibleEngine, Job, RequestError, ServeState,
                                         _Interrupted, build_state, write_weight_digest)

log = logging.getLogger("megapkl.serve")

# ---------------------------------------------------------------- the server


class SGLangCompatServer:
    """Routes of SGLang's native HTTP API over a `ServeState`."""

    def __init__(self, state: ServeState, *, tokenizer: Any = None, max_running: int = 64,
                 host: str = "127.0.0.1", port: int = 30000, tp_size: int = 1,
                 allow_tensor_updates: bool = True, no_memory_file: Optional[str] = None,
                 die: Optional[Callable[[str], None]] = None):
        self.state, self.tokenizer = state, tokenizer
        # Where SGLang's scheduler would die (a forward over released memory, a resume that
        # finds no room) this server dies too; tests that run it in their own process pass
        # `die` to see the death without losing the process.
        self.die = die or _exit_like_sglang
        self.no_memory_file = no_memory_file  # exists: the GPU has no room for a resume
        self.health_generates = _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)
        self.health_timeout_s = float(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        self.allow_tensor_updates = allow_tensor_updates
        self.host, self.port, self.tp_size = host, port, tp_size
        self._slots = threading.BoundedSemaphore(max_running)
        self._jobs: set[Job] = set()
        self._jobs_lock = threading.Lock()
        self._start = time.time()
        # /server_info reports the launch configuration (SGLang's resolved server arguments);
        # what a weight update changes (model path, version) is reported by /model_info.
        self._launch = {"model_path": state.model_path, "weight_version": state.weight_version}
        self.httpd: Optional[ThreadingHTTPServer] = None
        cfg = state.engine.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.moe_layers = _moe_layers(state.engine)
        self.post: dict[str, Callable[[dict], Any]] = {
            "/generate": self.generate, "/update_weights_from_tensor": self.update_from_tensor,
            "/update_weights_from_disk": self.update_from_disk,
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/begin_weight_update": self.begin_update, "/end_weight_update": self.end_update,
            "/update_weight_version": self.update_version, "/pause_generation": self.pause,
            "/continue_generation": self.resume, "/abort_request": self.abort,
            "/flush_cache": self.flush_cache, "/release_memory_occupation": self.release,
            "/resume_memory_occupation": self.resume_memory,
            "/get_weights_by_name": self.weights_by_name,
        }
        self.get: dict[str, Callable[[], Any]] = {
            "/health": self.health, "/health_generate": self.health_generate,
            "/model_info": self.model_info, "/get_model_info": self.model_info,
            "/server_info": self.server_info, "/get_server_info": self.server_info,
            "/flush_cache": lambda: self.flush_cache({}),
            "/release_memory_occupation": lambda: self.release({}),
            "/resume_memory_occupation": lambda: self.resume_memory({}),
        }

    # ------------------------------------------------------------ generate

    def generate(self, body: dict) -> Any:
        items, batched = parse_generate(body, self.tokenizer)
        with self._slots:
            outputs = self._run_items(items)
        return outputs if batched or len(outputs) > 1 else outputs[0]

    def _groups(self, items: list[Item]) -> list[tuple[list[Item], SamplingParams, int]]:
        """The items that share one engine call, with its sampling and n: equal settings (one
        seed: the engine seeds each prompt from it and the prompt's place), or settings that
        differ in the seed alone (a seeded group comes as n copies of its prompt with a seed
        each), each prompt then drawn from its own seed as if it had come alone."""
        engine = self.state.engine
        vocab, eos = engine.config.vocab_size, engine.eos_token_ids
        groups: dict[str, list[tuple[Item, SamplingParams, int]]] = {}
        for item in items:
            self._validate_item(item)
            alone, n = parse_sampling(item.sampling, vocab, eos, self.tokenizer)  # bad: 400
            rest = {k: v for k, v in item.sampling.items() if k != "sampling_seed"}
            key = json.dumps([rest, alone.seed is not None, item.top_logprobs_num, item.routed],
                             sort_keys=True)
            groups.setdefault(key, []).append((item, alone, n))
        out = []
        for members in groups.values():
            sampling, n = members[0][1], members[0][2]
            if len({alone.seed for _, alone, _ in members}) > 1:
                sampling = dataclasses.replace(sampling, seed=None, prompt_seeds=tuple(
                    alone.seed_of(0) for _, alone, _ in members))
            out.append(([item for item, _, _ in members], sampling, n))
        return out

    def _run_items(self, items: list[Item]) -> list[dict]:
        engine = self.state.engine
        for group, sampling, n in self._groups(items):
            want_routed = group[0].routed and self.state.enable_routed_experts
            sampling = dataclasses.replace(sampling, topk_logprobs=group[0].top_logprobs_num,
                                           return_routed_experts=want_routed)
            self._check_lengths(group, sampling)
            job = Job([PromptItem(torch.tensor(i.prompt_ids)) for i in group], n, sampling,
                      [i.rid for i in group], admitted=self.state.admit_epoch())
            self._execute(job, group, n)
        out = []
        for item in items:
            out.extend(self._format(item, s, j, len(item.samples))
                       for j, s in enumerate(item.samples))
            if item.error is not None:
                n = parse_sampling(item.sampling, engine.config.vocab_size, (),
                                   self.tokenizer)[1]
                out.extend(self._aborted(item, j, n) for j in range(n))
        return out

    def _execute(self, job: Job, group: list[Item], n: int) -> None:
        self._forward_check()
        with self._jobs_lock:
            self._jobs.add(job)
        try:
            samples = self.state.run(job)
        except _Interrupted:
            for item in group:
                item.error = "Abort in waiting queue" if not job.spans else "Aborted by request"
            return
        finally:
            with self._jobs_lock:
                self._jobs.discard(job)
        for k, item in enumerate(group):
            item.samples = samples[k * n:(k + 1) * n]
            item.spans, item.retractions = list(job.spans), job.retractions

    def _validate_item(self, item: Item) -> None:
        if item.top_logprobs_num < 0:
            raise RequestError(f"top_logprobs_num must be >= 0, got {item.top_logprobs_num}")
        vocab = self.state.engine.config.vocab_size
        if item.top_logprobs_num > vocab:
            raise RequestError(f"top_logprobs_num ({item.top_logprobs_num}) exceeds the "
                               f"vocabulary ({vocab})")
        p = len(item.prompt_ids)
        if item.return_logprob and not -1 <= item.logprob_start_len <= p:
            raise RequestError(f"logprob_start_len ({item.logprob_start_len}) must be in "
                               f"[-1, {p}] (the prompt has {p} tokens)")
        if item.routed and not 0 <= item.routed_start <= p:
            raise RequestError(f"routed_experts_start_len ({item.routed_start}) must be in "
                               f"[0, {p}] (the prompt has {p} tokens)")

    def _check_lengths(self, group: list[Item], sampling: SamplingParams) -> None:
        cfg = self.state.engine.config
        limit = getattr(cfg, "max_position_embeddings", None)
        for item in group:
            if any(t < 0 or t >= cfg.vocab_size for t in item.prompt_ids):
                raise RequestError(f"input_ids: token ids outside the vocabulary "
                                   f"[0, {cfg.vocab_size})")
            if limit is not None and len(item.prompt_ids) + sampling.max_new_tokens > limit:
                raise RequestError(f"The input ({len(item.prompt_ids)} tokens) plus "
                                   f"max_new_tokens {sampling.max_new_tokens} is longer than the "
                                   f"model's context length ({limit} tokens).")

    def _format(self, item: Item, s: Sample, j: int, n: int) -> dict:
        tok = self.tokenizer
        rid = item.rid if n == 1 else f"{item.rid}_{j}"
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish_reason(s), "prompt_tokens": s.prompt_len,
            "completion_tokens": s.response_len, "cached_tokens": 0,
            "weight_version": item.spans[-1][0],
            "weight_versions": _spans(item.spans, s.response_len),
            "num_retractions": item.retractions,
            "e2e_latency": None,
        }
        if item.return_logprob:
            meta.update(self._logprobs(item, s))
        if item.routed and s.routed_experts is not None:
            experts = expand_layers(s.routed_experts, self.moe_layers, self.num_layers)
            meta["routed_experts"] = encode_routed_experts(experts[item.routed_start:])
        out = {"output_ids": s.response_ids.tolist(), "meta_info": meta}
        if tok is not None:
            out["text"] = response_text(s, item.sampling, tok)
        return out

    def _logprobs(self, item: Item, s: Sample) -> dict:
        text, tok = item.text_in_logprobs, self.tokenizer
        ids, lps = s.response_ids.tolist(), s.logp_behav.tolist()
        meta: dict[str, Any] = {
            "output_token_logprobs": [_lp_entry(lp, t, text, tok) for lp, t in zip(lps, ids)],
            "output_token_logprobs_length": len(ids),
            "input_token_logprobs": [], "input_top_logprobs": [], "output_top_logprobs": [],
        }
        if item.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [_lp_entry(v, i, text, tok) for v, i in zip(vals, tids)]
                for vals, tids in zip(s.topk_logp.tolist(), s.topk_ids.tolist())]
        if 0 <= item.logprob_start_len < s.prompt_len:
            meta.update(self._input_logprobs(item, s.temperature))
        return meta

    def _input_logprobs(self, item: Item, temperature: float) -> dict:
        """Prompt-token log-probs from position logprob_start_len (the first one has none)."""
        ids = torch.tensor(item.prompt_ids)[None].to(self.state.engine.device)
        with self.state._engine_lock, torch.no_grad():
            logits = self.state.engine.model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1).cpu()
        text, tok, k = item.text_in_logprobs, self.tokenizer, item.top_logprobs_num
        tokens, tops = [], []
        for pos in range(item.logprob_start_len, len(item.prompt_ids)):
            token = item.prompt_ids[pos]
            if pos == 0:
                tokens.append(_lp_entry(None, token, text, tok))
                tops.append(None)
                continue
            tokens.append(_lp_entry(float(logp[pos - 1, token]), token, text, tok))
            if k:
                vals, tids = torch.topk(logp[pos - 1], k)
                tops.append([_lp_entry(v, i, text, tok) for v, i in
                             zip(vals.tolist(), tids.tolist())])
        return {"input_token_logprobs": tokens, "input_top_logprobs": tops if k else []}

    def _aborted(self, item: Item, j: int, n: int) -> dict:
        rid = item.rid if n == 1 else f"{item.rid}_{j}"
        meta = {"id": rid, "finish_reason": {"type": "abort", "message": item.error},
                "prompt_tokens": len(item.prompt_ids), "completion_tokens": 0,
                "cached_tokens": 0, "weight_version": self.state.weight_version,
                "weight_versions": [], "num_retractions": 0}
        if item.return_logprob:
            meta.update(output_token_logprobs=[], output_top_logprobs=[],
                        input_token_logprobs=[], input_top_logprobs=[],
                        output_token_logprobs_length=0)
        return {"output_ids": [], "meta_info": meta}

    # ------------------------------------------------------------ weights

    def _after_update(self, body: dict, message: str) -> dict:
        """SGLang's post-load steps: new version, then the cache flush that fails while requests
        are still running (the weights stay loaded); a version given with the update is named in
        the message, as SGLang's tokenizer manager does."""
        self.state.set_version(body.get("weight_version"))
        if body.get("flush_cache", True) and self._has_requests():
            raise _Reply(400, {"success": False, "message": (
                "Weights were updated, but the cache was not flushed because requests are still "
                "running or queued. Retract or finish them, then call /flush_cache.")})
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return {"success": True, "message": message}

    def _has_requests(self) -> bool:
        if self.state.busy():
            return True
        with self._jobs_lock:
            return bool(self._jobs) and self.state.paused is None

    def _abort_first(self, body: dict) -> None:
        if body.get("abort_all_requests"):
            self.state.abort(abort_all=True)

    def update_from_tensor(self, body: dict) -> dict:
        """Every refusal is SGLang's {"success": false, "message"} (outside a session, a payload
        that does not decode, a weight the model refuses)."""
        if not self.allow_tensor_updates:
            raise _failed("update_weights_from_tensor is disabled: the server listens on "
                          f"{self.host}, not loopback (see --allow-remote-weight-updates)")
        self._abort_first(body)
        try:
            self.state.update_from_tensor(body["serialized_named_tensors"],
                                          body.get("load_format"))
        except RequestError as exc:
            raise _failed(str(exc)) from None
        return self._after_update(body, "Success")

    def update_from_disk(self, body: dict) -> dict:
        self._abort_first(body)
        try:
            self.state.update_from_disk(str(body["model_path"]))
        except RequestError as exc:
            raise _Reply(400, {"success": False, "message": str(exc), "num_paused_requests": 0})
        out = self._after_update(body, "Succeeded to update model weights.")
        return {**out, "num_paused_requests": 0}

    def init_group(self, body: dict) -> dict:
        try:
            self.state.init_group(str(body["master_address"]), int(body["master_port"]),
                                  int(body["rank_offset"]), int(body["world_size"]),
                                  str(body.get("group_name", "weight_update_group")),
                                  str(body.get("backend", "nccl")))
        except RequestError:
            raise
        except Exception as exc:
            raise _Reply(400, {"success": False, "message":
                               f"Failed to initialize custom process group: {exc}."})
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> dict:
        try:
            self.state.destroy_group(str(body.get("group_name", "weight_update_group")))
        except RequestError as exc:
            raise _failed(str(exc)) from None
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_from_distributed(self, body: dict) -> dict:
        self._abort_first(body)
        try:
            self.state.update_from_distributed(
                body["names"], body["dtypes"], body["shapes"],
                str(body.get("group_name", "weight_update_group")), body.get("load_format"))
        except RequestError as exc:
            raise _failed(str(exc)) from None
        return self._after_update(body, "Succeeded to update parameter online.")

    def begin_update(self, body: dict) -> dict:
        return self._session_reply(*self.state.begin_session())

    def end_update(self, body: dict) -> dict:
        return self._session_reply(*self.state.end_session())

    @staticmethod
    def _session_reply(ok: bool, message: str) -> dict:
        if not ok:
            raise _Reply(400, {"success": False, "message": message})
        return {"success": True, "message": message}

    def update_version(self, body: dict) -> dict:
        if body.get("abort_all_requests", True):
            self.state.abort(abort_all=True)
        self.state.set_version(str(body["new_version"]))
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    # ------------------------------------------------------------ control

    def pause(self, body: dict) -> dict:
        self.state.pause(body.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> dict:
        self.state.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort(self, body: dict) -> str:
        with self._jobs_lock:
            jobs = list(self._jobs)
        self.state.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all")), jobs=jobs)
        return ""

    def flush_cache(self, body: dict) -> Any:
        """Plain text without a content type, as SGLang's route answers."""
        if self._has_requests():
            raise _Reply(400, _Untyped("Flush cache failed.\n"))
        return _Untyped("Cache flushed.\nPlease check backend logs for more details. (When "
                        "there are running or waiting requests, the operation will not be "
                        "performed.)\n")

    def _forward_check(self) -> None:
        """A forward over released memory: SGLang's scheduler touches unmapped weights, KV cache
        or CUDA graphs, the CUDA error ends it and it takes the server down (SIGQUIT to the
        parent, which kills its process tree)."""
        if self.state.released_tags:
            self.die(f"Scheduler hit an exception: a forward pass ran while the memory "
                     f"{sorted(self.state.released_tags)} is released (illegal memory access)")

    def release(self, body: dict) -> None:
        """Weights and activations of the embedded engine stay where they are (nothing to hand
        back on CPU); the released tags are kept, with SGLang's refusals: resuming a tag that is
        not released (a fresh server) is refused; releasing while a request runs ends the
        server, as SGLang's scheduler asserts it is idle there and its assertion error ends it
        (SIGQUIT to the parent)."""
        if self.state.busy():
            self.die("Scheduler hit an exception: AssertionError: release_memory_occupation "
                     "should be called only when server is idle.")
            raise _Reply(500, {"error": {"message": "the scheduler exited"}})
        self.state.released_tags.update(_tags(body))
        return None

    def resume_memory(self, body: dict) -> None:
        if self.no_memory_file and os.path.exists(self.no_memory_file):
            # torch_memory_saver re-creates the memory with cuMemCreate inside the scheduler:
            # out of memory there is an exception in the scheduler, which ends the server.
            self.die("Scheduler hit an exception: CUDA out of memory while resuming "
                     f"{_tags(body)} (the GPU has no room: {self.no_memory_file} exists)")
        for tag in _tags(body):
            if tag not in self.state.released_tags:
                raise _Reply(400, {"error": {"message": repr(tag)}})  # SGLang's KeyError
            self.state.released_tags.discard(tag)
        return None

    # ------------------------------------------------------------ info / health

    def weights_by_name(self, body: dict) -> list:
        """SGLang's /get_weights_by_name: the first `truncate_size` rows of a weight as the engine
        computes with it (an FP8 server's dequantized weight), as float lists. Read by the
        scheduler, as in SGLang, so never half-way through a weight load."""
        name, rows = body.get("name"), body.get("truncate_size", 100)
        param = dict(self.state.engine.model.named_parameters(remove_duplicate=False)).get(name)
        if param is None:
            raise RequestError(f"name: {name!r} is not a weight of the served model")
        if not isinstance(rows, int) or rows < 1:
            raise RequestError(f"truncate_size: expected an int >= 1, got {rows!r}")
        with self.state.scheduler:
            return param.detach()[:rows].float().cpu().tolist()

    def health(self) -> str:
        """SGLang serves /health with /health_generate's handler: a generation, unless
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (then a plain 200)."""
        return self.health_generate() if self.health_generates else ""

    def health_generate(self) -> str:
        """One greedy token through the engine unless a request is running (then the running
        request proves the engine works, as in SGLang). A scheduler blocked (in a weight load)
        does not answer: 503 after SGLANG_HEALTH_CHECK_TIMEOUT seconds, as SGLang's route."""
        if not self.state.scheduler.acquire(timeout=self.health_timeout_s):
            log.error("Health check failed: no answer from the scheduler for %.0f s",
                      self.health_timeout_s)
            raise _Reply(503, _Untyped(""))
        self.state.scheduler.release()
        if self.state.paused is not None or self.state.busy():
            return ""
        self._forward_check()
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
        job = Job([PromptItem(torch.tensor([0]))], 1, sampling, ["HEALTH_CHECK"],
                  admitted=self.state.admit_epoch())
        try:
            self.state.run(job)
        except _Interrupted:
            pass
        return ""

    def model_info(self) -> dict:
        cfg = self.state.engine.config
        return {"model_path": self.state.model_path,
                "served_model_name": self.state.served_model_name,
                "tokenizer_path": self._tokenizer_path(),
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.state.weight_version, "load_format": "auto",
                "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None)}

    def server_info(self) -> dict:
        return {"model_path": self._launch["model_path"],
                "served_model_name": self.state.served_model_name,
                "tokenizer_path": self._tokenizer_path(),
                "host": self.host, "port": self.port, "tp_size": self.tp_size, "dp_size": 1,
                "pp_size": 1, "ep_size": 1,
                "enable_return_routed_experts": self.state.enable_routed_experts,
                "skip_tokenizer_init": self.tokenizer is None,
                "context_length": None,  # the launch value: this server takes the model's
                "device": str(self.state.engine.device),
                "dtype": str(self.state.engine.dtype).replace("torch.", ""),
                "weight_version": self._launch["weight_version"], "startup_time": self._start,
                "internal_states": [{"paused": self.state.paused,
                                     "released_tags": sorted(self.state.released_tags)}],
                "version": "megapkl-serve", "frontend": "megapkl"}

    def _tokenizer_path(self) -> Optional[str]:
        """SGLang's tokenizer path defaults to the model path (also under skip_tokenizer_init)."""
        return getattr(self.tokenizer, "name_or_path", None) or self.state.model_path

    # ------------------------------------------------------------ serving

    def dispatch(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """(status, body) for one request; every refusal is a 4xx with SGLang's error shapes."""
        route = path.split("?", 1)[0]
        try:
            if method == "GET" and route in self.get:
                return 200, self.get[route]()
            if method in ("POST", "PUT") and route in self.post:
                if route == "/generate":
                    if not isinstance(body, dict):
                        raise _contract("invalid type: request body, expected a JSON object")
                elif route == "/flush_cache":
                    body = {}
                else:
                    body = validate_body(route, body)
                return 200, self.post[route](body)
            if route in self.get or route in self.post:
                return 405, {"detail": "Method Not Allowed"}
            return 404, {"detail": "Not Found"}
        except _Reply as reply:
            return reply.status, reply.body
        except RequestError as exc:
            return 400, {"error": {"message": str(exc)}}

    def serve_forever(self) -> None:
        self.httpd = make_http_server(self, self.host, self.port)
        self.port = self.httpd.server_address[1]
        log.info("megapkl serve listening on http://%s:%d", self.host, self.port)
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self.httpd.server_close()
            self.state.close()


def _failed(message: str) -> _Reply:
    """A weight route's refusal: SGLang answers 400 {"success": false, "message": ...}."""
    return _Reply(400, {"success": False, "message": message})


def _exit_like_sglang(message: str) -> None:
    log.error(message)
    logging.shutdown()
    os._exit(1)


def _env_bool(name: str, default: bool) -> bool:
    """SGLang's EnvBool reading (environ.py): true/1/yes/y, false/0/no/n, anything else an
    error."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes", "y"):
        return True
    if value.lower() in ("false", "0", "no", "n"):
        return False
    raise SystemExit(f"megapkl serve: error: {name}={value!r} is not a valid boolean value")


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's memory regions, in its order


def _tags(body: dict) -> list[str]:
    return list(body.get("tags") or MEMORY_TAGS)


def _moe_layers(engine: InterruptibleEngine) -> list[int]:
    """Indices of the layers whose MLP has a router, in the engine's recording order."""
    out = []
    for name, _ in engine.model.named_modules():
        parts = name.split(".")
        if name.endswith("mlp.gate") and "layers" in parts:
            out.append(int(parts[parts.index("layers") + 1]))
    return out


# ---------------------------------------------------------------- building and the CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megapkl serve", description="The embedded torch engine "
                                "behind SGLang's native HTTP API (it is not SGLang; see "
                                "docs/serve.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="model spec name or YAML (configs/models/); random "
                     "weights from --seed until weights are pushed")
    src.add_argument("--hf-checkpoint", help="local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--allow-remote-weight-updates", action="store_true",
                   help="allow /update_weights_from_tensor (which unpickles request data) on a "
                   "non-loopback --host")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, if any)")
    p.add_argument("--served-model-name")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--quantization", choices=("fp8",), help="fp8: block-FP8 (W8A8) engine that "
                   "takes only FP8 weights (e4m3 + weight_scale_inv); an FP8 checkpoint turns "
                   "it on by itself")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--no-memory-file", help="testing: while this file exists, "
                   "/resume_memory_occupation finds no GPU memory and the server dies, as "
                   "SGLang's scheduler does")
    p.add_argument("--step-delay-s", type=float, default=0.0, help="testing: every forward "
                   "step of a generation takes this long more (a slow decode)")
    p.add_argument("--weight-load-delay-s", type=float, default=0.0, help="testing: every "
                   "/update_weights_from_disk blocks the scheduler this long first (a large "
                   "checkpoint)")
    p.add_argument("--weight-digest-file", help="testing: whenever a weight version is set, "
                   "write the SHA-256 of every weight, by name, with the version to this JSON file")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: Optional[list] = None) -> int:
    """`megapkl serve ...` (also `python -m megapkl.serve.serve ...`)."""
    return cmd_serve(build_parser().parse_args(argv))


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    allow_tensor = is_loopback(args.host) or args.allow_remote_weight_updates
    if not allow_tensor:
        log.warning("--host %s is not a loopback address: /update_weights_from_tensor (which "
                    "unpickles request data) is disabled; --allow-remote-weight-updates enables "
                    "it", args.host)
    elif not is_loopback(args.host):
        log.warning("--host %s with --allow-remote-weight-updates: anyone who can reach this "
                    "port can make the server unpickle data", args.host)
    state, tokenizer = build_state(args)
    app = SGLangCompatServer(state, tokenizer=tokenizer, max_running=args.max_running_requests,
                             host=args.host, port=args.port, allow_tensor_updates=allow_tensor,
                             no_memory_file=args.no_memory_file)
    state.load_delay_s = args.weight_load_delay_s
    state.step_delay_s = args.step_delay_s
    state.digest_file = args.weight_digest_file
    if state.digest_file:  # the weights it starts with: a restarted server never shows the
        # digest its predecessor left
        write_weight_digest(state.engine.model, state.weight_version, state.digest_file)
    try:
        app.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
