"""`megapkl data prepare NAME --out DIR`: a dataset of `registry.SOURCES` into the prompt/answer
JSONL the trainer and `megapkl eval` read, deduplicated, with a manifest.

    DIR/NAME.jsonl            {"id", "prompt", "answer", "source"} per problem
    DIR/NAME.manifest.json    source, revision, rows read / written / dropped, sha256 of the JSONL

The search agent's QA sets keep every gold answer: {"id", "prompt", "answer", "golden_answers",
"source"}, `answer` the first of `golden_answers` (for logs and readers that take one), `source`
the set (nq, hotpotqa, ...: exact match is reported per source). The rows reach the reward as the
prompt's fields (`megapkl.rollout.rewards.gold_answers`). A merged set (nq_hotpotqa_train) is
its parts concatenated. Corpora and prebuilt indexes (`registry.CORPORA`: wiki18) are files,
downloaded and unpacked as they are (`prepare_corpus`).

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
from megapkl.data.registry import CORPORA, Source, get_source, plain_answer

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
        if src.dedupe and k in seen:
            out.duplicates += 1
            out.conflicting_answers += seen[k] != answer
            continue
        seen[k] = answer
        if src.all_answers:  # answer: all of them; the first leads
            rec = {"id": rid, "prompt": prompt, "answer": answer[0], "golden_answers": answer,
                   "source": src.config or src.name}
        else:
            rec = {"id": rid, "prompt": prompt, "answer": answer, "source": src.name}
        out.records.append(rec)
    return out


def _all_answers(value: Any) -> list[str]:
    """Every gold answer of a QA row, as text (a single answer: a list of one)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    out = [plain_answer(v) for v in values]
    if not out or not all(out):
        raise ValueError(f"expected a non-empty list of non-empty answers, got {value!r}")
    return out


def _fields(src: Source, row: dict, where: str) -> tuple[str, Any, Optional[str]]:
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
        answer = _all_answers(answer) if src.all_answers else plain_answer(answer)
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


def _read(src: Source, from_file: Optional[str], revision: Optional[str], keep: Optional[set],
          ) -> tuple[Converted, dict]:
    if from_file:
        rows, origin = read_local(from_file), {"file": str(from_file),
                                               "file_sha256": sha256_file(Path(from_file))}
        where = str(from_file)
    else:
        rows, origin = read_hub(src, revision)
        where = src.hf_id
    return convert(src, rows, where, keep), origin


def _read_parts(src: Source, from_files: list[Optional[str]], revision: Optional[str],
                keep: Optional[set]) -> tuple[Converted, dict]:
    """A merged set: each part converted as itself, the records concatenated in order."""
    if len(from_files) not in (0, len(src.parts)):
        raise PrepareError(f"{src.name} merges {', '.join(src.parts)}: give one --from-file "
                           f"per part, in that order (got {len(from_files)})")
    conv, origins = Converted(), {}
    for i, part in enumerate(src.parts):
        c, origin = _read(get_source(part), from_files[i] if from_files else None, revision,
                          keep)
        conv.records += c.records
        conv.rows_read += c.rows_read
        conv.duplicates += c.duplicates
        conv.conflicting_answers += c.conflicting_answers
        conv.not_kept += c.not_kept
        origins[part] = origin
    return conv, {"parts": origins, "revision": None}


def prepare(name: str, out_dir: str, from_file: Optional[str | list[str]] = None,
            revision: Optional[str] = None, keep_ids_file: Optional[str] = None,
            out_name: Optional[str] = None) -> dict:
    """Convert one dataset into OUT/<out_name or name>.jsonl; returns the manifest (also
    written beside the JSONL). `from_file`: a local copy (a merged set: one per part)."""
    src = get_source(name)
    stem = out_name or name
    keep = None
    if keep_ids_file:
        keep = {line.strip() for line in Path(keep_ids_file).read_text().splitlines() if line.strip()}
    files = [from_file] if isinstance(from_file, str) else list(from_file or [])
    if src.parts:
        conv, origin = _read_parts(src, files, revision, keep)
        where = src.name
    else:
        if len(files) > 1:
            raise PrepareError(f"{name}: one --from-file, got {len(files)}")
        conv, origin = _read(src, files[0] if files else None, revision, keep)
        where = files[0] if files else src.hf_id
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


# ---- corpora and prebuilt indexes ----------------------------------------------------------------


def _hub_files(name: str, revision: Optional[str]) -> list[Path]:
    c = CORPORA[name]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ImportError("downloading needs huggingface_hub: pip install 'megapkl[data]' (or use "
                          "--from-file with local copies)") from None
    return [Path(hf_hub_download(c.hf_id, f, repo_type="dataset", revision=revision))
            for f in c.files]


def prepare_corpus(name: str, out_dir: str, from_file: Optional[str | list[str]] = None,
                   revision: Optional[str] = None) -> dict:
    """A corpus or prebuilt index of `registry.CORPORA` into OUT/<its file>: the Hub files (or
    local copies, one per file, in order) concatenated and gunzipped. A JSONL corpus is checked
    row by row ({"id", "contents"}). Returns the manifest (also written beside it)."""
    import gzip
    import shutil

    c = CORPORA[name]
    files = [Path(f) for f in ([from_file] if isinstance(from_file, str) else from_file or [])]
    if files and len(files) != len(c.files):
        raise PrepareError(f"{name} is {len(c.files)} file(s) ({', '.join(c.files)}): give one "
                           f"--from-file each, in that order (got {len(files)})")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"--from-file: {f} does not exist")
    src = files or _hub_files(name, revision)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dest = out / c.out
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as w:
        for f in src:
            opener = gzip.open if f.name.endswith(".gz") else open
            with opener(f, "rb") as r:
                shutil.copyfileobj(r, w, 16 << 20)
    try:
        rows = _check_corpus(tmp, dest.name) if dest.suffix == ".jsonl" else None
    except PrepareError:
        tmp.unlink()
        raise
    if c.rows is not None and rows is not None and rows != c.rows and not files:
        print(f"megapkl: warning: {name}: {rows} rows, expected {c.rows}: check the source "
              "revision")
    tmp.replace(dest)
    manifest = {"name": name, "kind": "corpus", "source": {"hf_id": c.hf_id, "files": list(c.files),
                "local_files": [str(f) for f in files] or None}, "revision": revision,
                "file": dest.name, "rows": rows, "bytes": dest.stat().st_size,
                "sha256": sha256_file(dest), "license": c.license, "note": c.note,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / f"{name}.manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _check_corpus(path: Path, shown: str) -> int:
    """Rows of a corpus JSONL, each an object with an id and a text `contents`."""
    rows = 0
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise PrepareError(f"{shown}:{i}: not a JSON object ({e})") from None
            if not isinstance(row, dict) or "id" not in row \
                    or not isinstance(row.get("contents"), str):
                raise PrepareError(f"{shown}:{i}: expected {{\"id\", \"contents\"}}, got keys "
                                   f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
            rows += 1
    return rows
