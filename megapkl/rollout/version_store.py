"""Policy versions the rollout schedule still needs, held on disk instead of in host memory.

Each version is written once, as one safetensors file of (Hugging Face name, tensor) -- already
block-FP8 quantized when rollouts are FP8 -- under `<run_dir>/policy_versions/v<version>.safetensors`,
and deleted as soon as the schedule no longer needs it. Engines load a version by streaming its file
(one tensor at a time) into `update_weights`: `get(version)` is a reference to the file, never
a copy of its tensors (SGLang servers load the file itself under the disk sync; the tensor sync
reads it bucket by bucket straight into its shared memory). A checkpoint references the files
by hard-linking them into its own directory (no bytes copied on one filesystem; a copy, with a
warning, across filesystems), so deleting a version from the run directory never breaks a
checkpoint that needs it, and pruning the checkpoint frees it. Nothing here depends on ranks: one
process (global rank 0) writes and deletes, any number of engine ranks read, so a resume may use a
different data-parallel size. The run directory must be visible to every engine rank.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import Tensor

from megapkl.errors import MegapklError

_FILE = re.compile(r"^v(\d{8})\.safetensors$")


class VersionStoreError(MegapklError, RuntimeError):
    """A needed policy version is missing or unreadable; the message names the file."""


class VersionStore:
    def __init__(self, root: Union[str, os.PathLike], writer: bool = True) -> None:
        """`writer`: this process writes and deletes files (exactly one process per run)."""
        self.root = Path(root)
        self.writer = writer
        if writer:
            self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ files

    def path(self, version: int) -> Path:
        return self.root / f"v{version:08d}.safetensors"

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for f in os.listdir(self.root) if (m := _FILE.match(f)))

    def __contains__(self, version: int) -> bool:
        return self.path(version).is_file()

    def nbytes(self) -> int:
        return sum(self.path(v).stat().st_size for v in self.versions())

    def save(self, version: int, named_tensors: Iterable[tuple[str, Tensor]]) -> Optional[Path]:
        """Write `version` (consumes the stream on every process; only the writer keeps it)."""
        from megapkl.rollout.fp8 import unshared

        tensors, seen = {}, set()
        for name, t in named_tensors:
            if self.writer:
                tensors[name] = unshared(t, seen)
        if not self.writer:
            return None
        if not tensors:
            raise VersionStoreError(f"policy version {version}: no tensors to save")
        final = self.path(version)
        tmp = final.with_name(final.name + ".tmp")
        write_safetensors(tensors, tmp, {"format": "pt", "version": str(version)})
        os.replace(tmp, final)  # a reader never sees half a file
        return final

    def delete_before(self, version: int) -> list[int]:
        """Delete the files of versions < `version` (writer only); returns the deleted versions."""
        gone = [v for v in self.versions() if v < version] if self.writer else []
        for v in gone:
            self.path(v).unlink(missing_ok=True)
        return gone

    def get(self, version: int) -> "StoredVersion":
        """`version` as a re-readable source of (name, tensor): what an engine is given instead of
        a copy. VersionStoreError naming the file when it is missing."""
        path = self.path(version)
        if not path.is_file():
            raise VersionStoreError(
                f"policy version {version} is needed but its file {path} is missing (held: "
                f"{self.versions()}); was the run directory cleaned or moved?")
        return StoredVersion(version, path)

    def load(self, version: int) -> Iterator[tuple[str, Tensor]]:
        """Stream (name, tensor) of `version` from its file (`get(version).stream()`)."""
        return self.get(version).stream()

    # ------------------------------------------------------------------ checkpoints

    def link_into(self, directory: Union[str, os.PathLike], versions: Iterable[int]) -> None:
        """Reference `versions` from a checkpoint directory: hard links, a copy across devices."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for v in versions:
            _link_or_copy(self.path(v), out / self.path(v).name)

    def restore_from(self, directory: Union[str, os.PathLike], versions: Iterable[int]) -> None:
        """Make the versions a checkpoint references available in this store (resume). Safe to
        call from several processes at once."""
        src = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        for v in versions:
            f = src / self.path(v).name
            if not f.is_file():
                raise VersionStoreError(f"checkpoint references policy version {v} but {f} is "
                                        "missing")
            _link_or_copy(f, self.path(v))


