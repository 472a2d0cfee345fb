"""What runs inside the contract tests' SGLang process (see conftest.py): the pinned sglang,
imported for real behind `sglang_hook`, executing its own CPU-side code on what megapkl produced.

Every function here takes and returns plain data (argument lists, dicts, bytes), so the test
process never imports sglang. SGLang code executed, by function:

- `parse_server_args`: `ServerArgs.add_cli_args` (SGLang's argparse), `ServerArgs.from_cli_args`,
  `ServerArgs.resolve_once` (the resolution pipeline with its checks; it needs a device, and these
  machines have none that SGLang knows, so the parsed record gets `device="cpu"` before resolving).
- `memory_saver`: `TorchMemorySaverAdapter.create(enable=<resolved enable_memory_saver>)`.
- `quant_config`: `ModelConfig.from_server_args` on the served model directory and the loader's
  `get_quant_config` (what `DefaultModelLoader` calls when it builds the model).
- `llama_rope`: the served directory's config as `ModelConfig.from_server_args` loads it, its
  RoPE settings taken as `LlamaDecoderLayer.__init__` takes them (models/llama.py), and the
  rotary embedding SGLang's `get_rope` builds from them (its frequencies and cos/sin cache).
- `disk_loader`: the default-filling of `TokenizerManager.update_weights_from_disk` is one line
  (`load_format` None -> the server's own); this applies it and then runs `get_model_loader` and
  the `isinstance(loader, DefaultModelLoader)` check of `WeightUpdater.update_weights_from_disk`.
- `parse_router_args`: sglang_router's own `parse_router_args`.
- `stop_request`: a /generate body with stop strings, as a server started with `argv` takes it:
  the contract gate, `GenerateReqInput`, the tokenizer the tokenizer manager loads for those
  arguments (`get_tokenizer(tokenizer_path, ...)`, none under --skip-tokenizer-init), then
  `SamplingParams(**sampling_params).normalize(tokenizer)` (where `raise_if_tokenizer_required`
  refuses stop strings without one) and `.verify(vocab_size)`.
- `stop_matches`: SGLang's own stop-string check (`Req._check_str_based_finish`, `tail_str`,
  `_locate_str_stop_finished_len`), run after each token of given outputs as the scheduler runs it.
- `start_front`: SGLang's FastAPI application (`sglang.srt.entrypoints.http_server.app`: its
  routes, request-body validation into the io_struct classes, error handlers, response bodies)
  served by uvicorn on loopback, in front of `reference_backend.CpuBackend`.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any, Optional

_booted = False


def boot() -> None:
    """Process initializer: stand-ins for the stubbed packages, then SGLang's modules."""
    global _booted
    if _booted:
        return
    import warnings

    import sglang_hook

    sglang_hook.install()
    warnings.filterwarnings("ignore")
    logging.getLogger("sglang").setLevel(logging.ERROR)
    import sglang.srt.server_args  # noqa: F401  (import errors surface here, once)
    _booted = True


def stubs_used() -> list[str]:
    import sglang_hook

    return sorted(sglang_hook.used)


def imported(prefix: str = "sglang") -> list[str]:
    return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))


# ---------------------------------------------------------------- server and router arguments

def server_args(argv: list[str], resolve: bool = True):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    if resolve:
        args.device = "cpu"  # no accelerator here; megapkl's servers resolve it on their GPU
        args.resolve_once()
    return args


FIELDS = ("model_path", "host", "port", "tp_size", "ep_size", "dp_size", "mem_fraction_static",
          "skip_tokenizer_init", "load_format", "quantization", "kv_cache_dtype",
          "enable_return_routed_experts", "context_length", "enable_memory_saver", "base_gpu_id",
          "gpu_id_step", "dtype")


def parse_server_args(argv: list[str]) -> dict[str, Any]:
    """The resolved values of the fields megapkl sets, or {"error": ...}."""
    try:
        args = server_args(argv)
    except BaseException as exc:  # noqa: BLE001 - SystemExit from argparse included
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {f: getattr(args, f, None) for f in FIELDS}


