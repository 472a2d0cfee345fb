"""Weight sync trainer -> SGLang servers, in the three ways SGLang offers.

One sync, for every target server (`WeightSync.push`):

    pause_generation {mode} -> flush_cache -> begin_weight_update -> buckets (tensor |
      distributed) -> end_weight_update -> update_weight_version {new_version}
      -> continue_generation

A disk load runs outside a weight-update session: SGLang's `update_weights_from_disk` restores,
loads and post-processes the weights itself, and `end_weight_update` post-processes them again
when no tensor or distributed load ran in the session (docs/engines.md, "Weight sync").

The sync is a stateless push: what each server holds (its version, its released memory) and
which stored version the fleet holds belong to the fleet's weight owner (weight_state.py), which
decides whom to push to and resumes a released server's memory first. What the sync keeps is
transport: the shared-memory segments of the tensor mode and the distributed mode's update group
(keyed by its members and their incarnations: a restarted server is in no group).

Buckets are consecutive runs of the exported (HF name, tensor) stream of at most `bucket_bytes`
(a larger tensor travels alone). Each bucket passes through `transform(named_tensors) ->
named_tensors` first: the seam for FP8 re-quantization (identity by default).

- tensor: `/update_weights_from_tensor` with SGLang's serialized named tensors (a base64 string of
  a torch multiprocessing pickle, one per engine TP rank). CPU tensors travel as shared-memory
  file names, so this is for servers on the same host only (colocated). Each bucket is laid out in
  one of two shared segments kept from push to push (`SharedBuffers`); a stored policy version is
  read from its file straight into them.
- distributed: `/init_weights_update_group` once per fleet membership, then per bucket
  `/update_weights_from_distributed` {names, dtypes, shapes, load_format: flattened_bucket} while
  this process broadcasts the bucket from rank 0 of that group as one byte buffer. The group is
  NCCL when this process has a GPU (the bucket is copied there first), gloo otherwise. SGLang
  receives a flattened bucket into a uint8 buffer and views each tensor in its declared dtype, so
  FP8 (which gloo cannot broadcast) is declared as float8_e4m3fn and travels as its bytes.
- disk: a stored policy version's own file (hard-linked, never rewritten), or else the bucket
  files of a safetensors checkpoint written under the run directory, then
  `/update_weights_from_disk` {model_path, load_format: safetensors} on every server (without a
  load_format SGLang uses the server's own, `dummy` for servers started without weights, and its
  disk updater refuses any loader but the default one).
"""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from megapkl.parallel.dist_internals import group_outside_world
from megapkl.parallel.groups import group_device
from megapkl.parallel.threads import rank_executor, start_thread
from megapkl.rollout.engine import WeightUpdateError
from megapkl.rollout.fp8 import SCALE_SUFFIX
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.protocol import PAUSE_MODES, check_fields
from megapkl.rollout.sglang.shared import (SharedBuffers, pickle_payload, place,  # noqa: F401
                                            serialize_named_tensors)
from megapkl.rollout.version_store import StoredVersion

NamedTensors = list[tuple[str, Tensor]]
Transform = Callable[[NamedTensors], NamedTensors]
SYNC_MODES = ("tensor", "distributed", "disk")
MiB = 1 << 20
LEAVE_TIMEOUT_S = 10.0  # a server told to leave the update group (best effort, on the way out)


def identity(named_tensors: NamedTensors) -> NamedTensors:
    return named_tensors


def buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int
            ) -> Iterator[NamedTensors]:
    """Consecutive groups of at most `bucket_bytes` (a tensor larger than that is a group alone):
    the grouping the HF checkpoint writer shards by."""
    from megapkl.models.hf import bucketed

    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    # An FP8 weight's `_scale_inv` travels in its weight's bucket: a server loads each bucket
    # on its own and dequantizes a weight only with its scale.
    return bucketed(named_tensors, bucket_bytes, joins=lambda n: n.endswith(SCALE_SUFFIX))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_update_group(backend: str, address: str, port: int, world_size: int, rank: int,
                      group_name: str, timeout_s: float, local_name: Optional[str] = None):
    """A process group outside the default world (what SGLang's servers open on their side of
    `/init_weights_update_group`): TCP rendezvous at address:port, store prefixed by group name.
    `local_name` registers it under another name in this process (two members in one process)."""
    return group_outside_world(backend, f"tcp://{address}:{port}", rank, world_size, group_name,
                               timeout_s, local_name)


