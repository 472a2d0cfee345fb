"""The rows of a `megapkl smoke` run (megapkl.launch.smoke): the first rows of the config's
training file and of each benchmark's file when they are here, synthetic rows otherwise, written
into the smoke directory; the overrides that point the run at them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

PROMPT_LEN = 448  # rollout.max_prompt_len of a smoke run (the tiny models have 512 positions)
TRAIN_ROWS, EVAL_ROWS, EVAL_SAMPLES = 8, 2, 2


def _nested(key: str, value: str) -> dict:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


def synthetic_rows(n: int, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict]:
    rows = []
    for i in range(n):
        a, b = 3 + i, 4 + 2 * i
        rows.append({"id": f"smoke-{i}", **_nested(prompt_key, f"What is {a} + {b}?"),
                     **_nested(answer_key, str(a + b)), "source": "smoke"})
    return rows


def first_rows(path: Path, n: int, prompt_key: str) -> list[dict]:
    """The first `n` rows of a JSONL / Parquet prompt file whose prompt fits PROMPT_LEN
    characters (the twin's tokenizer has one token per character)."""
    from megapkl.data.prepare import get_path, read_local

    rows = []
    for row in read_local(str(path)):
        prompt = get_path(row, prompt_key)
        if isinstance(prompt, str) and len(prompt) < PROMPT_LEN - 100:  # room for the template
            rows.append(row)
            if len(rows) == n:
                break
    return rows


def take_rows(source: Optional[str], dest: Path, n: int, prompt_key: str = "prompt",
              answer_key: str = "answer") -> str:
    """Write `n` rows to `dest`: the first of `source` when it is here, synthetic otherwise;
    says which."""
    rows = first_rows(Path(source), n, prompt_key) if source and Path(source).is_file() else []
    said = f"{len(rows)} first rows of {source}"
    if not rows:
        rows = synthetic_rows(n, prompt_key, answer_key)
        why = "has none that fit" if source and Path(source).is_file() else "is not here"
        said = f"{n} synthetic rows ({source or 'no file'} {why})"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return said


def data_overrides(cfg, data: Path) -> tuple[list[str], list[str]]:
    d = cfg.data
    if d.synthetic:
        return [], [f"training data: the synthetic task {d.synthetic}, as configured"]
    said = take_rows(d.train_path, data / "train.jsonl", TRAIN_ROWS, d.prompt_key, d.answer_key)
    return [f"data.train_path={data / 'train.jsonl'}", "data.max_prompts=null"], \
        [f"training data: {said}"]


def eval_overrides(cfg, data: Path) -> tuple[list[str], list[str]]:
    """The config's benchmarks, each on a few prompts and at most EVAL_SAMPLES samples."""
    from megapkl.rollout.synthetic import SYNTHETIC_TASKS

    benches, sources = [], []
    for b in cfg.eval.resolved_benchmarks():
        item = {"name": b.name, "greedy": b.greedy, "n_samples": min(b.n_samples, EVAL_SAMPLES),
                **({"scoring": b.scoring} if b.scoring else {})}
        if b.name not in SYNTHETIC_TASKS or b.path:
            src = b.path or str(Path(cfg.eval.data_dir) / f"{b.name}.jsonl")
            dest = data / "eval" / f"{b.name}.jsonl"
            sources.append(take_rows(src, dest, EVAL_ROWS).split(" ")[1])  # 'first' / 'synthetic'
            item["path"] = str(dest)
        benches.append(item)
    if not benches:
        return [], ["evaluation: none configured"]
    real = sources.count("first")
    said = (f"evaluation: {len(benches)} benchmark(s) ({', '.join(b['name'] for b in benches)}), "
            f"{EVAL_ROWS} prompts each ({real} from their files, {len(sources) - real} "
            f"synthetic), at most {EVAL_SAMPLES} samples")
    return [f"eval.benchmarks={json.dumps(benches)}"], [said]