class StoredVersion:
    """One policy version's file, read tensor by tensor as often as needed: an engine keeps this
    reference (to resync a restarted server, or to point servers at the file) instead of the
    tensors. `pin(directory)` hard-links the file there, so the reference outlives the store
    deleting its own link."""

    def __init__(self, version: int, path: Path) -> None:
        self.version, self.path = version, Path(path)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self.stream()

    def stream(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) in file order. A missing or corrupt file raises VersionStoreError
        naming it (before the first tensor for a bad header). Tensors are read with plain reads,
        not a memory map: a mapped file's pages would count as this process's memory until the
        map is closed (one more model copy at the peak)."""
        return _stream(self.open())

    def open(self) -> "VersionReader":
        """The file, open, with its checked header: tensors are then read by index into buffers
        the caller lays out (the tensor weight sync reads each bucket straight into its shared
        memory). VersionStoreError naming the file when it is missing, corrupt or of another
        version."""
        path, version = self.path, self.version
        if not path.is_file():
            raise VersionStoreError(f"policy version {version}: its file {path} is missing")
        f = open(path, "rb")
        try:
            entries, meta = _read_header(f, path.stat().st_size)
        except (ValueError, KeyError, TypeError) as e:
            f.close()
            raise VersionStoreError(f"policy version {version}: {path} is corrupt or not a "
                                    f"safetensors file ({e})") from e
        if meta.get("version") != str(version):
            f.close()
            raise VersionStoreError(f"policy version {version}: {path} holds version "
                                    f"{meta.get('version')!r}")
        return VersionReader(f, entries, path, version)

    def pin(self, directory: Union[str, os.PathLike], name: str = "model.safetensors"
            ) -> "StoredVersion":
        """The same version through a hard link `directory/name` (a copy across filesystems)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        _link_or_copy(self.path, out / name)
        return StoredVersion(self.version, out / name)


class VersionReader:
    """An open version file: `layout` lists (name, dtype, shape) in file order, `read_into(i, out)`
    fills `out` (a contiguous tensor of that dtype and shape, anywhere in memory) with tensor i.
    A context manager; closing it closes the file."""

    def __init__(self, f, entries, path: Path, version: int) -> None:
        self._f, self._entries, self.path, self.version = f, entries, path, version
        self.layout = [(name, dtype, shape) for name, dtype, shape, _, _ in entries]

    def read_into(self, i: int, out: Tensor) -> Tensor:
        name, dtype, shape, start, _ = self._entries[i]
        if out.dtype != dtype or list(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"tensor '{name}' is {dtype} {shape}; got a buffer of {out.dtype} "
                             f"{list(out.shape)}")
        self._read(start, out.reshape(-1).view(torch.uint8), f"tensor '{name}'")
        return out

    def offsets(self, first: int, count: int) -> list[int]:
        """File offsets of tensors first..first+count-1, which lie back to back in the file."""
        return [start for _, _, _, start, _ in self._entries[first:first + count]]

    def read_span(self, first: int, count: int, out: Tensor) -> None:
        """The bytes of tensors first..first+count-1 in one read into `out` (contiguous bytes
        of exactly their total size, anywhere in memory)."""
        entries = self._entries[first:first + count]
        start, size = entries[0][3], sum(e[4] for e in entries)
        if out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous():
            raise ValueError(f"tensors {first}..{first + count - 1} are {size} bytes; got a "
                             f"buffer of {out.numel()} {out.dtype}")
        self._read(start, out, f"tensor '{entries[0][0]}' and after")

    def _read(self, start: int, out: Tensor, what: str) -> None:
        """`out.numel()` bytes from file offset `start` into the contiguous uint8 `out`;
        VersionStoreError naming `what` on a short read."""
        size, got = out.numel(), 0
        if size:
            self._f.seek(start)
            got = self._f.readinto(memoryview(out.numpy()))
        if got != size:
            raise VersionStoreError(f"policy version {self.version}: {self.path} is corrupt at "
                                    f"{what} ({got} of {size} bytes)")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "VersionReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stream(reader: VersionReader) -> Iterator[tuple[str, Tensor]]:
    with reader:
        for i, (name, dtype, shape) in enumerate(reader.layout):
            yield name, reader.read_into(i, torch.empty(shape, dtype=dtype))


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64",
           torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def _read_header(f, file_size: int) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]],
                                              dict]:
    """([(name, dtype, shape, absolute start, bytes)], metadata) of a safetensors file, checked
    as safetensors checks it: the header fits, offsets are contiguous and cover the file exactly,
    each tensor's bytes match its dtype and shape. ValueError / KeyError / TypeError otherwise."""
    n = int.from_bytes(f.read(8), "little")
    if not 0 < n <= file_size - 8:
        raise ValueError(f"header length {n} does not fit a file of {file_size} bytes")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    entries, end = [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _FROM_NAME[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        lo, hi = (int(x) for x in info["data_offsets"])
        size = torch.Size(shape).numel() * dtype.itemsize
        if lo != end or hi - lo != size:
            raise ValueError(f"tensor '{name}': data offsets {[lo, hi]} do not follow on from "
                             f"{end} with {size} bytes")
        entries.append((name, dtype, shape, 8 + n + lo, size))
        end = hi
    if 8 + n + end != file_size:
        raise ValueError(f"the tensors end at byte {8 + n + end}, the file has {file_size}")
    return entries, meta


def write_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """The safetensors format written tensor by tensor from the tensors themselves (safetensors'
    own save_file first serializes the whole model into one more in-memory copy)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise VersionStoreError(f"policy version tensor '{name}': dtype {t.dtype} unsupported")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists() and os.path.samefile(src, dst):
        return
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    try:
        os.link(src, tmp)
    except FileNotFoundError as e:
        raise VersionStoreError(f"policy version file {src} is missing") from e
    except OSError:  # another filesystem: a copy is the only way to keep the bytes
        print(f"[megapkl] {dst.parent} is on another filesystem than {src.parent}: copying "
              f"{src.name} instead of linking it", file=sys.stderr, flush=True)
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
