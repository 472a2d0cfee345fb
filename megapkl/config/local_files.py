"""The files a run reads, checked on the machine it starts from before anything is submitted.

Weights are never downloaded at run time and a prompt file is first opened by the job itself, so
a missing checkpoint, an empty directory or a bad JSON line would otherwise surface minutes into
a Slurm job. `check_local_files` looks at what the job will read:

- model.hf_checkpoint: a directory holding config.json and safetensors weights;
- model.tokenizer (or the checkpoint, when it tokenizes the prompts): tokenizer files;
- data.train_path and every evaluated benchmark's prompt file: present, each JSON line an object
  with the fields the prompt reader (`megapkl.rollout.data`) requires.

Relative paths are taken from `workdir`, the directory the job starts in. `job_paths` lists the
same paths for the launcher, which checks them against a container's mounts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

# megapkl.rollout.synthetic.SYNTHETIC_TASKS (a lower layer cannot import it; a test pins the two):
# a benchmark of one of these names and no path is the task itself, not a file.
SYNTHETIC_TASK_NAMES = frozenset({"add_mod10", "next_mod10", "repeat_next_8", "repeat_next_16",
                                  "lookup_kv"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The eval runner reads benchmark files with the prompt reader's default fields.
EVAL_PROMPT_KEY, EVAL_ANSWER_KEY = "prompt", "answer"


def check_local_files(cfg: Any, workdir: "str | os.PathLike", err, *,
                      tokenizes: bool = True) -> None:
    """Refuse, through `err(message, key, *related)`, a run whose files are not there or not
    readable. `tokenizes` false (`megapkl plan`, which sizes the job from the model preset's
    shape): nothing is read yet, so model directories need only exist, a prompt file needs no
    tokenizer, and data files are checked only where they already exist."""
    for key in ("hf_checkpoint", "tokenizer"):
        value = getattr(cfg.model, key)
        if value is not None and not _is_dir(value, workdir):
            _refuse_missing_dir(key, value, workdir, err)
    if tokenizes:
        _check_checkpoint_contents(cfg, workdir, err)
        if cfg.data.train_path and not (cfg.model.tokenizer or cfg.model.hf_checkpoint):
            err(f"'{cfg.data.train_path}' is tokenized with the model's tokenizer: set "
                "model.hf_checkpoint or model.tokenizer to a local directory", "data.train_path",
                "model.hf_checkpoint")
    for key, related, path, fields, missing in _prompt_files(cfg):
        full = _from(path, workdir)
        if not full.is_file():
            if tokenizes:
                err(f"'{path}' is not a file here{_where(path, workdir)}: {missing}", key, *related)
            continue
        problem = prompt_file_problem(full, path, *fields)
        if problem:
            err(problem, key, *related)


def job_paths(cfg: Any) -> list[tuple[str, str]]:
    """(dotted key, path as configured) of every file or directory the job reads or writes, for
    the launcher's container check: model and tokenizer, prompt files, run and checkpoint dirs."""
    out = [(f"model.{k}", getattr(cfg.model, k)) for k in ("hf_checkpoint", "tokenizer")]
    out += [(key, path) for key, _, path, _, _ in _prompt_files(cfg)]
    out += [("run_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)]
    if isinstance(cfg.checkpoint.resume, str):  # a checkpoint to resume from, by path
        out.append(("checkpoint.resume", cfg.checkpoint.resume))
    return [(k, p) for k, p in out if p]


# ---- model directories


def _refuse_missing_dir(key: str, value: str, workdir, err) -> None:
    what = "Hugging Face checkpoint" if key == "hf_checkpoint" else "tokenizer"
    instead = "a random init" if key == "hf_checkpoint" else "model.hf_checkpoint's tokenizer"
    if "/" in value and not value.startswith(("/", ".", "~")) and value.count("/") == 1:
        local = f"/models/{value.split('/')[1]}"
        err(f"'{value}' is not a directory here but a Hugging Face Hub id, and megapkl never "
            f"downloads weights at run time: `hf download {value} --local-dir {local}` onto "
            f"a filesystem every node sees, then set model.{key}={local} (or model.{key}: "
            f"null for {instead})", f"model.{key}")
    err(f"'{value}' is not a directory here{_where(value, workdir)}: megapkl never downloads "
        f"weights at run time; copy the {what} there, onto a filesystem every node sees (or set "
        f"model.{key}: null for {instead})", f"model.{key}")


def _check_checkpoint_contents(cfg: Any, workdir, err) -> None:
    """The checkpoint holds what the model loader (megapkl.models.hf, safetensors only) and the
    engines read; the tokenizer directory what transformers' AutoTokenizer reads."""
    model = cfg.model
    ckpt = _from(model.hf_checkpoint, workdir) if model.hf_checkpoint else None
    if ckpt is not None and ckpt.is_dir():
        lacks = weights_problem(ckpt)
        if lacks:
            err(f"'{model.hf_checkpoint}' is not a Hugging Face checkpoint: {lacks} (copy the "
                "whole `hf download` directory, or set model.hf_checkpoint: null for a random "
                "init)", "model.hf_checkpoint")
    source_key = "tokenizer" if model.tokenizer else "hf_checkpoint"
    source = model.tokenizer or (model.hf_checkpoint if cfg.data.train_path else None)
    if source and _is_dir(source, workdir) and not any(
            (_from(source, workdir) / f).is_file() for f in TOKENIZER_FILES):
        err(f"'{source}' holds no tokenizer ({' or '.join(TOKENIZER_FILES)}) to tokenize the "
            "prompts with: copy the tokenizer files there or set model.tokenizer to a directory "
            "that has them", f"model.{source_key}")


def weights_problem(ckpt: Path) -> Optional[str]:
    """What a checkpoint directory lacks (config.json, safetensors weights), or None."""
    missing = []
    if not (ckpt / "config.json").is_file():
        missing.append("no config.json")
    if not ((ckpt / "model.safetensors.index.json").is_file() or any(ckpt.glob("*.safetensors"))):
        bins = sorted(p.name for p in ckpt.glob("pytorch_model*.bin"))
        missing.append(f"only {bins[0]} (megapkl reads safetensors weights; convert them)" if bins
                       else "no *.safetensors weights")
    return "; ".join(missing) or None


# ---- prompt files


def _prompt_files(cfg: Any) -> Iterator[tuple[str, tuple[str, ...], str, tuple[str, str], str]]:
    """(key, related keys, path, (prompt field, answer field), what to do when it is missing) of
    every prompt file the job opens: the training data and, when evaluation runs (eval.every or
    eval.at_start), each benchmark that is not a synthetic task."""
    data = cfg.data
    if data.train_path and data.synthetic is None:
        yield ("data.train_path", (), data.train_path, (data.prompt_key, data.answer_key),
               "prepare it (`megapkl data prepare NAME --out DIR`) or fix data.train_path")
    if cfg.eval.every == 0 and not cfg.eval.at_start:
        return
    for i, b in enumerate(cfg.eval.resolved_benchmarks()):
        if b.path is None and b.name in SYNTHETIC_TASK_NAMES:
            continue
        path = b.path or str(Path(cfg.eval.data_dir) / f"{b.name}.jsonl")
        keys = (f"eval.benchmarks[{i}].path", ("eval.every",)) if b.path else \
            (f"eval.benchmarks[{i}]", ("eval.data_dir", "eval.every"))
        yield (*keys, path, (EVAL_PROMPT_KEY, EVAL_ANSWER_KEY),
               f"the prompts of eval benchmark '{b.name}' (`megapkl data prepare {b.name} --out "
               f"{Path(path).parent}`, or set the benchmark's path)")


def prompt_file_problem(full: Path, shown: str, prompt_key: str,
                        answer_key: Optional[str]) -> Optional[str]:
    """The first row of a JSON-lines prompt file the reader would refuse, as 'FILE:LINE: why'
    (`shown` is the path as configured), or None. Lines are streamed: one pass, no tokenizer.
    Parquet files are read by the job alone (pyarrow), so only their presence is checked."""
    if shown.endswith(".parquet"):
        return None
    rows = 0
    with open(full, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            rows += 1
            why = _row_problem(raw, prompt_key, answer_key)
            if why:
                return f"{shown}:{lineno}: {why}"
    return None if rows else f"{shown}: holds no prompts (every line is blank)"


def _row_problem(raw: bytes, prompt_key: str, answer_key: Optional[str]) -> Optional[str]:
    """Why megapkl.rollout.data._record_from_row would refuse this line, or None."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at column {e.colno})"
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    found, prompt = _field(row, prompt_key)
    if not found:
        return f"missing prompt field '{prompt_key}' (keys: {sorted(row)[:10]})"
    if not isinstance(prompt, str) or not prompt.strip():
        return f"prompt '{prompt_key}' must be a non-empty string, got {type(prompt).__name__}"
    if answer_key is None:
        return None
    found, answer = _field(row, answer_key)
    if not found:
        return f"missing answer field '{answer_key}' (keys: {sorted(row)[:10]})"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"answer '{answer_key}' must be a string or a number, got {type(answer).__name__}"
    return None


def _field(row: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key walking nested mappings, as the reader walks it."""
    for part in key.split("."):
        if not isinstance(row, dict) or part not in row:
            return False, None
        row = row[part]
    return True, row


# ---- paths


def _from(path: str, workdir: "str | os.PathLike") -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(workdir) / p


def _is_dir(path: str, workdir: "str | os.PathLike") -> bool:
    return _from(path, workdir).is_dir()


def _where(path: str, workdir: "str | os.PathLike") -> str:
    return "" if Path(path).expanduser().is_absolute() else f" (from {Path(workdir).resolve()})"
