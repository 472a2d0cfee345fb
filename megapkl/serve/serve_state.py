"""The state behind `megapkl serve`: the embedded engine, pause / continue, weight-update sessions
and the three weight-update paths, independent of HTTP (see `megapkl.serve.serve`).

Concurrency model: generation runs one engine call at a time (`_engine_lock`); a pause flips a
condition that every decode step checks, so `abort` and `retract` interrupt a running call at the
next token and `in_place` parks it there (with its KV cache) until `/continue_generation`. Weight
updates take the engine lock when the server is not paused (they wait for the running call, as
SGLang's model-update lock does) and skip it when paused (the engine is idle or parked).
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from megapkl.config.local_files import TOKENIZER_FILES
from megapkl.errors import MegapklError
from megapkl.parallel.dist_internals import group_outside_world
from megapkl.rollout import fp8 as FP8
from megapkl.rollout.embedded import EmbeddedEngine, iter_safetensors
from megapkl.rollout.engine import SamplingParams, WeightUpdateError
from megapkl.rollout.sample import PromptItem, Sample

PAUSE_MODES = ("abort", "retract", "in_place")


class RequestError(MegapklError, ValueError):
    """A request the server refuses (answered with HTTP 400)."""


class _Interrupted(Exception):
    def __init__(self, mode: str):
        super().__init__(mode)
        self.mode = mode


class InterruptibleEngine(EmbeddedEngine):
    """EmbeddedEngine whose every forward (prefill and each decode step) first asks the server
    whether to go on, stop (abort / retract) or wait in place."""

    step_check = None  # set by ServeState: a callable run before each forward

    def _forward(self, ids, mask, pos, cache):
        if self.step_check is not None:
            self.step_check()
        return super()._forward(ids, mask, pos, cache)


# ---------------------------------------------------------------- tensor payloads (SGLang format)


@dataclass
class FlattenedTensorMetadata:
    """Stand-in for SGLang's dataclass of the same name (a pickled bucket refers to it by name)."""

    name: str = ""
    shape: Any = None
    dtype: Any = None
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


@dataclass
class LocalSerializedTensor:
    """Stand-in for SGLang's per-TP-rank wrapper: values[rank] is a nested serialized tensor."""

    values: list = field(default_factory=list)

    def get(self, rank: int) -> Tensor:
        return decode_tensor_payload(self.values[rank])


def _safe_storage_from_bytes(data: bytes):
    # torch's own helper would run an unrestricted torch.load; weights_only is the safe loader.
    return torch.load(io.BytesIO(data), weights_only=True)


_TORCH_TYPES = {"Size", "device", "dtype", "UntypedStorage", "FloatStorage", "HalfStorage",
                "BFloat16Storage", "DoubleStorage", "LongStorage", "IntStorage", "ByteStorage",
                "BoolStorage", "ShortStorage", "CharStorage", "Tensor"}
