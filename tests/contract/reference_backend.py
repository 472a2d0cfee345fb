"""SGLang's HTTP front end on CPU, with everything below the tokenizer manager that runs without a
GPU taken from SGLang too. Runs inside the contract tests' SGLang process only.

    request -> SGLang's FastAPI `app` (route, body validation into the io_struct class, error
               handlers, response body)                                   [SGLang]
            -> CpuBackend, in the place of the TokenizerManager           [this file]
            -> SchedulerWeightUpdaterManager (weight-update sessions, the refusals outside one,
               the flush-after-update rule, release/resume tags)           [SGLang]
            -> TpModelWorker.deserialize_own_rank / .init_weights_update_group (called unbound)
               -> WeightUpdater (model runner side: the process group, receive buffers and
                  broadcast, `load_weights_from_distributed`)              [SGLang]
            -> RecordingModel.load_weights: records what a model would load [this file]

What is not SGLang here, and why: the TokenizerManager itself (it starts the scheduler processes
over ZeroMQ and needs a GPU model behind them); CpuBackend does its bookkeeping (weight version,
pause flag) in a few lines and forwards every weight call to SGLang's scheduler-side object as the
TokenizerManager's communicators would. No model runs, so /generate is not served here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from typing import Any, Optional

import torch


class RecordingModel(torch.nn.Module):
    """Stands where the model's `load_weights` would be called: keeps what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named_tensors) -> None:
        self.loaded += [(n, t.detach().clone()) for n, t in named_tensors]


def _default_group():
    """World of one over gloo: SGLang asserts an initialized default group before it opens a
    weight-update group, and barriers on the TP CPU group (here: the world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    return dist.group.WORLD


def _scheduler_side(server_args, model: RecordingModel):
    """SGLang's SchedulerWeightUpdaterManager over one CPU model runner (TP rank 0)."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager)
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    publish(server_args, role="scheduler")  # the scheduler process's config, as at launch
    get_parallel().override_permanently(tp_rank=0)
    group = _default_group()
    updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0,
                            model_config=ModelConfig.from_server_args(server_args),
                            custom_weight_loaders={}, get_model=lambda: model,
                            update_model_fields=lambda *a, **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)
    runner = SimpleNamespace(weight_updater=updater, model=model)

    class Worker(SimpleNamespace):  # TpModelWorker's methods, called on this runner
        deserialize_own_rank = TpModelWorker.deserialize_own_rank
        init_weights_update_group = TpModelWorker.init_weights_update_group
        destroy_weights_update_group = TpModelWorker.destroy_weights_update_group

        def weight_update_runners(self):
            return [("target", runner)]

    busy = {"running": 0}
    versions: list[Optional[str]] = []
    mgr = object.__new__(SchedulerWeightUpdaterManager)  # __post_init__ reads the TP group
    for name, value in dict(
            tp_worker=Worker(model_runner=runner), draft_worker=None,
            memory_saver_adapter=TorchMemorySaverAdapter.create(
                enable=server_args.enable_memory_saver),
            flush_cache=lambda empty_cache=True: busy["running"] == 0,
            is_fully_idle=lambda **k: busy["running"] == 0,
            scheduler=SimpleNamespace(record_weight_version_change=lambda new_version:
                                      versions.append(new_version),
                                      _engine_paused=False, disaggregation_mode="null"),
            metrics_collector=None, offload_tags=set(), stashed_model_static_state=None,
            _session=None, tp_cpu_group=group).items():
        setattr(mgr, name, value)
    return mgr, busy, versions