def memory_saver(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    args = server_args(argv)
    adapter = TorchMemorySaverAdapter.create(enable=args.enable_memory_saver)
    # (the real adapter's `enabled` asks the CUDA allocator hook, stubbed here: not read)
    return {"adapter": type(adapter).__name__, "enable_memory_saver": args.enable_memory_saver}


def quant_config(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config

    args = server_args(argv)
    model_config = ModelConfig.from_server_args(args)
    out: dict[str, Any] = {"quantization": model_config.quantization,
                           "eos_token_ids": sorted(model_config.hf_eos_token_id or ())}
    if model_config.quantization is None:
        return out
    qc = get_quant_config(model_config, LoadConfig(load_format=args.load_format), {})
    out.update(cls=type(qc).__name__,
               checkpoint_fp8=getattr(qc, "is_checkpoint_fp8_serialized", None),
               weight_block_size=getattr(qc, "weight_block_size", None),
               activation_scheme=getattr(qc, "activation_scheme", None))
    return out


def llama_rope(argv: list[str], positions: int) -> dict[str, Any]:
    """SGLang's rotary embedding of the served Llama: (class, inv_freq, cos_sin_cache rows)."""
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.rotary_embedding.factory import get_rope

    config = ModelConfig.from_server_args(server_args(argv)).hf_config
    # LlamaDecoderLayer.__init__: rope_parameters when the config has them, else the 4.x keys
    rope = getattr(config, "rope_parameters", None)
    theta = rope.get("rope_theta", 10000) if rope is not None else getattr(config, "rope_theta")
    scaling = rope if rope is not None else getattr(config, "rope_scaling", None)
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    # the kernel choice at construction imports GPU kernels unless the platform is a CPU one;
    # the frequencies and the cache do not depend on it
    was, rope_base._is_cpu = rope_base._is_cpu, True
    try:
        emb = get_rope(head_dim, rotary_dim=head_dim, max_position=positions, base=theta,
                       rope_scaling=scaling, is_neox_style=getattr(config, "rope_is_neox_style",
                                                                   True))
    finally:
        rope_base._is_cpu = was
    return {"cls": type(emb).__name__, "inv_freq": emb._compute_inv_freq(emb.base).tolist(),
            "cos_sin_cache": emb.cos_sin_cache.float().tolist()}


def disk_loader(argv: list[str], body: dict) -> dict[str, Any]:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    args = server_args(argv)
    obj = UpdateWeightFromDiskReqInput(**body)
    if obj.load_format is None:
        obj.load_format = args.load_format
    loader = get_model_loader(LoadConfig(load_format=obj.load_format),
                              ModelConfig.from_server_args(args))
    return {"load_format": obj.load_format, "loader": type(loader).__name__,
            "accepted": isinstance(loader, DefaultModelLoader)}


def parse_router_args(argv: list[str]) -> dict[str, Any]:
    from sglang_router.launch_router import parse_router_args as parse

    try:
        args = parse(argv)
    except BaseException as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {k: v for k, v in dataclasses.asdict(args).items()
            if isinstance(v, (str, int, float, bool, list, type(None)))}


# ---------------------------------------------------------------- the HTTP front end

_front: Optional[Any] = None


def start_front(argv: list[str]) -> str:
    """SGLang's FastAPI app, answering as a server started with `argv` (a fresh backend: no
    session, no group, nothing loaded), on a loopback port: its URL."""
    global _front
    import reference_backend

    if _front is None:
        _front = reference_backend.serve()
    _front.use(reference_backend.CpuBackend(server_args(argv)))
    return _front.url


def front_log() -> list[dict]:
    """The io_struct objects SGLang's routes handed to the backend, in order (as plain data)."""
    return _front.backend.describe_log()


def front_reset() -> None:
    _front.backend.reset()


def front_received() -> list[tuple[str, str, list, bytes]]:
    """(name, dtype, shape, bytes) of every tensor the backend received, in order."""
    return _front.backend.received_tensors()


def front_state() -> dict:
    return _front.backend.state()


def pid() -> int:
    return os.getpid()


def generate_request(body: dict, vocab_size: int) -> dict[str, Any]:
    """A /generate body through SGLang's checks: the JSON contract gate of the route
    (`generate_contract_error`), `GenerateReqInput` with `normalize_batch_and_arguments`, and
    `SamplingParams(**sampling_params).verify(vocab_size)` for each sample. The samples are the
    ones the tokenizer manager sends to the scheduler (`_handle_batch_request`): item i of a
    batch (`obj[i]`), `parallel_sample_num` copies of it when n > 1; `seeds` lists their
    sampling_seed in answer order."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    error = generate_contract_error(body)
    if error is not None:
        return {"error": error}
    try:
        obj = GenerateReqInput(**body)
        obj.normalize_batch_and_arguments()  # n > 1 or a batch: one entry per sample
        if obj.is_single:
            items = [obj]
        else:
            items = [obj[i] for i in range(obj.batch_size) for _ in range(obj.parallel_sample_num)]
        per_sample = [dict(item.sampling_params or {}) for item in items]
        params = []
        for p in per_sample:
            params.append(SamplingParams(**p))
            params[-1].verify(vocab_size)
        unseeded = [{k: v for k, v in p.items() if k not in ("sampling_seed", "n")}
                    for p in per_sample]
        if any(p != unseeded[0] for p in unseeded):
            return {"error": f"samples of one prompt differ beyond their seed: {per_sample}"}
        prompts = {tuple(item.input_ids) for item in items}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    first, p0 = (lambda v: v[0] if isinstance(v, list) else v), params[0]
    return {"samples": len(items), "prompts": len(prompts),
            "return_logprob": first(obj.return_logprob),
            "logprob_start_len": first(obj.logprob_start_len),
            "top_logprobs_num": first(obj.top_logprobs_num),
            "return_routed_experts": first(obj.return_routed_experts),
            "max_new_tokens": p0.max_new_tokens, "temperature": p0.temperature,
            "top_p": p0.top_p, "top_k": p0.top_k, "n": obj.parallel_sample_num,
            "ignore_eos": p0.ignore_eos,
            "stop_token_ids": sorted(p0.stop_token_ids or ()),
            "seeds": [getattr(p, "sampling_seed", None) for p in params]}


def _tokenizer(args):
    """The tokenizer SGLang's tokenizer manager loads for these server arguments (a text-only
    model: `init_tokenizer_and_processor`), None under --skip-tokenizer-init."""
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    if args.skip_tokenizer_init:
        return None
    return get_tokenizer(args.tokenizer_path, tokenizer_mode=args.tokenizer_mode,
                         trust_remote_code=args.trust_remote_code, revision=args.revision,
                         tokenizer_backend=args.tokenizer_backend)


def stop_request(argv: list[str], body: dict, vocab_size: int) -> dict[str, Any]:
    """A single /generate body through what a server started with `argv` does with it before
    scheduling: the contract gate, GenerateReqInput, and its sampling_params normalized with the
    server's tokenizer and verified (see the module docstring)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    error = generate_contract_error(body)
    if error is not None:
        return {"error": error}
    try:
        args = server_args(argv)
        tokenizer = _tokenizer(args)
        obj = GenerateReqInput(**body)
        obj.normalize_batch_and_arguments()
        sp = SamplingParams(**obj.sampling_params)
        sp.normalize(tokenizer)
        sp.verify(vocab_size)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"skip_tokenizer_init": args.skip_tokenizer_init,
            "tokenizer_path": args.tokenizer_path, "input_ids": list(obj.input_ids),
            "stop_strs": list(sp.stop_strs), "stop_str_max_len": sp.stop_str_max_len,
            "no_stop_trim": sp.no_stop_trim, "max_new_tokens": sp.max_new_tokens,
            "sampling_seed": getattr(sp, "sampling_seed", None), "n": obj.parallel_sample_num,
            "return_logprob": obj.return_logprob, "logprob_start_len": obj.logprob_start_len,
            "top_logprobs_num": obj.top_logprobs_num,
            "return_routed_experts": obj.return_routed_experts,
            "routed_experts_start_len": obj.routed_experts_start_len}


