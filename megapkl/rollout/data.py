"""Training prompts: JSONL / Parquet files or synthetic tasks, prompt templates, and a resumable
shuffled iterator.

    ds = PromptDataset.from_file("dapo.jsonl", tokenizer, template="qwen_math")
    it = PromptIterator(len(ds), seed=0)
    batch = [ds[i] for i in it.next_indices(32)]          # list[PromptItem]
    ckpt["data"] = it.state_dict()                         # {epoch, position, ...}

A malformed row (bad JSON, missing key, wrong type) is a `DataError` naming the file and line (the
row number for Parquet), or, with `on_error="skip"`, skipped and counted in `ds.num_skipped`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence

import torch

# CHAT_DATE: the date a chat template that stamps one renders (Llama 3.x: "Today Date: ..." in
# the system header, from the clock unless `date_string` is given), so that a run's prompts never
# depend on the day it runs (data.chat_date).
from megapkl.config.sections_train import CHAT_DATE
from megapkl.errors import MegapklError
from megapkl.rollout.sample import PromptItem

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
# The SIS paper's agent prompt (Appendix C, Table 6), the question appended after "Question: ".
# Search-R1's own (scripts/data_process/qa_search_train_merge.py) differs in small words ("as
# many times as your want", "<answer> Beijing </answer>") and ends with a newline.
SIS_AGENT = ("Answer the given question. You must conduct reasoning inside <think> and </think> "
             "first every time you get new information. After reasoning, if you find you lack "
             "some knowledge, you can call a search engine by <search> query </search>, and it "
             "will return the top searched results between <information> and </information>. "
             "You can search as many times as you want. If you find no further external "
             "knowledge needed, you can directly provide the answer inside <answer> and "
             "</answer> without detailed illustrations. For example, <answer> x </answer>. "
             "Question: {question}")
TEMPLATES = ("qwen_math", "sis_agent", "raw")


class DataError(MegapklError, ValueError):
    """A malformed prompt row; the message starts with 'FILE:LINE:' (or 'FILE:row N:')."""


@dataclass
class PromptRecord:
    """One problem before templating: its text, gold answer, and where it came from."""

    prompt: str
    answer: Optional[str]
    source: str = "<memory>"
    line: int = 0  # 1-based line (JSONL) or row (Parquet)
    extra: dict[str, Any] = field(default_factory=dict)


# ---- reading files ---------------------------------------------------------------------------


def _get_key(row: Any, key: str) -> Any:
    """row[key], where a dotted key walks nested mappings ('reward_model.ground_truth')."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def _record_from_row(row: Any, prompt_key: str, answer_key: Optional[str], where: str,
                     source: str, line: int) -> PromptRecord:
    """Validate one decoded row; raises DataError prefixed with `where`."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    try:
        prompt = _get_key(row, prompt_key)
    except KeyError:
        raise DataError(f"{where}: missing prompt key '{prompt_key}' (keys: {sorted(row)[:10]})") from None
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: prompt '{prompt_key}' must be a non-empty string, got "
                        f"{type(prompt).__name__}")
    answer = None
    if answer_key is not None:
        try:
            answer = _get_key(row, answer_key)
        except KeyError:
            raise DataError(f"{where}: missing answer key '{answer_key}'") from None
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DataError(f"{where}: answer '{answer_key}' must be a string or a number, got "
                            f"{type(answer).__name__}")
        answer = str(answer)
    used = {prompt_key.split(".")[0], *([answer_key.split(".")[0]] if answer_key else [])}
    extra = {k: v for k, v in row.items() if k not in used}  # for user rewards ("fields")
    return PromptRecord(prompt, answer, source=source, line=line, extra=extra)


class _Collector:
    """Applies the raise / skip-and-count policy to row errors."""

    def __init__(self, on_error: OnError):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error: expected 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.records: list[PromptRecord] = []
        self.errors: list[str] = []

    def add(self, make) -> None:
        try:
            self.records.append(make())
        except DataError as e:
            if self.on_error == "raise":
                raise
            self.errors.append(str(e))


def read_jsonl(path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
               on_error: OnError = "raise") -> tuple[list[PromptRecord], list[str]]:
    """Records of a JSON-lines file (blank lines ignored) and the messages of skipped rows."""
    out = _Collector(on_error)
    with open(path, "rb") as f:  # decoded per line: a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"

            def make(raw=raw, where=where, lineno=lineno):
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                    f"{e.start + 1})") from None
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                return _record_from_row(row, prompt_key, answer_key, where, path, lineno)
            out.add(make)
    return out.records, out.errors


def read_parquet(path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
                 on_error: OnError = "raise") -> tuple[list[PromptRecord], list[str]]:
    """Records of a Parquet file; rows are numbered from 1 in error messages."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading Parquet prompts needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    top = {prompt_key.split(".")[0], *([answer_key.split(".")[0]] if answer_key else [])}
    missing = sorted(k for k in top if k not in table.column_names)
    if missing and on_error == "raise":
        raise DataError(f"{path}:row 1: missing column(s) {missing} (columns: {table.column_names})")
    out = _Collector(on_error)
    for i, row in enumerate(table.to_pylist(), start=1):
        out.add(lambda row=row, i=i: _record_from_row(row, prompt_key, answer_key,
                                                      f"{path}:row {i}", path, i))
    return out.records, out.errors


