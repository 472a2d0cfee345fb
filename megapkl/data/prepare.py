"""`megapkl data prepare NAME --out DIR`: a dataset of `registry.SOURCES` into the prompt/answer
JSONL the trainer and `megapkl eval` read, deduplicated, with a manifest.

    DIR/NAME.jsonl            {"id", "prompt", "answer", "source"} per problem
    DIR/NAME.manifest.json    source, revision, rows read / written / dropped, sha256 of the JSONL

Rows come from the Hugging Face Hub through `datasets` (imported only here: `pip install
megapkl[data]`), or with `--from-file` from a local JSONL / Parquet file in the source's own layout
(an offline copy, or the test fixtures).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from megapkl.errors import MegapklError
from megapkl.data.registry import Source, get_source, plain_answer

MISSING = object()


class PrepareError(MegapklError, ValueError):
    """A row or file that cannot be converted; the message names the file and row."""


def get_path(row: Any, path: str) -> Any:
    """row['a']['b'][0] for 'a.b.0'; MISSING when any step is absent."""
    value = row
    for part in path.split("."):
        if isinstance(value, dict):
            value = value.get(part, MISSING)
        elif isinstance(value, (list, tuple)) and part.isdigit():
            value = value[int(part)] if int(part) < len(value) else MISSING
        else:
            return MISSING
        if value is MISSING or value is None:
            return MISSING
    return value


def first_present(row: dict, paths: tuple[str, ...]) -> tuple[Optional[str], Any]:
    for p in paths:
        v = get_path(row, p)
        if v is not MISSING:
            return p, v
    return None, MISSING


# ---- reading -------------------------------------------------------------------------------------


def read_local(path: str) -> Iterator[dict]:
    """Rows of a JSONL (one JSON object a line) or Parquet file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--from-file: {path} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(p).to_pylist()
        return
    with open(p, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}:{i}: invalid JSON ({e.msg})") from None


def read_hub(src: Source, revision: Optional[str] = None) -> tuple[Iterable[dict], dict]:
    """Rows of the Hub dataset and where they came from (resolved commit when the Hub says)."""
    try:
        import datasets
    except ImportError:
        raise ImportError("downloading datasets needs the Hugging Face `datasets` package: "
                          "pip install 'megapkl[data]' (or use --from-file with a local copy)") from None
    kwargs: dict[str, Any] = {"revision": revision}
    if src.data_files:
        kwargs["data_files"] = src.data_files
    loaded = datasets.load_dataset(src.hf_id, src.config, **kwargs)
    split = src.split if src.split in loaded else (next(iter(loaded)) if len(loaded) == 1 else None)
    if split is None:
        raise PrepareError(f"{src.hf_id}: no split '{src.split}' (splits: {sorted(loaded)})")
    return loaded[split], {"hf_id": src.hf_id, "config": src.config, "data_files": src.data_files,
                           "split": split, "revision": revision or _hub_sha(src.hf_id)}


def _hub_sha(hf_id: str) -> Optional[str]:
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(hf_id).sha
    except Exception:  # offline mirror or no hub client: the manifest says unknown
        return None


# ---- converting ----------------------------------------------------------------------------------


@dataclass
class Converted:
    records: list[dict] = field(default_factory=list)
    rows_read: int = 0
    duplicates: int = 0
    conflicting_answers: int = 0  # duplicates whose answer differs from the kept copy
    not_kept: int = 0  # filtered out by keep_ids


def _key(prompt: str) -> str:
    return " ".join(prompt.split())


def convert(src: Source, rows: Iterable[dict], where: str,
            keep_ids: Optional[set[str]] = None) -> Converted:
    """Rows in the source's layout -> unique problems (first occurrence kept, in order)."""
    out, seen = Converted(), {}
    for i, row in enumerate(rows, 1):
        out.rows_read += 1
        if not isinstance(row, dict):
            raise PrepareError(f"{where}:row {i}: expected an object, got {type(row).__name__}")
        prompt, answer, rid = _fields(src, row, f"{where}:row {i}")
        if rid is None:
            rid = f"{src.name}-{i}"
        if keep_ids is not None and rid not in keep_ids:
            out.not_kept += 1
            continue
        k = _key(prompt)
        if k in seen:
            out.duplicates += 1
            out.conflicting_answers += seen[k] != answer
            continue
        seen[k] = answer
        out.records.append({"id": rid, "prompt": prompt, "answer": answer, "source": src.name})
    return out


def _fields(src: Source, row: dict, where: str) -> tuple[str, str, Optional[str]]:
    p_col, prompt = first_present(row, src.prompt)
    if p_col is None:
        raise PrepareError(f"{where}: none of the prompt columns {list(src.prompt)} is present "
                           f"(columns: {sorted(row)})")
    if not isinstance(prompt, str) or not src.clean_prompt(prompt):
        raise PrepareError(f"{where}: prompt column '{p_col}' must be non-empty text")
    a_col, answer = first_present(row, src.answer)
    if a_col is None:
        raise PrepareError(f"{where}: none of the answer columns {list(src.answer)} is present "
                           f"(columns: {sorted(row)})")
    try:
        answer = plain_answer(answer)
    except ValueError as e:
        raise PrepareError(f"{where}: answer column '{a_col}': {e}") from None
    if not answer:
        raise PrepareError(f"{where}: answer column '{a_col}' is empty")
    _, rid = first_present(row, src.ids)
    return src.clean_prompt(prompt), answer, None if rid is MISSING else str(rid)


# ---- writing -------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare(name: str, out_dir: str, from_file: Optional[str] = None,
            revision: Optional[str] = None, keep_ids_file: Optional[str] = None,
            out_name: Optional[str] = None) -> dict:
    """Convert one dataset into OUT/<out_name or name>.jsonl; returns the manifest (also
    written beside the JSONL)."""
    src = get_source(name)
    stem = out_name or name
    keep = None
    if keep_ids_file:
        keep = {line.strip() for line in Path(keep_ids_file).read_text().splitlines() if line.strip()}
    if from_file:
        rows, origin = read_local(from_file), {"file": str(from_file),
                                               "file_sha256": sha256_file(Path(from_file))}
        where = str(from_file)
    else:
        rows, origin = read_hub(src, revision)
        where = src.hf_id
    conv = convert(src, rows, where, keep)
    if not conv.records:
        raise PrepareError(f"{where}: no usable rows ({conv.rows_read} read)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{stem}.jsonl"
    tmp = data.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in conv.records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(data)
    source = {"hf_id": src.hf_id, "config": src.config, "data_files": src.data_files,
              "split": src.split, **origin}
    manifest = {"name": stem, "dataset": name, "kind": src.kind, "source": source,
                "revision": origin.get("revision"), "rows_read": conv.rows_read,
                "rows": len(conv.records), "duplicates_dropped": conv.duplicates,
                "duplicates_with_other_answer": conv.conflicting_answers,
                "not_in_keep_ids": conv.not_kept,
                "keep_ids_file": keep_ids_file, "file": data.name, "sha256": sha256_file(data),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "expected_rows": src.expected_rows, "note": src.note}
    (out / f"{stem}.manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
