"""Run real megatron-core 0.16 on CPU-only machines with gloo.

megatron-core assumes a GPU in a handful of places (RNG tracker, rotary embedding, causal
masks, pipeline schedules, optimizer buffers and type checks, p2p synchronisation). On a
machine without CUDA those calls raise. `install()` patches exactly those entry points so
that the *unmodified* library runs on CPU; every patch maps a CUDA-only call onto its CPU
equivalent, so results equal a single-process CPU computation.

Active only when CUDA is absent: on a GPU machine `install()` does nothing and returns
False. Idempotent. Patches are process-wide (module attributes) except the device rewrite,
which is a TorchFunctionMode pushed on the calling thread's mode stack (threads created
later, other than autograd's, do not see it; forked children do).

Patches (what megatron hard-codes -> what we do -> why it is safe):
1. `torch.cuda.current_device()` is used as a device for allocations and `.to()`
   -> returns the CPU device. Nothing here can be on a GPU, so CPU is the only right answer.
2. The CUDA RNG tracker (`CudaRNGStatesTracker`, `model_parallel_cuda_manual_seed`,
   activation checkpointing) reads/writes the CUDA generator through `torch.cuda.
   {get,set}_rng_state`, `torch.cuda.manual_seed` and megatron's `_get/_set_cuda_rng_state`
   -> all backed by the CPU default generator. On CPU every random op (dropout, init) draws
   from that generator, so forking its state is exactly what the tracker means to do. The
   tracker's "CPU RNG state changed within GPU RNG context" warning is then expected and is
   filtered from megatron's logger.
3. CUDA streams, events, `synchronize` and `is_current_stream_capturing` (schedules, p2p,
   optimizer overlap) -> no-op objects / False. CPU ops execute synchronously in order, so
   there is nothing to wait on and no graph being captured.
4. `device="cuda"` / integer device ordinals in factory calls and `.to()`, `pin_memory=True`,
   `Tensor.cuda()`, `Tensor.pin_memory()`, `Tensor.record_stream()` -> CPU / dropped /
   identity, via a TorchFunctionMode (one place instead of patching every call site).
   `Tensor.type()` reports the CUDA type name (`torch.cuda.FloatTensor`) because the
   optimizer rejects parameters whose type string is not a CUDA one; the tensor is unchanged.
5. `moe_utils.te_general_gemm` is referenced but only defined when Transformer Engine
   imports (0.16.1 bug) -> set to None, which is megatron's own "TE absent" value.
6. The alltoall MoE dispatcher asks `maybe_move_tensor_to_cpu(..., as_numpy=True)` for split
   sizes, but the helper only converts CUDA tensors -> also convert CPU tensors to numpy when
   asked, which is what the caller expects on GPU.
7. Activation recompute re-runs the attention core inside backward, where the device rewrite of
   4. is not active (`Tensor.backward` dispatches through the mode, which is off while it
   handles a call) -> the causal-mask helper of megatron's unfused softmax builds its mask on
   the CPU directly. Same mask, same device as without recompute.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False
_mode: "CudaToCpuMode | None" = None


def is_installed() -> bool:
    """True once `install()` has applied the patches in this process."""
    return _installed


def preload() -> None:
    """Import the megatron modules the patches touch (seconds; do it before forking)."""
    import megatron.core  # noqa: F401
    from megatron.core.tensor_parallel import random  # noqa: F401
    from megatron.core.transformer.moe import moe_utils, token_dispatcher  # noqa: F401


def install() -> bool:
    """Apply the CPU compatibility patches (no-op when CUDA is available).

    Returns True when the patches are active. Safe to call any number of times; call it
    again in a new thread that builds megatron modules (the device mode is per thread).
    """
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        _patch_current_device()
        _patch_cuda_rng()
        _patch_streams()
        _patch_megatron()
        _installed = True
    _push_mode_on_this_thread()
    return True


# ---------------------------------------------------------------- 1. current device


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: _CPU
    # set_device would reach a missing C binding; there is only one device.
    torch.cuda.set_device = lambda device: None


# ---------------------------------------------------------------- 2. RNG


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch_cuda_rng() -> None:
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = _cpu_manual_seed
    torch.cuda.manual_seed_all = _cpu_manual_seed

    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        # graph_safe states belong to CUDA graphs, which cannot exist on CPU.
        if graph_safe:
            raise RuntimeError("graph-safe (CUDA graph) RNG states are not available on CPU")
        return torch.get_rng_state()  # already a fresh copy

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        if graph_safe:
            raise RuntimeError("graph-safe (CUDA graph) RNG states are not available on CPU")
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    logging.getLogger(mrandom.__name__).addFilter(_drop_rng_changed_warning)


def _drop_rng_changed_warning(record: logging.LogRecord) -> bool:
    # With one generator the "CPU" state necessarily changes inside tracker.fork().
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# ---------------------------------------------------------------- 3. streams and events


class NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "NullEvent":
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class NullEvent:
    """Stands in for torch.cuda.Event; timings read as zero."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_streams() -> None:
    torch.cuda.Stream = NullStream
    torch.cuda.Event = NullEvent
    torch.cuda.current_stream = lambda device=None: NullStream()
    torch.cuda.default_stream = lambda device=None: NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    torch.cuda.set_stream = lambda stream: None
    torch.cuda.synchronize = lambda device=None: None
    # CUDA graphs cannot exist on CPU; the real query reaches a missing C binding.
    torch.cuda.is_current_stream_capturing = lambda: False


# ---------------------------------------------------------------- 4. device rewrite


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # megatron passes bare ordinals (torch.cuda.current_device() on GPU); bool is not one.
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_if_cuda(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


def _cpu_type_name(name: Any) -> Any:
    if isinstance(name, str) and name.startswith("torch.cuda."):
        return "torch." + name[len("torch.cuda."):]
    return name


def _cuda_type_name(name: str) -> str:
    if name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch."):]
    return name


_IDENTITY_METHODS = (torch.Tensor.cuda, torch.Tensor.pin_memory)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement requests to CPU for every torch call on this thread."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _IDENTITY_METHODS:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type:
            return self._type(args, kwargs)
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu_if_cuda(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)

    @staticmethod
    def _type(args: tuple, kwargs: dict) -> Any:
        if len(args) == 1 and not kwargs.get("dtype"):
            return _cuda_type_name(torch.Tensor.type(args[0]))
        if len(args) > 1:
            args = (args[0], _cpu_type_name(args[1])) + tuple(args[2:])
        if "dtype" in kwargs:
            kwargs["dtype"] = _cpu_type_name(kwargs["dtype"])
        return torch.Tensor.type(*args, **kwargs)


def _mode_is_active(mode: TorchFunctionMode) -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(m is mode for m in _get_current_function_mode_stack())


def _push_mode_on_this_thread() -> None:
    global _mode
    if _mode is None:
        _mode = CudaToCpuMode()
    if not _mode_is_active(_mode):
        # Entered for the rest of the thread's life: megatron allocates lazily at any time.
        _mode.__enter__()


# ---------------------------------------------------------------- 5./6. megatron bugs


def _patch_megatron() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu

    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_causal_mask


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron's `get_default_causal_mask` (True above the diagonal), on the CPU."""
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()
