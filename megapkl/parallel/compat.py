"""Run real megatron-core 0.16 on CPU-only machines with gloo.

megatron-core assumes a GPU in a handful of places (RNG tracker, rotary embedding, causal
masks, pipeline schedules, optimizer buffers and type checks, p2p synchronisation). On a
machine without CUDA those calls raise. `install()` patches exactly those entry points so
that the *unmodified* library runs on CPU; every patch maps a CUDA-only call onto its CPU
equivalent, so results equal a single-process CPU computation.

Active only when CUDA is absent: on a GPU machine `install()` does nothing and returns
False. Idempotent. Patches are process-wide (module and class attributes): every thread sees
them, and forked children inherit them. Each is registered in `megapkl.parallel.patches` (the
versions it was written for, what it replaces, docs/patches.md): `install()` checks every one
before it applies any, and fails in one line naming the patch when torch or megatron-core moved.

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
   identity, by wrapping the torch factories that take a device and those Tensor methods (a
   TorchFunctionMode would be one place, but it taxes every torch call: it made the CPU demo's
   update several times slower). megatron reaches them as `torch.X` / tensor attributes.
   `Tensor.type()` reports the CUDA type name (`torch.cuda.FloatTensor`) because the
   optimizer rejects parameters whose type string is not a CUDA one; the tensor is unchanged.
5. `moe_utils.te_general_gemm` is referenced but only defined when Transformer Engine
   imports (0.16.1 bug) -> set to None, which is megatron's own "TE absent" value.
6. The alltoall MoE dispatcher asks `maybe_move_tensor_to_cpu(..., as_numpy=True)` for split
   sizes, but the helper only converts CUDA tensors -> also convert CPU tensors to numpy when
   asked, which is what the caller expects on GPU.
7. The causal-mask helper of megatron's unfused softmax (also re-run inside backward by activation
   recompute) builds the same mask for every layer and micro-batch -> built once per length on the
   CPU (megatron's own asks for device="cuda", which patch 4 already places on the CPU).

Patches 7 to 10 and the import-time `torch.compile` swap of `preload` only buy speed, and
MEGAPKL_SPEED_PATCHES=0 leaves them out (the CPU demo's metrics.jsonl is the same either way).
8 and 9 remove per-call work that computes nothing (the tiny demo model runs 8 micro-batches of
~64 tokens per update, where megatron's per-call overhead, not arithmetic, is the time); 10 moves
one-rank collectives out of gloo's threads. All three give bit-identical results, forward and
backward (tests/parallel/test_compat.py):
8. megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`, the only RoPE without a fused kernel)
   recomputes cos/sin of the same frequency table for q and k of every layer and micro-batch,
   rotates with chunk + neg + cat, and slices/concatenates an empty pass-through part (whose
   backward adds a tensor of zeros) -> tables cached per frequency tensor (megatron's rotary
   embedding caches that tensor per sequence length), the sign of rotate-half folded into the
   sine table, the rotation one `torch.roll`. Exact: negating a factor instead of the product
   and moving elements change no bit.
9. Every tensor-parallel linear layer wraps its input or output in an autograd Function that
   copies / all-reduces over the TP group, and megatron's own helper returns the tensor unchanged
   in both directions when the group has one rank -> the layers skip that Function (a forward
   and a backward node per layer and micro-batch) for a one-rank group.
10. megatron's gradient and parameter buffers reduce-scatter / all-gather each bucket over the
   data-parallel group; on a one-rank group the rank's shard is the whole bucket, so both read
   and write the same memory and change nothing -> skipped (synchronous calls only). Not for the
   copy's cost: gloo runs it in one of its own threads, where a copy that large starts an OpenMP
   team of that thread's own, and while two teams are alive on a 2-core host every later
   multi-threaded op of the training thread waits for its sleeping worker (GNU OpenMP stops
   spinning when it manages more threads than there are CPUs): a 64x64 matmul took 75 us instead
   of 11, and the demo's training step 0.082 s instead of 0.05. For the same reason a synchronous
   `torch.distributed.all_gather` over a one-rank group is a copy in the calling thread: megatron
   gathers the optimizer state that way at every checkpoint, and after the first one the run
   stayed slow. A synchronous `all_reduce` (sum, max, min) or `broadcast` over a one-rank group
   returns at once: it changes nothing, and each was ~0.1 ms of thread hop (three or four an
   update: megatron's optimizer and gradient finalization, the weight export).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch

from megapkl.parallel.patches import (BY_NAME, TENSOR_FACTORIES, TORCH_FACTORIES, apply, check,
                                      speed_patches_on, this_versions)

_CPU = torch.device("cpu")
_installed = False
_applied: list[str] = []  # registered names of the patches install() applied


def is_installed() -> bool:
    """True once `install()` has applied the patches in this process."""
    return _installed


def preload() -> None:
    """Import the megatron modules the patches touch (seconds; do it before forking). On CPU
    without `torch.compile`: megatron wraps its fused functions in it at import time (its
    `jit_fuser`), and the first call imports TorchInductor, 5-8 of the 8-12 s the import takes
    here; the functions are the same code uncompiled, and nothing runs compiled on CPU."""
    import sys

    real = torch.compile
    swap = ("megatron.core" not in sys.modules and not torch.cuda.is_available()
            and speed_patches_on())
    name = this_versions("no-compile-at-import", "no-compile-at-import-2.13")
    if swap:
        apply(check(name).name, torch, "compile", _no_compile)
    try:
        import megatron.core  # noqa: F401
        from megatron.core.tensor_parallel import random  # noqa: F401
        from megatron.core.transformer.moe import moe_utils, token_dispatcher  # noqa: F401
    finally:
        if swap:
            apply(name, torch, "compile", real)


def _no_compile(model: Any = None, **_: Any) -> Any:
    """torch.compile's signature, compiling nothing: `model` back, or an identity decorator."""
    return model if model is not None else (lambda fn: fn)


