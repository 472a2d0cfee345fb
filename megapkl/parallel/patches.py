"""Every attribute megapkl writes over in torch or megatron-core, and every private name of theirs
it reads or calls, registered in one table (`PATCHES`; docs/patches.md says what each is for and
which upstream change would retire it).

A patch records the versions it was written and tested for and the qualified name of each thing
it replaces or uses, with the parameters it relies on. `check(name)` verifies all of it before the
patch is applied or the private name first used, and fails in one line naming the patch when
upstream moved: a version outside the range (MEGAPKL_ALLOW_UNTESTED=1 lets a version through,
with a warning, when nothing the patch touches moved), a name that is gone, or parameters that
changed. `apply` is the only way the patch sites write over an attribute, and it refuses a target
the patch does not register, so the table is the whole list.

Some patches only buy speed (same results, bit for bit: tests/parallel/test_compat.py):
MEGAPKL_SPEED_PATCHES=0 leaves them out (`speed_patches_on`).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from megapkl.errors import MegapklError

# The versions CI runs on: the suite on torch 2.14.1, and the lowest bounds pyproject.toml admits
# (torch 2.13.0) with a short run of the CPU demo, DP 2 (tools/test_bounds.sh): what a range may
# honestly claim.
TORCH = {"torch": ">=2.13.0,<2.15"}
MEGATRON = {"megatron-core": "==0.16.1"}
_MODULE_OF = {"torch": "torch", "megatron-core": "megatron.core"}
SPEED_ENV, UNTESTED_ENV = "MEGAPKL_SPEED_PATCHES", "MEGAPKL_ALLOW_UNTESTED"


class PatchError(MegapklError, RuntimeError):
    """A patch of torch or megatron-core whose upstream moved."""


@dataclass(frozen=True)
class Patch:
    """`replaces`: qualified names the patch writes over (their parameters must stay exactly
    `params[name]`: the replacement takes the same call); `uses`: private names it reads, calls or
    writes into (the parameters `params[name]` it passes must still exist, in that order);
    `defines`: names it sets where upstream forgot to (only their module must exist)."""
    name: str
    site: str
    versions: Mapping[str, str]
    why: str
    retires: str
    replaces: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()
    params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    speed_only: bool = False
    cpu_only: bool = False


_COMPAT, _DIST = "megapkl/parallel/compat.py", "megapkl/parallel/dist_internals.py"
_CKPT = "megapkl/models/checkpoint.py"
# Every torch factory that takes `device=` (and `pin_memory=`), and the Tensor ones
TORCH_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "range", "tensor", "as_tensor",
                   "asarray", "rand", "randn", "randint", "randperm", "eye", "linspace", "logspace",
                   "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like",
                   "rand_like", "randn_like", "randint_like", "scalar_tensor", "tril_indices",
                   "triu_indices")
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
_C10D = "torch.distributed.distributed_c10d"
_RNG = "megatron.core.tensor_parallel.random"
_BUFFERS = "megatron.core.distributed.param_and_grad_buffer"
_LAYERS = "megatron.core.tensor_parallel.layers"
_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"

# torch.compile's parameters but the last (2.14 names it dynamic_shapes, 2.13 shapes_spec)
_COMPILE_PARAMS = ("model", "fullgraph", "dynamic", "backend", "mode", "options", "name", "disable",
                   "recompile_limit", "isolate_recompiles")

PATCHES = (
    Patch("cpu-device", _COMPAT, TORCH, cpu_only=True,
          replaces=("torch.cuda.current_device", "torch.cuda.set_device"),
          params={"torch.cuda.current_device": (), "torch.cuda.set_device": ("device",)},
          why="megatron allocates on torch.cuda.current_device(): the CPU is the only device",
          retires="megatron-core taking its device from torch.accelerator or its config"),
    Patch("cpu-rng", _COMPAT, {**TORCH, **MEGATRON}, cpu_only=True,
          replaces=("torch.cuda.get_rng_state", "torch.cuda.set_rng_state", "torch.cuda.manual_seed",
                    "torch.cuda.manual_seed_all", f"{_RNG}._get_cuda_rng_state",
                    f"{_RNG}._set_cuda_rng_state"),
          params={"torch.cuda.get_rng_state": ("device",),
                  "torch.cuda.set_rng_state": ("new_state", "device"),
                  "torch.cuda.manual_seed": ("seed",), "torch.cuda.manual_seed_all": ("seed",),
                  f"{_RNG}._get_cuda_rng_state": ("device", "clone", "graph_safe"),
                  f"{_RNG}._set_cuda_rng_state": ("new_state", "device", "graph_safe")},
          why="megatron's RNG tracker (dropout, init, activation recompute) forks the CUDA "
              "generator: on CPU it forks the default generator, which every CPU op draws from",
          retires="megatron-core's RNG tracker over the generator of the tensor's device"),
    Patch("cpu-streams", _COMPAT, TORCH, cpu_only=True,
          replaces=tuple(f"torch.cuda.{n}" for n in (
              "Stream", "Event", "current_stream", "default_stream", "stream", "set_stream",
              "synchronize", "is_current_stream_capturing")),
          params={"torch.cuda.current_stream": ("device",), "torch.cuda.default_stream": ("device",),
                  "torch.cuda.stream": ("stream",), "torch.cuda.set_stream": ("stream",),
                  "torch.cuda.synchronize": ("device",),
                  "torch.cuda.is_current_stream_capturing": ()},
          why="schedules, p2p and optimizer overlap wait on CUDA streams and events; CPU ops run "
              "in order, so there is nothing to wait for",
          retires="megatron-core skipping stream work off CUDA (or torch.accelerator streams)"),
    Patch("cpu-placement", _COMPAT, TORCH, cpu_only=True,
          replaces=tuple(f"torch.{n}" for n in TORCH_FACTORIES)
          + tuple(f"torch.Tensor.{n}" for n in TENSOR_FACTORIES)
          + tuple(f"torch.Tensor.{n}" for n in ("to", "type", "cuda", "pin_memory", "record_stream")),
          why="megatron passes device='cuda', ordinals and pin_memory=True and checks for CUDA type "
              "names: placed on the CPU, pinning dropped, the CUDA type name reported",
          retires="megatron-core placing tensors on a configurable device"),
    Patch("te-gemm-missing", _COMPAT, MEGATRON, cpu_only=True,
          defines=("megatron.core.transformer.moe.moe_utils.te_general_gemm",),
          why="moe_utils reads te_general_gemm, defined only when Transformer Engine imports: "
              "set to None, megatron's own 'TE absent' value",
          retires="megatron-core 0.17.0, which defines it as None without TE"),
    Patch("moe-split-sizes", _COMPAT, MEGATRON, cpu_only=True,
          replaces=("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",),
          params={"megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu":
                  ("tensor", "as_numpy", "record_stream")},
          why="the all-to-all dispatcher asks for split sizes as numpy, which the helper only "
              "converts from CUDA tensors: CPU tensors are converted too",
          retires="maybe_move_tensor_to_cpu honouring as_numpy for CPU tensors"),
    Patch("causal-mask", _COMPAT, MEGATRON, cpu_only=True, speed_only=True,
          replaces=("megatron.core.fusions.fused_softmax.get_default_causal_mask",),
          params={"megatron.core.fusions.fused_softmax.get_default_causal_mask": ("sq",)},
          why="the unfused softmax builds the same causal mask for every layer and micro-batch "
              "(and again in recompute): built once per length on the CPU",
          retires="megatron-core caching the default causal mask"),
    Patch("rope-tables", _COMPAT, MEGATRON, cpu_only=True, speed_only=True,
          replaces=("megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",),
          params={"megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd":
                  ("t", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale")},
          why="the unfused RoPE recomputes cos/sin for q and k of every layer: tables cached per "
              "frequency tensor, the rotation one roll (bit-identical)",
          retires="a fused RoPE on CPU, or megatron-core caching its cos/sin tables"),
    Patch("one-rank-tp-regions", _COMPAT, MEGATRON, cpu_only=True, speed_only=True,
          replaces=(f"{_LAYERS}.copy_to_tensor_model_parallel_region",
                    f"{_LAYERS}.reduce_from_tensor_model_parallel_region"),
          params={f"{_LAYERS}.copy_to_tensor_model_parallel_region": ("input_", "group"),
                  f"{_LAYERS}.reduce_from_tensor_model_parallel_region": ("input_", "group")},
          why="every TP linear layer adds an autograd node that is the identity on a one-rank "
              "group: skipped there",
          retires="megatron-core skipping TP regions when the TP group has one rank"),
    Patch("one-rank-collectives", _COMPAT, {**TORCH, **MEGATRON}, cpu_only=True, speed_only=True,
          replaces=(f"{_BUFFERS}.dist_reduce_scatter_func", f"{_BUFFERS}.dist_all_gather_func",
                    "torch.distributed.all_gather", "torch.distributed.all_reduce",
                    "torch.distributed.broadcast"),
          params={f"{_BUFFERS}.dist_reduce_scatter_func": ("output", "input", "op", "group",
                                                          "async_op"),
                  f"{_BUFFERS}.dist_all_gather_func": ("output_tensor", "input_tensor", "group",
                                                      "async_op"),
                  "torch.distributed.all_gather": ("tensor_list", "tensor", "group", "async_op"),
                  "torch.distributed.all_reduce": ("tensor", "op", "group", "async_op"),
                  "torch.distributed.broadcast": ("tensor", "src", "group", "async_op",
                                                  "group_src")},
          why="synchronous collectives over one rank change nothing but hop to a gloo thread, "
              "whose OpenMP team then slows every later op on a small host: done in place",
          retires="gloo (or torch.distributed) returning at once for a one-rank group"),
    Patch("no-compile-at-import", _COMPAT, {"torch": ">=2.14.1,<2.15"}, cpu_only=True,
          speed_only=True, replaces=("torch.compile",),
          params={"torch.compile": _COMPILE_PARAMS + ("dynamic_shapes",)},
          why="while megatron-core imports, its jit_fuser decorations would import TorchInductor "
              "(5-8 s) for functions that never run compiled on CPU; restored after the import",
          retires="megatron-core wrapping in torch.compile lazily, or not on CPU"),
    Patch("no-compile-at-import-2.13", _COMPAT, {"torch": ">=2.13.0,<2.14"}, cpu_only=True,
          speed_only=True, replaces=("torch.compile",),
          params={"torch.compile": _COMPILE_PARAMS + ("shapes_spec",)},
          why="no-compile-at-import on torch 2.13, whose torch.compile names its last parameter "
              "shapes_spec (dynamic_shapes from 2.14)",
          retires="torch >= 2.14 as the lowest torch megapkl admits"),
    Patch("checkpoint-writes-in-process", _CKPT, MEGATRON,
          replaces=(f"{_WRITER}._get_write_results_queue",
                    f"{_WRITER}.FileSystemWriterAsync.write_preloaded_data_multiproc"),
          uses=(f"{_WRITER}.FileSystemWriterAsync.write_preloaded_data",),
          params={f"{_WRITER}._get_write_results_queue": (),
                  f"{_WRITER}.FileSystemWriterAsync.write_preloaded_data_multiproc":
                  ("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
                  f"{_WRITER}.FileSystemWriterAsync.write_preloaded_data":
                  ("transform_list", "local_proc_idx", "write_bucket", "results_queue",
                   "count_queue", "use_fsync")},
          why="the writer forks a process per bucket through a cached multiprocessing Manager: "
              "daemonic ranks cannot fork, and a second run in one process broke its pipe; "
              "threads of this process write instead, for the save call only",
          retires="a thread or in-process mode of megatron-core's FileSystemWriterAsync"),
    Patch("optimizer-step-sync", _CKPT, MEGATRON,
          uses=("megatron.core.optimizer.optimizer.ChainedOptimizer._synchronize_steps",),
          params={"megatron.core.optimizer.optimizer.ChainedOptimizer._synchronize_steps":
                  ("self",)},
          why="after loading a dense and an expert optimizer, their step counts are made one, as "
              "megatron does after its own loads",
          retires="ChainedOptimizer.load_state_dict synchronizing the steps itself"),
    Patch("dist-group-registry", _DIST, TORCH,
          uses=(f"{_C10D}._world.pg_map", f"{_C10D}._get_default_group",
                f"{_C10D}._rank_not_in_group"),
          params={f"{_C10D}._rank_not_in_group": ("group",), f"{_C10D}._get_default_group": ()},
          why="a run destroys the groups it made and shortens the timeouts of the groups this "
              "process is in: torch lists neither",
          retires="a public list of the process groups of this process"),
    Patch("dist-pg-timeout-2.13", _DIST, {"torch": ">=2.13.0,<2.14"},
          uses=(f"{_C10D}._set_pg_timeout",),
          params={f"{_C10D}._set_pg_timeout": ("timeout", "group")},
          why="after the first update a run shortens its groups' timeouts; torch 2.13 names the "
              "call _set_pg_timeout (dist.set_timeout from 2.14)",
          retires="torch >= 2.14 as the lowest torch megapkl admits"),
    Patch("dist-group-outside-world", _DIST, TORCH,
          uses=(f"{_C10D}._new_process_group_helper", f"{_C10D}._world.pg_group_ranks"),
          params={f"{_C10D}._new_process_group_helper": (
              "group_size", "group_rank", "global_ranks_in_group", "backend", "store",
              "group_name", "timeout")},
          why="the trainer-to-servers weight-update group has members outside the default world "
              "(SGLang's own convention): made from its own store and registered with its ranks",
          retires="a public torch.distributed call that makes a group from a store"),
    Patch("dist-unbound-default-group", _DIST, TORCH,
          replaces=("torch.distributed.ProcessGroup.bound_device_id",),
          why="with the default group bound to a GPU, torch makes every new NCCL group by "
              "splitting the world's communicator, a collective the servers are not part of: the "
              "binding is hidden while the weight-update group is made",
          retires="new_group/a group-from-store call that can opt out of the communicator split"),
    Patch("dist-default-store", _DIST, TORCH,
          uses=(f"{_C10D}._get_default_store",), params={f"{_C10D}._get_default_store": ()},
          why="a failing rank publishes its failure in the default group's store, where the "
              "other ranks' watchers read it",
          retires="a public accessor of the default store"),
    Patch("dist-abort", _DIST, TORCH,
          uses=(f"{_C10D}._abort_process_group",),
          params={f"{_C10D}._abort_process_group": ("group",)},
          why="under NCCL a rank waiting in a collective for a failed peer is released by "
              "aborting its communicators",
          retires="a public abort of process groups (torch marks it experimental)"),
)
BY_NAME = {p.name: p for p in PATCHES}


def speed_patches_on() -> bool:
    """False when MEGAPKL_SPEED_PATCHES turns the speed-only patches off (0, off, false, no)."""
    raw = os.environ.get(SPEED_ENV, "1").strip().lower()
    if raw not in ("1", "on", "true", "yes", "0", "off", "false", "no"):
        raise PatchError(f"{SPEED_ENV}={raw!r}: expected 1 or 0 (on or off)")
    return raw in ("1", "on", "true", "yes")


def resolve(qualname: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualname)


def version_of(package: str) -> str:
    return str(importlib.import_module(_MODULE_OF[package]).__version__)


def _parameters(obj: Any) -> tuple[str, ...]:
    """Named parameters of a callable (*args / **kwargs left out)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return tuple(n for n, p in inspect.signature(obj).parameters.items() if p.kind not in variadic)


