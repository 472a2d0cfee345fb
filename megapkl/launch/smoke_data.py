"""The rows of a `megapkl smoke` run (megapkl.launch.smoke): the first rows of the config's
training file and of each benchmark's file when they are here, synthetic rows otherwise, written
into the smoke directory; the overrides that point the run at them.

A search-agent config (env.type search) gets its own small world: QA rows ("Where does the king
of land3 live?" -> city3, every gold answer, a source), a generated corpus holding each answer in
a passage, and a BM25 index of it that the run serves itself (env.search.index, on a free port),
as a user's run serves wiki-18's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

PROMPT_LEN = 448  # rollout.max_prompt_len of a smoke run (the tiny models have 512 positions)
TRAIN_ROWS, EVAL_ROWS, EVAL_SAMPLES = 8, 2, 2
# A search agent's prompt is the SIS template (about 620 characters) and a question; its response
# holds a few turns and observations: the twin gets more positions (model.arch)
AGENT_PROMPT_LEN, AGENT_RESPONSE_LEN, AGENT_POSITIONS = 768, 768, 1536
# The search agent's scripted twin (megapkl.models.tiny.bigram_weights): after a newline it
# writes "<search>king" once or more, then "</search>", or "</search>" alone (an invalid action)
SEARCH_SCRIPT = {"\n": "<", "<": "s/", "/": "s", "s": "e", "e": "a", "a": "r", "r": "c",
                 "c": "h", "h": ">", ">": "k", "k": "i", "i": "n", "n": "g", "g": "<"}
LANDS, FILLERS = 12, 48
# A smoke turn and observation: room for the script's searches, and for three passages or the
# invalid-action notice (about 230 characters) whole, so the next turn starts after its newline
TURN_TOKENS, OBSERVATION_TOKENS = 48, 300


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


def qa_rows(n: int, source: str) -> list[dict]:
    """Search-agent rows whose answers the smoke corpus holds (`megapkl data prepare`'s layout:
    every gold answer, the set's name as source)."""
    return [{"id": f"smoke-{source}-{i}", "prompt": f"Where does the king of land{i % LANDS} "
             "live?", "answer": f"city{i % LANDS}",
             "golden_answers": [f"city{i % LANDS}", f"City {i % LANDS}"], "source": source}
            for i in range(n)]


def first_rows(path: Path, n: int, prompt_key: str, max_chars: int = PROMPT_LEN - 100
               ) -> list[dict]:
    """The first `n` rows of a JSONL / Parquet prompt file whose prompt is shorter than
    `max_chars` characters (the twin's tokenizer has one token per character; the template's
    room is left)."""
    from megapkl.data.prepare import get_path, read_local

    rows = []
    for row in read_local(str(path)):
        prompt = get_path(row, prompt_key)
        if isinstance(prompt, str) and len(prompt) < max_chars:
            rows.append(row)
            if len(rows) == n:
                break
    return rows


def take_rows(source: Optional[str], dest: Path, n: int, prompt_key: str = "prompt",
              answer_key: str = "answer", qa: Optional[str] = None) -> str:
    """Write `n` rows to `dest`: the first of `source` when it is here, synthetic otherwise
    (`qa`: search-agent rows of that source); says which."""
    here = source and Path(source).is_file()
    rows = first_rows(Path(source), n, prompt_key, AGENT_PROMPT_LEN - 660 if qa else
                      PROMPT_LEN - 100) if here else []
    said = f"{len(rows)} first rows of {source}"
    if not rows:
        rows = qa_rows(n, qa) if qa else synthetic_rows(n, prompt_key, answer_key)
        why = "has none that fit" if source and Path(source).is_file() else "is not here"
        said = f"{n} synthetic rows ({source or 'no file'} {why})"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return said


def data_overrides(cfg, data: Path) -> tuple[list[str], list[str]]:
    d = cfg.data
    if d.synthetic:
        return [], [f"training data: the synthetic task {d.synthetic}, as configured"]
    qa = "nq" if cfg.env.type == "search" else None
    said = take_rows(d.train_path, data / "train.jsonl", TRAIN_ROWS, d.prompt_key, d.answer_key,
                     qa=qa)
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
            qa = b.name if cfg.env.type == "search" else None
            sources.append(take_rows(src, dest, EVAL_ROWS, qa=qa).split(" ")[1])  # first/synthetic
            item["path"] = str(dest)
        benches.append(item)
    if not benches:
        return [], ["evaluation: none configured"]
    real = sources.count("first")
    said = (f"evaluation: {len(benches)} benchmark(s) ({', '.join(b['name'] for b in benches)}), "
            f"{EVAL_ROWS} prompts each ({real} from their files, {len(sources) - real} "
            f"synthetic), at most {EVAL_SAMPLES} samples")
    return [f"eval.benchmarks={json.dumps(benches)}"], [said]


def search_overrides(cfg, data: Path) -> tuple[list[str], list[str]]:
    """A search agent's world: the corpus (every king's city in a passage, filler passages),
    its BM25 index, served by the run itself on a free port, and the short turns and
    observations a smoke run's budget holds. Nothing for other configs."""
    if cfg.env.type != "search":
        return [], []
    from megapkl.rollout.sglang.launch import pick_ports

    corpus, index = data / "corpus.jsonl", data / "index"
    rows = [{"id": f"k{i}", "contents": f'"King of land{i}"\nThe king of land{i} lives in '
             f"city{i}, a city of land{i}."} for i in range(LANDS)]
    rows += [{"id": f"f{j}", "contents": f'"Filler {j}"\nA passage on river{j % 7} and '
              f"hill{j % 5}, number {j}."} for j in range(FILLERS)]
    data.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    index_command(corpus, index, data / "index.log")
    port = pick_ports("127.0.0.1", 18760, 1)[0]
    s = cfg.env.search
    said = [f"retriever {s.url or s.index} -> a BM25 index of {len(rows)} generated passages at "
            f"{index}, served by the run on port {port}",
            f"turns of at most {cfg.env.max_turn_tokens} / observations of "
            f"{cfg.env.max_observation_tokens} tokens -> {TURN_TOKENS} / {OBSERVATION_TOKENS} (max turns "
            f"{cfg.env.max_turns}, {s.topk} passages per search: kept)"]
    return ["env.search.url=null", f"env.search.index={index}", f"env.search.port={port}",
            "env.search.serve_args=[]", f"env.max_turn_tokens={TURN_TOKENS}",
            f"env.max_observation_tokens={OBSERVATION_TOKENS}"], said


def index_command(corpus: Path, index: Path, log: Path) -> None:
    """`megapkl retriever index` (BM25) in a process of its own, as a user builds an index;
    RuntimeError with its log's last line when it fails."""
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.call([sys.executable, "-m", "megapkl.retriever", "index", "--corpus",
                              str(corpus), "--out", str(index), "--backend", "bm25"],
                             stdout=f, stderr=subprocess.STDOUT)
    if rc:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise RuntimeError(f"smoke: `megapkl retriever index` exited {rc} ({log}): "
                           f"{(lines or ['(no output)'])[-1]}")