def stop_matches(tokenizer_dir: str, stop: list[str], outputs: list[list[int]]) -> list:
    """For each output (token ids, generated one by one), where SGLang's scheduler finds a stop
    string: (tokens generated when it does, the matched string, finished_len), or None."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(tokenizer_dir)
    sp = SamplingParams(stop=stop, max_new_tokens=64)
    sp.normalize(tokenizer)

    class Output:  # a request's finish-check state, with Req's own methods
        tail_str = Req.tail_str
        _stop_match_tail_len = Req._stop_match_tail_len
        _locate_str_stop_finished_len = Req._locate_str_stop_finished_len
        _check_str_based_finish = Req._check_str_based_finish

        def __init__(self):
            self.sampling_params, self.tokenizer, self.decoded_text = sp, tokenizer, ""
            self.output_ids, self.finished_reason, self.finished_len = [], None, None

    out = []
    for ids in outputs:
        req, found = Output(), None
        for i in ids:
            req.output_ids.append(int(i))
            if req._check_str_based_finish(1):
                found = (len(req.output_ids), req.finished_reason.matched, req.finished_len)
                break
        out.append(found)
    return out


def deserialize(payload: str) -> list:
    """A tensor payload through `TpModelWorker.deserialize_own_rank`'s two steps:
    `monkey_patch_torch_reductions()` then `MultiprocessingSerializer.deserialize` (rank 0)."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    obj = MultiprocessingSerializer.deserialize(payload)
    out = []
    for name, t in obj:
        t = t.get(0) if hasattr(t, "get") and not isinstance(t, torch.Tensor) else t
        out.append((name, str(t.dtype).replace("torch.", ""), list(t.shape),
                    t.contiguous().view(torch.uint8).numpy().tobytes()))
    return out


def exit_now() -> None:
    """Leave without running the threads' and process groups' shutdown (the test is over)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