class CpuBackend:
    """In the TokenizerManager's place: what SGLang's routes call on `_global_state`."""

    def __init__(self, server_args):
        from sglang.srt.configs.model_config import ModelConfig

        self.server_args = server_args
        self.model_config = ModelConfig.from_server_args(server_args)
        self.model = RecordingModel()
        self.mgr, self.busy, self.versions = _scheduler_side(server_args, self.model)
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.is_generation = True
        self.weight_version = server_args.weight_version
        self.load_format = server_args.load_format
        self.startup_time = time.time()
        self.is_pause = False
        self.log: list[Any] = []
        self.gracefully_exit = False
        self.initial_weights_loaded = True
        self._lock = threading.Lock()

    # -- bookkeeping the tests read
    def close(self) -> None:
        """Leave the weight-update groups this backend's runner opened."""
        for name in list(self.mgr.tp_worker.model_runner.weight_updater._model_update_group):
            self.mgr.tp_worker.model_runner.weight_updater.destroy_weights_update_group(name)

    def reset(self) -> None:
        self.log.clear()
        self.model.loaded.clear()

    def describe_log(self) -> list[dict]:
        import msgspec

        return [{"class": type(o).__name__, "fields": _plain(msgspec.structs.asdict(o))
                 if hasattr(o, "__struct_fields__") else _plain(dataclasses.asdict(o))}
                for o in self.log]

    def received_tensors(self) -> list:
        return [(n, str(t.dtype).replace("torch.", ""), list(t.shape),
                 t.contiguous().view(torch.uint8).numpy().tobytes())
                for n, t in self.model.loaded]

    def state(self) -> dict:
        return {"session": self.mgr._session is not None, "versions": list(self.versions),
                "offload_tags": sorted(self.mgr.offload_tags), "paused": self.is_pause,
                "weight_version": self.weight_version}

    def _call(self, method: str, obj):
        """The scheduler call behind a communicator (one DP rank: a list of one output)."""
        self.log.append(obj)
        with self._lock:
            return getattr(self.mgr, method)(obj)

    # -- what SGLang's routes call
    def config_value(self, name: str):
        return getattr(self, name, getattr(self.server_args, name, None))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        pass

    async def begin_weight_update(self, obj, request=None):
        out = self._call("begin_weight_update", obj)
        return out.success, out.message

    async def end_weight_update(self, obj, request=None):
        out = self._call("end_weight_update", obj)
        return out.success, out.message

    async def update_weights_from_tensor(self, obj, request=None):
        out = await asyncio.to_thread(self._call, "update_weights_from_tensor", obj)
        return self._versioned(obj, out.success, out.message)

    async def update_weights_from_distributed(self, obj, request=None):
        out = await asyncio.to_thread(self._call, "update_weights_from_distributed", obj)
        return self._versioned(obj, out.success, out.message)

    async def update_weights_from_disk(self, obj, request=None):
        if obj.load_format is None:  # TokenizerManager.update_weights_from_disk does this
            obj.load_format = self.load_format
        out = await asyncio.to_thread(self._call, "update_weights_from_disk", obj)
        if out.success:
            self.model_path = obj.model_path
        out_ok, message = self._versioned(obj, out.success, out.message)
        return out_ok, message, out.num_paused_requests

    def _versioned(self, obj, success: bool, message: str):
        if success and getattr(obj, "weight_version", None) is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    async def init_weights_update_group(self, obj, request=None):
        out = await asyncio.to_thread(self._call, "init_weights_update_group", obj)
        return out.success, out.message

    async def destroy_weights_update_group(self, obj, request=None):
        out = self._call("destroy_weights_update_group", obj)
        return out.success, out.message

    async def update_weight_version(self, obj):
        self.log.append(obj)
        self.weight_version = obj.new_version

    async def flush_cache(self, timeout_s=None):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        return FlushCacheReqOutput(success=self.mgr.flush_cache())

    async def pause_generation(self, obj):
        self.log.append(obj)
        self.is_pause = True

    async def continue_generation(self, obj):
        self.log.append(obj)
        self.is_pause = False

    async def release_memory_occupation(self, obj, request=None):
        self._call("release_memory_occupation", obj)

    async def resume_memory_occupation(self, obj, request=None):
        self._call("resume_memory_occupation", obj)

    async def get_internal_state(self):
        return [{}]


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return repr(value)


@dataclasses.dataclass
class Front:
    url: str
    server: Any
    thread: threading.Thread
    backend: Optional[CpuBackend] = None

    def use(self, backend: CpuBackend) -> None:
        """Answer from now on as `backend`'s server (SGLang's routes read one global state)."""
        from sglang.srt.entrypoints import http_server

        if self.backend is not None:
            self.backend.close()
        self.backend = backend
        http_server.set_global_state(http_server._GlobalState(
            tokenizer_manager=backend, template_manager=None, scheduler_info={}))


def serve() -> Front:
    """SGLang's app on a free loopback port, in a daemon thread of this process."""
    import uvicorn
    from sglang.srt.entrypoints import http_server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(http_server.app, host="127.0.0.1", port=port, lifespan="off",
                            log_level="error", loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("SGLang's HTTP app did not start")
        time.sleep(0.05)
    return Front(f"http://127.0.0.1:{port}", server, thread)
