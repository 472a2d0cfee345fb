"""Answers of an interrupted batch, kept so that a resumed run does not generate them again.

`SGLangEngine` records every prompt group answered since the batch began (`new_batch`). When
generation fails (no engine can serve, retries exhausted), it writes those answers to
`<run_dir>/sglang[/replica<r>]/answered.pt` before the error goes up, keyed by the exact request
(the /generate body: prompt, sampling parameters, per-request seed) and the weight version that
answered it. The next engine over the same directory -- the resumed run -- takes an answer from
there instead of sending the same request again: the same request at the same version is the
same draw. So an outage loses nothing already generated, and with seeded sampling the resumed
batch is the one the interrupted run would have produced. A run resumed at another layout sends
other requests, finds no match and generates as usual; the file goes once a batch has passed
without using it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from megapkl.rollout.sglang.protocol import Decoded

log = logging.getLogger(__name__)


def request_key(body: dict, version: int) -> str:
    return hashlib.sha256(json.dumps([body, version], sort_keys=True).encode()).hexdigest()


class AnswerStore:
    def __init__(self, path: Optional[Path]):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._batch: dict[str, list[Decoded]] = {}  # answered since new_batch()
        self._saved: dict[str, list[dict]] = {}     # left by an interrupted run
        self._batches_since_load = 0
        if self.path is not None and self.path.is_file():
            try:
                self._saved = torch.load(self.path, weights_only=True)
                log.info("%s: %d answered prompt groups of an interrupted batch", self.path,
                         len(self._saved))
            except Exception as exc:  # unreadable: generate again, never fail the run for it
                log.warning("%s is unreadable (%s); the interrupted batch is generated again",
                            self.path, exc)

    def new_batch(self) -> None:
        """A batch begins: forget the previous one's answers. The saved answers serve the first
        batch after a resume; after the second begins they can match nothing and are deleted."""
        with self._lock:
            self._batch.clear()
            self._batches_since_load += 1
            if self._batches_since_load > 1 and self._saved:
                self._saved = {}
                self._delete()

    def take(self, key: str) -> Optional[list[Decoded]]:
        with self._lock:
            saved = self._saved.pop(key, None)
            if saved is not None and not self._saved:
                self._delete()
        return None if saved is None else [Decoded(**d) for d in saved]

    def record(self, key: str, decoded: list[Decoded]) -> None:
        with self._lock:
            self._batch[key] = decoded

    def keep(self) -> int:
        """Write the batch's answers (and any saved ones not used yet); returns how many."""
        if self.path is None:
            return 0
        with self._lock:
            out = {**self._saved, **{k: [dataclasses.asdict(d) for d in v]
                                     for k, v in self._batch.items()}}
            if not out:
                return 0
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            torch.save(out, tmp)
            os.replace(tmp, self.path)
        return len(out)

    def _delete(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