def read_prompt_file(path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
                     on_error: OnError = "raise") -> tuple[list[PromptRecord], list[str]]:
    """Dispatch on the suffix: .jsonl / .json (JSON lines) or .parquet."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.endswith(".parquet"):
        return read_parquet(path, prompt_key, answer_key, on_error)
    if path.endswith((".jsonl", ".json")):
        return read_jsonl(path, prompt_key, answer_key, on_error)
    raise ValueError(f"prompt file '{path}': expected .jsonl, .json or .parquet")


# ---- templates ---------------------------------------------------------------------------------


def chatml(messages: Sequence[dict[str, str]]) -> str:
    """Plain-text ChatML (Qwen's chat format) with the assistant turn opened: the fallback when
    no HF tokenizer with a chat template is given."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def render_prompt(problem: str, template: str, tokenizer: Any = None,
                  chat_date: str = CHAT_DATE) -> tuple[str, bool]:
    """(prompt text, whether it already holds the special tokens) for a problem and template.

    qwen_math: Qwen-Math chat, system "Please reason step by step, and put your final answer
    within \\boxed{}." and the problem as the user turn, through the tokenizer's chat template when
    it has one (a template that stamps a date gets `chat_date`), else as ChatML text. sis_agent:
    the SIS paper's agent instruction with the question as the one user turn (no system turn), as
    Search-R1 renders it. raw: the problem unchanged."""
    if template == "raw":
        return problem, False
    if template in ("qwen_math", "sis_agent"):
        messages = [{"role": "system", "content": QWEN_MATH_SYSTEM},
                    {"role": "user", "content": problem}] if template == "qwen_math" else \
            [{"role": "user", "content": SIS_AGENT.format(question=problem)}]
        if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True,
                                                 date_string=chat_date), True
        return chatml(messages), True
    raise ValueError(f"unknown prompt template '{template}'; known: {list(TEMPLATES)}")


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:  # tokenizers whose encode takes only the text
        return list(tokenizer.encode(text))


def prompt_ids(tokenizer: Any, text: str, has_specials: bool) -> list[int]:
    """Token ids of a rendered prompt, BOS exactly once when the tokenizer has one it puts
    before text (Llama: the chat template writes it, plain text gets it from the tokenizer);
    a second one is an error (DataError)."""
    from megapkl.rollout.tokens import adds_bos

    ids = encode(tokenizer, text, add_special_tokens=not has_specials)
    bos = adds_bos(tokenizer)
    if bos is None:
        return ids
    if not ids or ids[0] != bos:  # a chat template that leaves BOS to the tokenizer
        ids = [bos] + ids
    if ids.count(bos) != 1:
        raise DataError(f"the prompt holds BOS ({bos}) {ids.count(bos)} times, once is right: "
                        "its text contains the BOS token")
    return ids


# ---- datasets ----------------------------------------------------------------------------------