def install() -> bool:
    """Apply the CPU compatibility patches (no-op when CUDA is available).

    Returns True when the patches are active. Safe to call any number of times; the patches are
    process-wide (every thread, the autograd engine's included).
    """
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        preload()
        speed = speed_patches_on()
        chosen = [(name, fn) for name, fn, fast in _PATCHES if speed or not fast]
        for name, _ in chosen:  # every check before any patch: nothing is half applied
            check(name)
        for name, fn in chosen:
            fn()
            _applied.append(name)
        _installed = True
    return True


def installed_patches() -> list[str]:
    """The registered names of the patches `install()` applied in this process."""
    return list(_applied)


# ---------------------------------------------------------------- 1. current device


def _patch_current_device() -> None:
    apply("cpu-device", torch.cuda, "current_device", lambda: _CPU)
    # set_device would reach a missing C binding; there is only one device.
    apply("cpu-device", torch.cuda, "set_device", lambda device: None)


# ---------------------------------------------------------------- 2. RNG


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch_cuda_rng() -> None:
    apply("cpu-rng", torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    apply("cpu-rng", torch.cuda, "set_rng_state",
          lambda new_state, device="cuda": torch.set_rng_state(new_state))
    apply("cpu-rng", torch.cuda, "manual_seed", _cpu_manual_seed)
    apply("cpu-rng", torch.cuda, "manual_seed_all", _cpu_manual_seed)

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

    apply("cpu-rng", mrandom, "_get_cuda_rng_state", get_state)
    apply("cpu-rng", mrandom, "_set_cuda_rng_state", set_state)
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
    for name, value in (("Stream", NullStream), ("Event", NullEvent),
                        ("current_stream", lambda device=None: NullStream()),
                        ("default_stream", lambda device=None: NullStream()),
                        ("stream", lambda stream=None: contextlib.nullcontext(stream)),
                        ("set_stream", lambda stream: None),
                        ("synchronize", lambda device=None: None),
                        # CUDA graphs cannot exist on CPU; the real query reaches a missing binding
                        ("is_current_stream_capturing", lambda: False)):
        apply("cpu-streams", torch.cuda, name, value)


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


def _placed_on_cpu(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)
    return call


def _patch_placement() -> None:
    # Module and class attributes, not a TorchFunctionMode: a mode sees every torch call (tens of
    # thousands per update of the tiny model, 7-9 us each on these CPUs, most of an update's
    # time), where only factories and Tensor.to/.cuda/.type ever carry a CUDA placement.
    # megatron reaches all of them through the `torch.` / tensor attribute at call time.
    for name in TORCH_FACTORIES:
        apply("cpu-placement", torch, name, _placed_on_cpu(getattr(torch, name)))
    for name in TENSOR_FACTORIES:
        apply("cpu-placement", torch.Tensor, name, _placed_on_cpu(getattr(torch.Tensor, name)))
    to, type_ = torch.Tensor.to, torch.Tensor.type

    @functools.wraps(to)
    def to_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # most calls are .to(dtype) (hundreds per update of the tiny model): they go straight on
        if args and type(args[0]) is not torch.dtype:
            args = (_cpu_if_cuda(args[0]),) + args[1:]
        if kwargs and "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return to(self, *args, **kwargs)

    @functools.wraps(type_)
    def cuda_type(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        if dtype is None and "dtype" not in kwargs:
            return _cuda_type_name(type_(self))
        if "dtype" in kwargs:
            kwargs["dtype"] = _cpu_type_name(kwargs["dtype"])
        else:
            kwargs["dtype"] = _cpu_type_name(dtype)
        return type_(self, *args, **kwargs)

    for name, value in (("to", to_cpu), ("type", cuda_type),
                        ("cuda", lambda self, *args, **kwargs: self),
                        ("pin_memory", lambda self, *args, **kwargs: self),
                        ("record_stream", lambda self, stream: None)):
        apply("cpu-placement", torch.Tensor, name, value)


# ---------------------------------------------------------------- 5.-7. megatron's own calls


def _patch_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        apply("te-gemm-missing", moe_utils, "te_general_gemm", None)


def _patch_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    apply("moe-split-sizes", token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu)


def _patch_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax

    apply("causal-mask", fused_softmax, "get_default_causal_mask", _cpu_causal_mask)


@functools.lru_cache(maxsize=16)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron's `get_default_causal_mask` (True above the diagonal), on the CPU. Cached: every
    layer of every micro-batch asks for the same few lengths, and the mask is only read."""
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


# ---------------------------------------------------------------- 8. RoPE tables


def _patch_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd

    @functools.wraps(original)
    def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                  multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        dim = t.shape[-1]
        if rotary_interleaved or multi_latent_attention or freqs.shape[-1] != dim or dim % 2:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, signed_sin = _rope_tables(freqs, mscale, t.dtype)
        # megatron: t * cos + cat(-t2, t1) * sin; roll(t) = cat(t2, t1), sin's first half negated.
        # contiguous like megatron's final cat (callers `.view` it); a no-op for the usual layouts
        return (t * cos + torch.roll(t, dim // 2, dims=-1) * signed_sin).contiguous()

    apply("rope-tables", rope_utils, "_apply_rotary_pos_emb_bshd", rope_bshd)


_ROPE_CACHE: list = []  # [(freqs, mscale, dtype, cos, signed sin)], newest last
# q and k of every layer share one table, so one entry serves a micro-batch; two let two lengths
# alternate. THD rows build a fresh frequency tensor per call: those miss, and stay bounded.
_ROPE_CACHE_SIZE = 2


def _rope_tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """megatron's (cos(freqs) * mscale, sin(freqs) * mscale) in `dtype`, the sine's first half
    negated; cached per freqs tensor (held, so its id is never reused while cached)."""
    for f, m, d, cos, sin in _ROPE_CACHE:
        if f is freqs and m == mscale and d == dtype:
            return cos, sin
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    # tables built under inference mode could not enter a graph later; gradients never flow to
    # a frequency table, but a table that did require them must not be shared either
    if not (torch.is_inference_mode_enabled() or freqs.requires_grad):
        _ROPE_CACHE.append((freqs, mscale, dtype, cos, sin))
        del _ROPE_CACHE[:-_ROPE_CACHE_SIZE]
    return cos, sin


# ---------------------------------------------------------------- 9. one-rank TP regions


def _patch_tp_regions() -> None:
    from megatron.core.tensor_parallel import layers

    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        apply("one-rank-tp-regions", layers, name, _identity_on_one_rank(getattr(layers, name)))


def _identity_on_one_rank(region: Callable) -> Callable:
    @functools.wraps(region)
    def call(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
        # megatron's `_reduce` and the copy are the identity, forward and backward, on one rank
        if group is not None and group.size() == 1:
            return input_
        return region(input_, group)
    return call


# ---------------------------------------------------------------- 10. one-rank collectives


def _patch_one_rank_collectives() -> None:
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        apply("one-rank-collectives", buffers, name,
              _skip_in_place_on_one_rank(getattr(buffers, name)))
    dist = torch.distributed
    for name, wrap in (("all_gather", _all_gather_here_on_one_rank),
                       ("all_reduce", _reduce_here_on_one_rank),
                       ("broadcast", _broadcast_here_on_one_rank)):
        apply("one-rank-collectives", dist, name, wrap(getattr(dist, name)))


def _skip_in_place_on_one_rank(collective: Callable) -> Callable:
    @functools.wraps(collective)
    def call(output: torch.Tensor, input_: torch.Tensor, *args: Any, group: Any = None,
             async_op: bool = False, **kwargs: Any) -> Any:
        # one rank, the shard is the bucket: a reduction over one rank and a gather of one shard
        # both leave it as it is (a caller waiting on a handle gets the real call)
        if (not async_op and group is not None and group.size() == 1
                and output.data_ptr() == input_.data_ptr() and output.numel() == input_.numel()):
            return None
        return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)
    return call


def _all_gather_here_on_one_rank(all_gather: Callable) -> Callable:
    @functools.wraps(all_gather)
    def call(tensor_list: list, tensor: torch.Tensor, group: Any = None,
             async_op: bool = False) -> Any:
        # the gather of one rank's tensor is that tensor: copied here, in the calling thread
        if (not async_op and len(tensor_list) == 1
                and tensor_list[0].shape == tensor.shape and tensor_list[0].dtype == tensor.dtype
                and torch.distributed.get_world_size(group) == 1):
            tensor_list[0].copy_(tensor)
            return None
        return all_gather(tensor_list, tensor, group=group, async_op=async_op)
    return call


def _reduce_here_on_one_rank(all_reduce: Callable) -> Callable:
    from torch.distributed import ReduceOp

    unchanged = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)

    @functools.wraps(all_reduce)
    def call(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
             async_op: bool = False) -> Any:
        # a sum, maximum or minimum over one rank is its own value (megatron's optimizer and
        # gradient finalization reduce a few scalars every update, each a hop to gloo's thread)
        if not async_op and op in unchanged and torch.distributed.get_world_size(group) == 1:
            return None
        return all_reduce(tensor, op=op, group=group, async_op=async_op)
    return call


def _broadcast_here_on_one_rank(broadcast: Callable) -> Callable:
    @functools.wraps(broadcast)
    def call(tensor: torch.Tensor, src: Any = None, group: Any = None, async_op: bool = False,
             group_src: Any = None) -> Any:
        # one rank sends to itself: nothing moves (a wrong source still gets torch's error)
        if (not async_op and torch.distributed.get_world_size(group) == 1
                and (src == torch.distributed.get_rank() if group_src is None else
                     src is None and group_src == 0)):
            return None
        return broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    return call


# (registered name, what applies it), in the order install() applies them
_PATCHES = [(name, fn, BY_NAME[name].speed_only) for name, fn in (
    ("cpu-device", _patch_current_device), ("cpu-rng", _patch_cuda_rng),
    ("cpu-streams", _patch_streams), ("cpu-placement", _patch_placement),
    ("te-gemm-missing", _patch_te_gemm), ("moe-split-sizes", _patch_split_sizes),
    ("causal-mask", _patch_causal_mask), ("rope-tables", _patch_rope),
    ("one-rank-tp-regions", _patch_tp_regions), ("one-rank-collectives", _patch_one_rank_collectives))]