def moved(patch: Patch) -> list[str]:
    """What of the patch's targets no longer is what it was written for (empty: nothing)."""
    found = []
    for name in patch.replaces + patch.uses + patch.defines:
        owner, _, attr = name.rpartition(".")
        try:
            obj = resolve(owner if name in patch.defines else name)
        except (ImportError, AttributeError):
            found.append(f"{owner if name in patch.defines else name} is gone")
            continue
        if name not in patch.params:
            continue
        try:
            have = _parameters(obj)
        except (TypeError, ValueError):
            found.append(f"{name} has no readable signature")
            continue
        want = patch.params[name]
        kept = [p for p in have if p in want]
        if (have != want) if name in patch.replaces else (kept != list(want)):
            found.append(f"{name} takes ({', '.join(have)}), not ({', '.join(want)})")
    return found


_VERIFIED: dict[str, Patch] = {}


def check(name: str) -> Patch:
    """The registered patch `name`, once its versions and targets are verified (once a process)."""
    if name in _VERIFIED:
        return _VERIFIED[name]
    patch = BY_NAME[name]
    outside = [f"{pkg} {version_of(pkg)} (tested: {rng})" for pkg, rng in patch.versions.items()
               if not _in_range(version_of(pkg), rng)]
    gone = moved(patch)
    where = f"patch '{name}' ({patch.site}, see docs/patches.md)"
    if gone:
        raise PatchError(f"{where}: upstream moved: {'; '.join(gone)}"
                         + (f"; {'; '.join(outside)}" if outside else ""))
    if outside:
        if os.environ.get(UNTESTED_ENV, "") != "1":
            raise PatchError(f"{where} was not tested with {', '.join(outside)}; install the "
                             f"tested versions, or set {UNTESTED_ENV}=1 to try anyway")
        print(f"[megapkl] warning: {where} runs untested with {', '.join(outside)}",
              file=sys.stderr, flush=True)
    _VERIFIED[name] = patch
    return patch