class PromptDataset:
    """Templated, tokenized prompts (indexable; `ds[i]` is a PromptItem).

    Prompts longer than `max_prompt_len` tokens are dropped and counted in `num_too_long` (as
    RL recipes filter over-long prompts); skipped malformed rows are counted in `num_skipped`.
    """

    def __init__(self, records: Sequence[PromptRecord], tokenizer: Any, template: str = "qwen_math",
                 max_prompt_len: Optional[int] = None, max_prompts: Optional[int] = None,
                 skipped: Sequence[str] = (), chat_date: str = CHAT_DATE):
        if tokenizer is None:
            raise ValueError("PromptDataset needs a tokenizer (HF tokenizer or CharTokenizer)")
        render_prompt("x", template, tokenizer)  # unknown template: fail before any work
        self.template = template
        self.chat_date = chat_date
        self.tokenizer = tokenizer
        self.skipped = list(skipped)
        self.num_too_long = 0
        self.items: list[PromptItem] = []
        for rec in records[:max_prompts] if max_prompts else records:
            item = self._make_item(rec)
            if max_prompt_len is not None and item.prompt_ids.numel() > max_prompt_len:
                self.num_too_long += 1
                continue
            self.items.append(item)
        if self.skipped:
            log.warning("skipped %d malformed prompt rows; first: %s", len(self.skipped),
                        self.skipped[0])
        if not self.items:
            raise DataError(f"no usable prompts ({len(records)} read, {len(self.skipped)} "
                            f"malformed, {self.num_too_long} longer than max_prompt_len)")

    def _make_item(self, rec: PromptRecord) -> PromptItem:
        text, has_specials = render_prompt(rec.prompt, self.template, self.tokenizer,
                                           self.chat_date)
        try:
            ids = prompt_ids(self.tokenizer, text, has_specials)
        except DataError as exc:
            raise DataError(f"{rec.source}:{rec.line}: {exc}") from None
        meta = {"source": rec.source, "line": rec.line, "problem": rec.prompt, "fields": rec.extra}
        return PromptItem(ids, text=text, answer=rec.answer, metadata=meta)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    @classmethod
    def from_file(cls, path: str, tokenizer: Any, template: str = "qwen_math",
                  prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
                  on_error: OnError = "raise", **kwargs: Any) -> "PromptDataset":
        records, skipped = read_prompt_file(path, prompt_key, answer_key, on_error)
        try:
            return cls(records, tokenizer, template, skipped=skipped, **kwargs)
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from None

    @classmethod
    def from_synthetic(cls, task: Any, template: str = "raw", **kwargs: Any) -> "PromptDataset":
        """All problems of a synthetic task (see `megapkl.rollout.synthetic`), its own tokenizer."""
        records = [PromptRecord(p.prompt, p.answer, source=f"<synthetic:{task.name}>", line=i + 1)
                   for i, p in enumerate(task.problems())]
        return cls(records, task.tokenizer, template, **kwargs)


def build_prompt_dataset(data_cfg: Any, tokenizer: Any = None, max_prompt_len: Optional[int] = None,
                         on_error: OnError = "raise") -> PromptDataset:
    """From `megapkl.config.sections_train.DataConfig`: a synthetic task (its tokenizer) or a file."""
    if data_cfg.synthetic is not None:
        from megapkl.rollout.synthetic import make_synthetic_task

        return PromptDataset.from_synthetic(make_synthetic_task(data_cfg.synthetic),
                                            template=data_cfg.prompt_template,
                                            max_prompt_len=max_prompt_len,
                                            max_prompts=data_cfg.max_prompts)
    return PromptDataset.from_file(data_cfg.train_path, tokenizer, data_cfg.prompt_template,
                                   data_cfg.prompt_key, data_cfg.answer_key, on_error,
                                   max_prompt_len=max_prompt_len, max_prompts=data_cfg.max_prompts,
                                   chat_date=data_cfg.chat_date)


# ---- iteration ---------------------------------------------------------------------------------


class PromptIterator:
    """Endless, deterministic walk over dataset indices, epoch by epoch.

    Epoch e visits a permutation drawn from a generator seeded with (seed, e) (identity when
    shuffle is off), so the whole state is (epoch, position) and resuming from `state_dict()`
    continues exactly where an unbroken run would be. A batch may span an epoch boundary.
    """

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True):
        if size < 1:
            raise ValueError(f"PromptIterator: empty dataset (size {size})")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_indices(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.size - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_indices(1)[0]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "size": self.size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["size"], state["shuffle"]) != (self.seed, self.size, self.shuffle):
            raise ValueError(f"PromptIterator state is for seed {state['seed']}, size "
                             f"{state['size']}, shuffle {state['shuffle']}; this iterator has "
                             f"seed {self.seed}, size {self.size}, shuffle {self.shuffle}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
