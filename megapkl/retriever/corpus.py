"""A passage corpus: a JSONL file of {"id", "contents"} rows, read by row number.

Row i of an index is line i of the corpus (blank lines skipped). The corpus is never loaded into
memory: `CorpusFile.scan` reads it once, checks every row and records where each row starts
(`offsets`, 8 bytes a row: 170 MB for wiki-18's 21M passages); serving reads the rows it
returns from a memory map of the file. `contents` is Search-R1's layout: the title in double
quotes on the first line, the text after it ("\\"Title\\"\\ntext").
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megapkl.errors import MegapklError


class CorpusError(MegapklError, ValueError):
    """A corpus row or file that cannot be used; the message names the file and line."""


def check_row(row: object, where: str) -> dict:
    """The row, after checking it is {"id": str|int, "contents": str, ...}."""
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if not isinstance(row.get("contents"), str):
        raise CorpusError(f"{where}: 'contents' must be a string (keys: {sorted(row)[:8]})")
    if isinstance(row.get("id"), bool) or not isinstance(row.get("id"), (str, int)):
        raise CorpusError(f"{where}: 'id' must be a string or an integer (keys: {sorted(row)[:8]})")
    return row


def iter_rows(path: str | os.PathLike) -> Iterator[tuple[int, int, dict]]:
    """(byte offset, line number, row) of every non-blank line, each row checked."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file (a JSONL of {{\"id\", \"contents\"}} rows)")
    if path.suffix == ".gz":
        raise CorpusError(f"{path}: a compressed corpus; decompress it first (gzip -d), the "
                          "server reads rows in place")
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CorpusError(f"{path}:{lineno}: not a JSON object ({e})") from None
            yield start, lineno, check_row(row, f"{path}:{lineno}")


class CorpusFile:
    """Rows of a corpus JSONL by number (thread-safe reads from a memory map)."""

    def __init__(self, path: str | os.PathLike, offsets: np.ndarray) -> None:
        """`offsets` [N + 1] int64: where each row starts, then the file's size."""
        self.path = Path(path)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        size = self.path.stat().st_size if self.path.is_file() else None
        if size is None:
            raise CorpusError(f"{self.path}: the index's corpus file is missing")
        if size != int(self.offsets[-1]):
            raise CorpusError(f"{self.path}: {size} bytes, but the index was built over "
                              f"{int(self.offsets[-1])} bytes of it: rebuild the index "
                              "(megapkl retriever index) or point it at the original corpus")
        self._file = open(self.path, "rb")
        self._map: Optional[mmap.mmap] = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) \
            if size else None

    @classmethod
    def scan(cls, path: str | os.PathLike) -> "CorpusFile":
        """Read and check the whole corpus once, recording where every row starts."""
        starts = [start for start, _, _ in iter_rows(path)]
        if not starts:
            raise CorpusError(f"{path}: the corpus has no rows")
        return cls(path, np.array(starts + [Path(path).stat().st_size], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> dict:
        """Row `i` as stored (its id, contents and any other fields)."""
        if not 0 <= i < len(self):
            raise IndexError(f"corpus row {i} out of range (0..{len(self) - 1})")
        raw = self._map[int(self.offsets[i]):int(self.offsets[i + 1])]
        return json.loads(raw)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()