def this_versions(*names: str) -> str:
    """The first of `names` (registrations of one patch for different upstream versions) whose
    version ranges hold here; the first when none does (its check then says so)."""
    for name in names:
        if all(_in_range(version_of(pkg), rng) for pkg, rng in BY_NAME[name].versions.items()):
            return name
    return names[0]


def _release(version: str) -> tuple[int, ...]:
    """2.14.1+cu130 -> (2, 14, 1): the release numbers (local and pre-release tags dropped)."""
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", version.strip()).group().split("."))


def _in_range(version: str, spec: str) -> bool:
    """Does `version` meet every clause of `spec` (">=2.14.1,<2.15", "==0.16.1")?"""
    have = _release(version)
    for clause in spec.split(","):
        op = re.match(r"\s*(>=|<=|==|<|>)", clause).group(1)
        bound = _release(clause.strip()[len(op):])
        width = max(len(have), len(bound))
        a, b = (t + (0,) * (width - len(t)) for t in (have, bound))
        if not {">=": a >= b, "<=": a <= b, "==": a == b, "<": a < b, ">": a > b}[op]:
            return False
    return True


def apply(name: str, owner: Any, attr: str, value: Any) -> None:
    """Write `value` over `owner.attr` for patch `name`, which must be checked already and must
    register that target."""
    qual = owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"
    patch = BY_NAME[name]
    if f"{qual}.{attr}" not in patch.replaces + patch.defines:
        raise PatchError(f"patch '{name}' does not register {qual}.{attr}: add it to "
                         "megapkl/parallel/patches.py")
    if name not in _VERIFIED:
        raise PatchError(f"patch '{name}' applied before check('{name}')")
    setattr(owner, attr, value)