_ALLOWED = {
    ("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "set",
                               "frozenset", "str", "tuple", "slice")
} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "_reconstructor"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch.nn.parameter", "Parameter"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
} | {("torch", n) for n in _TORCH_TYPES}
_STAND_INS = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Only the globals a ForkingPickler dump of named tensors needs: containers, torch dtypes and
    sizes, and torch's tensor / shared-storage rebuild functions. Anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _STAND_INS:
            return _STAND_INS[(module, name)]
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_storage_from_bytes
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_fd"):
            raise RequestError("serialized_named_tensors: the sender shared CPU tensors by file "
                               "descriptor, which another process cannot open; call torch."
                               "multiprocessing.set_sharing_strategy('file_system') before "
                               "serializing")
        if (module, name) in _ALLOWED or (module == "torch" and name.endswith("dtype")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise RequestError(f"serialized_named_tensors: refused to unpickle global "
                           f"{module}.{name} (only tensors and plain containers are accepted)")


def decode_tensor_payload(data: Any) -> Any:
    """A MultiprocessingSerializer payload (base64 text or raw pickle bytes) -> Python object."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestError(f"serialized_named_tensors: not valid base64 ({exc})") from None
    if not isinstance(data, (bytes, bytearray)):
        raise RequestError(f"serialized_named_tensors: expected base64 strings, got "
                           f"{type(data).__name__}")
    try:
        return _RestrictedUnpickler(io.BytesIO(bytes(data))).load()
    except RequestError:
        raise
    except Exception as exc:  # truncated or foreign payloads, vanished shared memory
        raise RequestError(f"serialized_named_tensors: cannot decode the payload: "
                           f"{type(exc).__name__}: {exc}") from None


def named_tensors_from_payload(obj: Any, load_format: Optional[str], rank: int = 0
                               ) -> list[tuple[str, Tensor]]:
    """(name, tensor) pairs from a decoded payload: a list of pairs (load_format None / direct)
    or a {flattened_tensor, metadata} bucket (load_format flattened_bucket)."""
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise RequestError("load_format flattened_bucket: expected a mapping with "
                               "'flattened_tensor' and 'metadata'")
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in obj["metadata"]]
    if load_format not in (None, "direct"):
        raise RequestError(f"load_format: {load_format!r} is not supported by megapkl serve "
                           "(use null, 'direct' or 'flattened_bucket')")
    if not isinstance(obj, (list, tuple)):
        raise RequestError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    out = []
    for i, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise RequestError(f"serialized_named_tensors: entry {i} is not a (name, tensor) pair")
        name, tensor = pair
        if isinstance(tensor, LocalSerializedTensor):
            tensor = tensor.get(rank)
        out.append((name, tensor))
    return out


# ---------------------------------------------------------------- the server state


@dataclass(eq=False)  # identity semantics: jobs live in a set
class Job:
    """One engine call: prompts x n with one SamplingParams; `result` or `error` when done."""

    prompts: list[PromptItem]
    n: int
    sampling: SamplingParams
    rids: list[str]
    admitted: int  # abort epoch at admission: an abort-all after it aborts this job
    aborted: bool = False
    spans: list[tuple[str, int]] = field(default_factory=list)  # (weight_version, first step)
    retractions: int = 0  # times a `retract` pause sent it back to wait


class ServeState:
    """Engine, weight version, pause state and weight-update session of one server."""

    def __init__(self, engine: InterruptibleEngine, *, model_path: str, served_model_name: str,
                 enable_routed_experts: bool = False, weight_version: str = "default"):
        self.engine = engine
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.enable_routed_experts = enable_routed_experts
        self.weight_version = weight_version
        self._engine_version = engine.version or 0  # the engine's int version, bumped per load
        self._engine_lock = threading.Lock()
        self._cond = threading.Condition()
        self.paused: Optional[str] = None  # None or the pause mode
        self._abort_epoch = 0
        self._running: Optional[Job] = None
        self._parked = False  # the running job waits in place
        self._step = 0
        self._session = False
        self._groups: dict[str, Any] = {}
        self.digest_file: Optional[str] = None  # testing: see write_weight_digest
        # Shared-memory tensors of the last session's tensor updates, kept mapped: a client that
        # reuses its segments (megapkl's does) is then read without a page fault per 4 KiB.
        self._mapped: list[Tensor] = []
        self._mapped_before: list[Tensor] = []
        self.released_tags: set[str] = set()  # memory regions released and not resumed
        # Held while a weight update runs, as SGLang's scheduler is blocked in one: a health
        # check waits for it (and answers 503 after its timeout). `load_delay_s` (testing)
        # makes every disk update that long, like a large checkpoint read from disk.
        self.scheduler = threading.RLock()
        self.load_delay_s = 0.0
        self.step_delay_s = 0.0  # testing: each forward step takes this long more
        engine.step_check = self._step_check

    # ------------------------------------------------------------ generation

    def run(self, job: Job) -> list[Sample]:
        """Generate for `job`; raises _Interrupted('abort') when aborted. Retracted calls are
        redone from scratch after `/continue_generation` (with the weights then held)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.paused is None or self._aborted(job))
            if self._aborted(job):
                raise _Interrupted("abort")
            with self._engine_lock:
                with self._cond:
                    if self.paused is not None:
                        continue  # paused while waiting for the engine: wait again
                    if self._aborted(job):
                        raise _Interrupted("abort")
                    self._running, self._step = job, 0
                    job.spans = [(self.weight_version, 0)]
                try:
                    return self.engine.generate(job.prompts, job.n, job.sampling)
                except _Interrupted as stop:
                    if stop.mode == "abort":
                        raise
                    job.retractions += 1
                finally:
                    with self._cond:
                        self._running, self._parked = None, False
                        self._cond.notify_all()

    def _aborted(self, job: Job) -> bool:
        return job.aborted or job.admitted < self._abort_epoch

    def _step_check(self) -> None:
        """Before each forward of the running job: go on, stop, or wait in place."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        with self._cond:
            job = self._running
            if job is not None and self._aborted(job):
                raise _Interrupted("abort")
            if self.paused in ("abort", "retract"):
                raise _Interrupted(self.paused)
            if self.paused == "in_place":
                self._parked = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self.paused is None or
                                    (job is not None and self._aborted(job)))
                self._parked = False
                if job is not None and self._aborted(job):
                    raise _Interrupted("abort")
            if job is not None:
                if job.spans[-1][0] != self.weight_version:
                    job.spans.append((self.weight_version, self._step))
            self._step += 1

    def admit_epoch(self) -> int:
        with self._cond:
            return self._abort_epoch

    def abort(self, rid: Optional[str] = None, abort_all: bool = False,
              jobs: Iterable[Job] = ()) -> None:
        with self._cond:
            if abort_all:
                self._abort_epoch += 1
            else:
                for job in jobs:
                    if rid is not None and any(r == rid or r.startswith(f"{rid}_")
                                               for r in job.rids):
                        job.aborted = True
            self._cond.notify_all()

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode: expected one of {list(PAUSE_MODES)}, got {mode!r}")
        with self._cond:
            self.paused = mode
            if mode == "abort":
                self._abort_epoch += 1
            self._cond.notify_all()
            # Return once the engine is idle (abort / retract) or parked at a step (in_place).
            self._cond.wait_for(lambda: self._running is None or self._parked)

    def resume(self) -> None:
        with self._cond:
            self.paused = None
            self._cond.notify_all()

    def busy(self) -> bool:
        """Requests running on the engine (a parked in-place call counts)."""
        with self._cond:
            return self._running is not None

    # ------------------------------------------------------------ weights

    def _weights_context(self):
        """The engine lock unless paused: updating unpaused waits for the running call."""
        return _Nothing() if self.paused is not None else self._engine_lock

    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        if self.engine.fp8:  # an FP8 server takes FP8 weights only, as SGLang's FP8 parameters
            shapes = {n: tuple(p.shape) for n, p in self.engine.model.named_parameters()}
            named = FP8.check_fp8_stream(named, shapes, self.engine.fp8_block)
        with self.scheduler, self._weights_context():
            try:
                # Decoded payloads, broadcast buffers and disk reads belong to this request alone,
                # and a push is several requests anyway: each tensor is checked and written in
                # one read of its bytes (a bad value after a written piece tears the weights).
                self.engine.update_weights(named, version=self._engine_version + 1,
                                           streamed=True)
            except (WeightUpdateError, FP8.FP8Error) as exc:
                raise RequestError(str(exc)) from None
            self._engine_version += 1

    def begin_session(self) -> tuple[bool, str]:
        if self._session:
            return False, ("a weight-update session is already open; call end_weight_update() "
                           "first")
        self._session = True
        self._mapped_before, self._mapped = self._mapped, []
        return True, "Success"

    def end_session(self) -> tuple[bool, str]:
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = False
        self._mapped_before = []
        return True, "Success"

    def require_session(self, route: str) -> None:
        if not self._session:
            raise RequestError(f"{route} must run between begin_weight_update() and "
                               "end_weight_update()")

    def update_from_tensor(self, payloads: list, load_format: Optional[str]) -> None:
        self.require_session("update_weights_from_tensor")
        if not isinstance(payloads, list) or not payloads:
            raise RequestError("serialized_named_tensors: expected a non-empty list (one "
                               "payload per engine TP rank; this server has one rank)")
        named = named_tensors_from_payload(decode_tensor_payload(payloads[0]), load_format)
        self.load(named)
        self._mapped += [t for _, t in named if t.device.type == "cpu" and t.is_shared()]

    def update_from_disk(self, model_path: str) -> None:
        with self.scheduler:  # SGLang's scheduler reads the checkpoint itself
            time.sleep(self.load_delay_s)
            try:
                named = list(iter_safetensors(model_path))
            except (FileNotFoundError, OSError) as exc:
                raise RequestError(f"model_path: {exc}") from None
            self.load(named)
        self.model_path = model_path

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str, timeout_s: float = 300.0
                   ) -> None:
        if group_name in self._groups:
            raise RequestError(f"group_name: a weight-update group {group_name!r} already exists")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise RequestError("backend: 'nccl' needs the engine on a GPU; this server runs on "
                               f"{self.engine.device}, use backend 'gloo'")
        # The rendezvous of SGLang's init_custom_process_group: a TCP store prefixed by the
        # group name, ranks rank_offset + tp_rank (this server has one rank).
        url = f"tcp://{_host_for_url(master_address)}:{master_port}"
        self._groups[group_name] = group_outside_world(backend, url, rank_offset, world_size,
                                                       group_name, timeout_s)

    def destroy_group(self, group_name: str) -> None:
        import torch.distributed as dist

        pg = self._groups.pop(group_name, None)
        if pg is None:
            raise RequestError("The group to be destroyed does not exist.")
        dist.destroy_process_group(pg)

    def update_from_distributed(self, names: list, dtypes: list, shapes: list, group_name: str,
                                load_format: Optional[str]) -> None:
        import torch.distributed as dist

        self.require_session("update_weights_from_distributed")
        pg = self._groups.get(group_name)
        if pg is None:
            raise RequestError(f"group_name: no weight-update group {group_name!r}; call "
                               "/init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise RequestError("names, dtypes and shapes must be non-empty lists of one length")
        specs = [(n, _dtype(d), [int(s) for s in shape]) for n, d, shape in
                 zip(names, dtypes, shapes)]
        device = self.engine.device
        if load_format == "flattened_bucket":
            sizes = [torch.Size(s).numel() * d.itemsize for _, d, s in specs]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=0, group=pg)
            named, start = [], 0
            for (n, d, s), size in zip(specs, sizes):
                named.append((n, flat[start:start + size].view(d).reshape(s)))
                start += size
        elif load_format is None:
            named = []
            for n, d, s in specs:
                t = torch.empty(s, dtype=d, device=device)
                dist.broadcast(FP8.byte_view(t), src=0, group=pg)  # FP8 travels as bytes
                named.append((n, t))
        else:
            raise RequestError(f"load_format: {load_format!r} is not supported for distributed "
                               "updates (use null or 'flattened_bucket')")
        self.load(named)

    def set_version(self, version: Optional[str]) -> None:
        if version is not None:
            self.weight_version = str(version)
            if self.digest_file:
                write_weight_digest(self.engine.model, self.weight_version, self.digest_file)

    def close(self) -> None:
        import torch.distributed as dist

        for name in list(self._groups):
            try:
                dist.destroy_process_group(self._groups.pop(name))
            except Exception:  # best effort at shutdown
                pass


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise RequestError(f"dtypes: unknown torch dtype {name!r}")
    return value


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def write_weight_digest(model: torch.nn.Module, version: str, path: str) -> None:
    """Testing (`megapkl serve --weight-digest-file`): the SHA-256 of every weight the server
    computes with (float32 bytes, as /get_weights_by_name reads them), by name, with the weight
    version they were set at, written atomically whenever a version is set. A test outside the
    server's node (a Slurm job's) compares the servers' weights with the stored version that way,
    after the job, without reaching the servers."""
    import hashlib
    import json
    import os

    digests = {name: hashlib.sha256(p.detach().float().cpu().contiguous().numpy().tobytes())
               .hexdigest() for name, p in model.named_parameters(remove_duplicate=False)}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"version": version, "weights": digests}, fh)
    os.replace(tmp, path)


def build_state(args: Any) -> tuple[ServeState, Any]:
    """(state, tokenizer) from the CLI arguments: a model spec with seeded random weights, or a
    local HF checkpoint with its weights."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    tokenizer = _tokenizer(args.tokenizer or args.hf_checkpoint)
    fp8 = getattr(args, "quantization", None) == "fp8"
    if args.hf_checkpoint:
        from megapkl.rollout.embedded import iter_safetensors

        torch.manual_seed(args.seed)
        engine = InterruptibleEngine(args.hf_checkpoint, device=args.device, dtype=dtype,
                                     seed=args.seed, tokenizer=tokenizer, fp8=fp8)
        engine.update_weights(iter_safetensors(args.hf_checkpoint), version=0)
        model_path = args.hf_checkpoint
    else:
        from megapkl.models.spec import hf_config_dict, load_spec

        spec = load_spec(args.model_config)
        ids = {}
        if tokenizer is not None:  # stop at every stop id the tokenizer's directory declares
            from megapkl.rollout.tokens import special_ids

            ids = special_ids(tokenizer, spec.vocab_size, [args.tokenizer]).hf_config()
        torch.manual_seed(args.seed)  # same seed, same random weights on every worker
        engine = InterruptibleEngine(hf_config_dict(spec, dtype=args.dtype, **ids),
                                     device=args.device, dtype=dtype, seed=args.seed,
                                     tokenizer=tokenizer, fp8=fp8)
        engine.update_weights(list(engine.model.state_dict().items()), version=0)
        model_path = args.model_config
    if args.enable_return_routed_experts and not engine.is_moe:
        raise SystemExit("megapkl serve: error: --enable-return-routed-experts needs a "
                         "mixture-of-experts model")
    state = ServeState(engine, model_path=model_path,
                       served_model_name=args.served_model_name or model_path,
                       enable_routed_experts=args.enable_return_routed_experts,
                       weight_version=args.weight_version)
    return state, tokenizer


def _tokenizer(source: Optional[str]) -> Any:
    if not source:
        return None
    from pathlib import Path

    if not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