def free_cached_memory(group: Any = None) -> None:
    """Hand the blocks PyTorch's caching allocator keeps reserved back to the GPU, before a
    colocated server takes its memory back: torch_memory_saver re-creates the server's weights
    and KV cache with fresh physical allocations, which fail inside the scheduler while the
    trainer's freed activations stay cached. With `group` (the ranks sharing the servers' GPUs),
    every member frees its cache and meets the others, so the one that resumes the servers does
    it after all of them have freed theirs. Collective over `group`."""
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # blocks still used by queued kernels are freed once these end
        torch.cuda.empty_cache()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def group_backend(setting: Optional[str] = None, cuda: Optional[bool] = None) -> str:
    """The weight-update group's backend: `setting` when given, else NCCL when this process has a
    GPU (the servers receive on theirs; SGLang's default) and gloo on a CPU-only host."""
    if setting:
        return setting
    return "nccl" if (torch.cuda.is_available() if cuda is None else cuda) else "gloo"


def flat_order(bucket: Iterable[tuple[str, Tensor]]) -> NamedTensors:
    """The bucket with wider elements first: each tensor then starts at a multiple of its element
    size in the flattened buffer (SGLang's FlattenedTensorBucket checks that alignment)."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def flatten_bucket(bucket: NamedTensors, device: torch.device) -> Tensor:
    """The bucket's bytes in order, as one uint8 tensor on `device` (what SGLang's flattened-bucket
    receive allocates and broadcasts into)."""
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    offset = 0
    for (_, t), size in zip(bucket, sizes):
        flat[offset:offset + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8),
                                         non_blocking=True)
        offset += size
    return flat


@dataclass
class Target:
    """A server to sync: its URL, how many TP ranks it runs (one payload / group rank each) and
    its incarnation (its restarts: a restarted server at the same URL is a new group member)."""

    url: str
    tp: int = 1
    incarnation: int = 0


@dataclass
class SyncSettings:
    mode: str = "tensor"
    bucket_bytes: int = 512 * MiB
    pause_mode: str = "retract"
    colocate: bool = False
    timeout_s: float = 600.0
    flush_retries: int = 20
    group_address: str = "127.0.0.1"
    group_backend: Optional[str] = None  # None: nccl when this process has a GPU, else gloo

    def __post_init__(self):
        if self.mode not in SYNC_MODES:
            raise ValueError(f"rollout.sglang.weight_sync must be one of {SYNC_MODES}, got {self.mode!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"rollout.sglang.pause_mode must be one of {PAUSE_MODES}, "
                             f"got {self.pause_mode!r}")


class WeightSync:
    """Pushes exported weights to a set of servers; `trace` records every (url, route) called,
    in order, for tests and logs. `connections`: where its calls register (the fleet's), so that
    closing them cuts a call blocked on a hung server."""

    def __init__(self, settings: SyncSettings, export_dir: Optional[Path] = None,
                 transform: Transform = identity, hf_config: Optional[dict] = None,
                 connections: Optional[http.Connections] = None):
        if settings.mode == "disk" and export_dir is None:
            raise ValueError("rollout.sglang.weight_sync: disk needs a run directory for the export")
        self.s = settings
        self.export_dir = Path(export_dir) if export_dir is not None else None
        self.transform = transform
        self.hf_config = hf_config
        self.connections = connections
        self.trace: list[tuple[str, str]] = []
        self._group: Optional[tuple[tuple, Any, str]] = None  # (membership, pg, name)
        self._groups_made = 0
        self._lock = threading.Lock()
        self._buffers = SharedBuffers()  # tensor mode: shared memory kept between pushes
        self._buffers_lock = threading.Lock()

    # ------------------------------------------------------------------ calls
    def call(self, url: str, route: str, body: Optional[dict] = None,
             timeout_s: Optional[float] = None) -> Any:
        """One route of one server (`timeout_s`: the sync's own unless given)."""
        with self._lock:
            self.trace.append((url, route))
        return http.request(url, route, check_fields(route, body or {}),
                            timeout=self.s.timeout_s if timeout_s is None else timeout_s,
                            connections=self.connections)

    _call = call

    def _all(self, targets: Sequence[Target], route: str, body_of: Callable[[Target], dict]) -> list:
        if len(targets) == 1:
            return [self._call(targets[0].url, route, body_of(targets[0]))]
        with rank_executor(len(targets), "megapkl-sync") as pool:
            futures = [pool.submit(self._call, t.url, route, body_of(t)) for t in targets]
            return [f.result() for f in futures]

    def _flush(self, url: str, timeout_s: Optional[float] = None) -> None:
        """flush_cache is refused while requests still run (retract/in_place pause): retry."""
        for attempt in range(self.s.flush_retries):
            try:
                self._call(url, "flush_cache", timeout_s=timeout_s)
                return
            except http.ServerError:
                if attempt == self.s.flush_retries - 1:
                    raise
                time.sleep(min(0.05 * 2 ** attempt, 1.0))

    def make_idle(self, url: str, timeout_s: float) -> None:
        """The server idle, as SGLang's release asserts it is (`is_fully_idle`): every request
        aborted (`pause_generation {mode: abort}` returns once none is left in flight) and the
        cache flushed (SGLang flushes only under the same idle test, so a flush that succeeds
        proves it; retried while the aborted requests finish their last step). The caller
        continues generation when done."""
        self._call(url, "pause_generation", {"mode": "abort"}, timeout_s=timeout_s)
        self._flush(url, timeout_s=timeout_s)

    # ------------------------------------------------------------------ a sync
    def push(self, targets: Sequence[Target], named_tensors: Iterable[tuple[str, Tensor]],
             version: int) -> None:
        """Every target ends holding `named_tensors` at `version`, or WeightUpdateError is raised
        (naming the server and route) after generation was let continue again."""
        if not targets:
            raise WeightUpdateError("weight sync: no server to update")
        paused: list[Target] = []
        session = failed = False
        try:
            for t in targets:
                self._call(t.url, "pause_generation", {"mode": self.s.pause_mode})
                paused.append(t)
            for t in targets:
                self._flush(t.url)
            if self.s.mode != "disk":  # a disk load post-processes on its own (module docstring)
                session = True
                self._all(targets, "begin_weight_update", lambda t: {})
            self._send(targets, named_tensors, version)
            if session:
                session = False
                self._all(targets, "end_weight_update", lambda t: {})
            self._all(targets, "update_weight_version",
                      lambda t: {"new_version": str(version), "abort_all_requests": False})
        except (http.ServerError, http.ServerUnreachable) as exc:
            failed = True  # no collective waits on the group: it is left below, in order
            dead = exc.url if isinstance(exc, http.ServerUnreachable) else None
            raise WeightUpdateError(f"weight sync to version {version} failed: {exc}",
                                    unreachable=dead) from exc
        except BaseException:
            # anything else (a broadcast timeout, an interrupt) may leave a collective waiting
            self.close_group(pending=True)
            raise
        finally:
            if failed:  # a failed sync leaves the group unusable: destroyed, servers told to leave
                self.close_group()
            for t in paused if session else ():  # a failed sync must not leave a session open
                try:
                    self._call(t.url, "end_weight_update")
                except (http.ServerError, http.ServerUnreachable):
                    pass
            for t in paused:
                try:
                    self._call(t.url, "continue_generation")
                except (http.ServerError, http.ServerUnreachable):
                    pass  # a dead server is the fleet's business; the others must go on

    def close(self) -> None:
        """Leave the weight-update group: ours destroyed, every member told to leave it (best
        effort), and the tensor sync's shared memory freed. Idempotent; a later push makes new
        ones."""
        self.close_group()
        if self._buffers_lock.acquire(blocking=False):  # a push running frees them when it fails
            try:
                self._buffers.release()
            finally:
                self._buffers_lock.release()

    def _send(self, targets: Sequence[Target], named_tensors, version: int) -> None:
        stored = isinstance(named_tensors, StoredVersion)
        if self.s.mode == "tensor":
            self._send_tensor(targets, named_tensors)
            return
        stream = buckets(named_tensors, self.s.bucket_bytes)
        if self.s.mode == "distributed":
            self._send_distributed(targets, stream)
        else:  # a stored version is loaded from its own file, never written again
            path = named_tensors.path.parent if stored else self._export(stream, version)
            self._all(targets, "update_weights_from_disk",
                      lambda t: {"model_path": str(path), "load_format": "safetensors",
                                 "flush_cache": False})

    def _send_tensor(self, targets: Sequence[Target], named_tensors) -> None:
        """Bucket k + 1 is laid out in shared memory (a worker thread) while the servers load
        bucket k, in the other slot: it is started after bucket k - 1, in its slot, was loaded."""
        with self._buffers_lock:
            stream = self._tensor_buckets(named_tensors, self._buffers)
            try:
                with rank_executor(1, "megapkl-sync-layout") as pool:
                    pending = pool.submit(next, stream, None)
                    while True:
                        bucket = pending.result()
                        if bucket is None:
                            break
                        pending = pool.submit(next, stream, None)
                        self._all(targets, "update_weights_from_tensor",
                                  lambda t: {"serialized_named_tensors": [
                                      pickle_payload(bucket) for _ in range(t.tp)],
                                      "flush_cache": False})
            except BaseException:  # a server may still read a slot: never written again
                self._buffers.release()
                raise
            finally:
                stream.close()

    def _tensor_buckets(self, source, buffers: SharedBuffers) -> Iterator[NamedTensors]:
        """The push's buckets, transformed, each in slot k of `buffers`: a stored version is read
        from its file straight into it (what its transform makes anew goes into a fresh segment),
        anything else is copied there after its transform."""
        if not isinstance(source, StoredVersion):
            for k, bucket in enumerate(buckets(source, self.s.bucket_bytes)):
                yield place(buffers, k, self.transform(bucket))
            return
        with source.open() as reader:  # the layout is planned from the header alone
            meta = [(name, torch.empty(shape, dtype=dtype, device="meta"))
                    for name, dtype, shape in reader.layout]
            index = {name: i for i, (name, _) in enumerate(meta)}
            for k, bucket in enumerate(buckets(meta, self.s.bucket_bytes)):
                first, layout = index[bucket[0][0]], [(t.dtype, t.shape) for _, t in bucket]
                mirrored = buffers.file_views(k, layout, reader.offsets(first, len(bucket)))
                if mirrored is not None:  # the bucket's bytes in one read, aligned as in the file
                    reader.read_span(first, len(bucket), mirrored[0])
                    views = mirrored[1]
                else:
                    views = buffers.views(k, layout)
                    for (n, _), v in zip(bucket, views):
                        reader.read_into(index[n], v)
                read = [(n, v) for (n, _), v in zip(bucket, views)]
                yield place(SharedBuffers(), 0, self.transform(read), views[0].untyped_storage())

    # ------------------------------------------------------------------ distributed
    def _ensure_group(self, targets: Sequence[Target]):
        membership = tuple((t.url, t.tp, t.incarnation) for t in targets)
        if self._group is not None and self._group[0] == membership:
            return self._group[1], self._group[2]
        self.close_group()
        backend = group_backend(self.s.group_backend)
        self._groups_made += 1
        name = f"megapkl-weights-{uuid.uuid4().hex[:12]}"
        port = free_port(self.s.group_address)
        world = 1 + sum(t.tp for t in targets)
        offsets, o = [], 1
        for t in targets:
            offsets.append(o)
            o += t.tp
        bodies = {t.url: {"master_address": self.s.group_address, "master_port": port,
                          "rank_offset": off, "world_size": world, "group_name": name,
                          "backend": backend} for t, off in zip(targets, offsets)}
        made: dict[str, Any] = {}
        lock = threading.Lock()

        def rendezvous() -> None:
            try:
                pg = open_update_group(backend, self.s.group_address, port, world, 0, name,
                                       self.s.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                made["error"] = exc
                return
            with lock:  # completed after the caller gave up (a refusal): nobody else holds it
                if made.get("abandoned"):
                    _destroy_group(pg)
                else:
                    made["pg"] = pg

        try:
            with rank_executor(len(targets), "megapkl-sync") as pool:  # they join meanwhile
                futures = [pool.submit(self._call, t.url, "init_weights_update_group",
                                       bodies[t.url]) for t in targets]
                # in a thread of its own: a server that refuses to join answers at once, and the
                # rendezvous would wait for it until timeout_s (the thread gives up by then)
                joining = start_thread(rendezvous, name="megapkl-sync-rendezvous")
                while joining.is_alive():
                    raise_refusal(futures)
                    joining.join(0.005)
                if "error" in made:
                    raise made["error"]
                for f in futures:
                    f.result()
        except BaseException:
            self._abandon(targets, name, made, lock)
            raise
        pg = made["pg"]
        self._group = (membership, pg, name)
        return pg, name

    def _abandon(self, targets: Sequence[Target], name: str, made: dict, lock: Any) -> None:
        """A group whose making failed: ours is destroyed now or, if its rendezvous completes
        later, by the rendezvous thread; members that joined are told to leave (best effort)."""
        with lock:
            made["abandoned"] = True
            pg = made.pop("pg", None)
        if pg is not None:
            _destroy_group(pg)
        self._leave([t.url for t in targets], name)

    def _leave(self, urls: Sequence[str], name: str) -> None:
        """Tell each server to leave group `name` (best effort: one that never joined refuses).
        Outside the shared connections, which the engine's close has cut by then, and bounded:
        a hung server costs LEAVE_TIMEOUT_S at most."""
        for url in dict.fromkeys(urls):
            with self._lock:
                self.trace.append((url, "destroy_weights_update_group"))
            try:
                http.request(url, "destroy_weights_update_group",
                             check_fields("destroy_weights_update_group", {"group_name": name}),
                             timeout=min(self.s.timeout_s, LEAVE_TIMEOUT_S))
            except (http.ServerError, http.ServerUnreachable):
                pass

    def close_group(self, targets: Sequence[Target] = (), pending: bool = False) -> None:
        """Tell the members of the current group to leave it (best effort) and drop ours. With
        `pending` (a broadcast still waits on it), ours is aborted first, so that nothing waits on
        it, and destroyed in the background: destroying a group with a pending operation waits
        until every member has left."""
        if self._group is None:
            return
        members, pg, name = self._group
        self._group = None
        if pending and hasattr(pg, "abort"):
            pg.abort()
        self._leave([u for u, _, _ in members] + [t.url for t in targets], name)
        if pending:
            start_thread(_destroy_group, name="megapkl-sync-destroy", args=(pg,))
        else:
            _destroy_group(pg)

    def _send_distributed(self, targets: Sequence[Target], stream: Iterator[NamedTensors]) -> None:
        import torch.distributed as dist

        pg = name = None
        for bucket in stream:
            bucket = flat_order(self.transform(bucket))  # a transform may yield lazily
            if pg is None:
                pg, name = self._ensure_group(targets)
            body = {"names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": name,
                    "load_format": "flattened_bucket", "flush_cache": False}
            flat = flatten_bucket(bucket, group_device(pg))
            with rank_executor(len(targets), "megapkl-sync") as pool:
                futures = [pool.submit(self._call, t.url, "update_weights_from_distributed", body)
                           for t in targets]
                self._broadcast(dist.broadcast(flat, src=0, group=pg, async_op=True), futures)
                for f in futures:
                    f.result()

    def _broadcast(self, work: Any, answers: Sequence[Future]) -> None:
        """Wait for the broadcast of a bucket, unless a server refuses it first: a server that
        answered an error never joins, and the broadcast would wait for it until timeout_s. Then
        the group is given up (aborted, left by the servers) and the server's error raised."""
        while not work.is_completed():
            try:
                raise_refusal(answers)
            except BaseException:
                self.close_group(pending=True)
                raise
            time.sleep(0.005)
        work.wait()

    # ------------------------------------------------------------------ disk
    def _export(self, stream: Iterator[NamedTensors], version: int) -> Path:
        """A safetensors checkpoint `weights/v{version}` (one file per bucket, config.json), the
        previous export removed once this one is complete."""
        from safetensors.torch import save_file

        root = self.export_dir / "weights"
        path = root / f"v{version}"
        tmp = root / f".v{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        index: dict[str, str] = {}
        for i, bucket in enumerate(stream):
            fname = f"model-{i:05d}.safetensors"
            tensors = {n: t.detach().to("cpu").contiguous() for n, t in self.transform(bucket)}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            index.update({n: fname for n in tensors})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": index}, indent=1))
        if self.hf_config is not None:
            (tmp / "config.json").write_text(json.dumps(self.hf_config, indent=1))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        for old in root.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return path


def pin_version(source: StoredVersion, export_dir: Optional[Path],
                hf_config: Optional[dict] = None) -> StoredVersion:
    """Hold a stored version for as long as the servers hold it: a hard link under
    `<export_dir>/weights/v<N>/`, with the config.json a disk update reads (the version store may
    delete its own link meanwhile, and a restarted server is resynced from it). Versions pinned
    before are let go. Without an export directory the version is held as it is."""
    if export_dir is None:
        return source
    root = Path(export_dir) / "weights"
    pinned = source.pin(root / f"v{source.version}")
    if hf_config is not None:
        (pinned.path.parent / "config.json").write_text(json.dumps(hf_config, indent=1))
    for old in root.glob("v*"):
        if old != pinned.path.parent:
            shutil.rmtree(old, ignore_errors=True)
    return pinned


def raise_refusal(answers: Sequence[Future]) -> None:
    """Raise the error of the first server that has already answered with one."""
    for f in answers:
        if f.done() and f.exception() is not None:
            f.result()


def _destroy_group(pg: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - a half-made or aborted group has nothing to release
        pass
