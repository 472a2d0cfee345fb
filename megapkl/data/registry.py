"""The papers' datasets in one table: where each lives on the Hugging Face Hub, its columns, how
its answer is read, and how the papers evaluate it.

Column paths are dotted and may index lists (`prompt.0.content`); a source lists candidate paths in
order and the first one present in a row is used, so small layout differences between mirrors of a
benchmark do not need code. Eval protocols: PKL 6.1 / C.1 reports greedy pass@1 on MATH500,
OlympiadBench, Minerva Math and Gaokao 2023 EN and mean@16 (and pass@16) on AIME24/25 and
AMC23/24; TETPO B reports avg@16 on MATH500, AMC23/24 and AIME24/25 (temperature 0.6, top-p 0.95,
top-k 20); SIS reports accuracy on MATH500, AMC23, AIME24/25 without stating the number of samples
in the text we follow (its runs pick their own `eval.benchmarks`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

# DAPO-Math-17k wraps every problem in an instruction to end with "Answer: $Answer"; megapkl's
# prompt templates add their own instruction (\boxed{}), so the wrapper is removed.
_DAPO_HEAD = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_TAIL = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")


def strip_dapo_wrapper(text: str) -> str:
    return _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", text, count=1)).strip()


def plain_answer(value: Any) -> str:
    """A gold answer as text: lists give their first element (OlympiadBench's final_answer is a
    list), surrounding $...$ are dropped, floats that are integers lose their '.0'."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("empty answer list")
        value = value[0]
    if isinstance(value, bool) or value is None:
        raise ValueError(f"answer must be text or a number, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


@dataclass(frozen=True)
class Source:
    """One dataset: Hub location, columns, answer reading and (for eval sets) the protocol."""

    name: str
    hf_id: str
    split: str
    prompt: tuple[str, ...]  # candidate column paths for the problem text
    answer: tuple[str, ...]  # candidate column paths for the gold answer
    kind: str = "eval"  # 'eval' or 'train'
    config: Optional[str] = None  # the Hub config name
    data_files: Optional[str] = None  # a file inside the repository instead of a config
    ids: tuple[str, ...] = ()  # candidate columns for a stable problem id (else the row number)
    clean_prompt: Callable[[str], str] = str.strip
    greedy: bool = False  # eval protocol: greedy pass@1, or n_samples sampled per prompt
    n_samples: int = 16
    expected_rows: Optional[int] = None  # rows after deduplication, for a warning on a mismatch
    note: str = ""
    group: str = "math"  # `megapkl data prepare eval` prepares group math, `qa_eval` group qa
    license: str = ""  # what `megapkl data list` says of its terms
    # QA sets: keep every gold answer (`golden_answers`, a list; `answer` is the first), keep
    # repeated questions (Search-R1 does), and name the set in each row's `source`
    all_answers: bool = False
    dedupe: bool = True
    parts: tuple[str, ...] = ()  # a merged set: these sources, concatenated in order


SOURCES: dict[str, Source] = {s.name: s for s in [
    # ---- training sets
    Source("dapo_math_17k", "BytedTsinghua-SIA/DAPO-Math-17k", "train",
           prompt=("prompt.0.content", "prompt"), answer=("reward_model.ground_truth", "solution"),
           ids=("extra_info.index",), kind="train", clean_prompt=strip_dapo_wrapper,
           expected_rows=17398,
           note="The Hub copy repeats each problem ~100 times (1.79M rows); deduplication keeps "
                "17,398 problems. SIS trains on it (SIS 5.1)."),
    Source("simplelr_qwen_level3to5", "hkust-nlp/SimpleRL-Zoo-Data", "train",
           data_files="simplelr_qwen_level3to5/train.parquet",
           prompt=("question", "problem", "prompt.0.content"),
           answer=("gt_answer", "ground_truth_answer", "target", "answer",
                   "reward_model.ground_truth"), kind="train",
           note="MATH levels 3-5 (TETPO B); TETPO keeps prompts of at most 768 tokens: set "
                "rollout.max_prompt_len: 768 in the run config."),
    # ---- evaluation sets (PKL C.1 protocol; TETPO uses avg@16 on its five)
    Source("math500", "HuggingFaceH4/MATH-500", "test", prompt=("problem",), answer=("answer",),
           ids=("unique_id",), greedy=True, n_samples=1, expected_rows=500),
    Source("aime24", "HuggingFaceH4/aime_2024", "train", prompt=("problem",), answer=("answer",),
           ids=("id",), expected_rows=30),
    Source("aime25", "math-ai/aime25", "test", prompt=("problem",), answer=("answer",),
           ids=("id",), expected_rows=30),
    Source("amc23", "math-ai/amc23", "test", prompt=("question", "problem"), answer=("answer",),
           ids=("id",), expected_rows=40),
    Source("amc24", "rawsh/2024_AMC12", "train", prompt=("problem", "question"),
           answer=("answer",), ids=("id",),
           note="The AMC 2024 copy TETPO B names; PKL does not name its source."),
    Source("olympiadbench", "math-ai/olympiadbench", "test", prompt=("question", "problem"),
           answer=("final_answer", "answer"), ids=("id",), greedy=True, n_samples=1,
           expected_rows=675),
    Source("minerva_math", "math-ai/minervamath", "test", prompt=("question", "problem"),
           answer=("answer",), greedy=True, n_samples=1, expected_rows=272),
    Source("gaokao2023en", "MARIO-Math-Reasoning/Gaokao2023-Math-En", "train",
           prompt=("question", "problem"), answer=("answer",), greedy=True, n_samples=1,
           expected_rows=385),
]}

# Known but not preparable: why, in one place (`megapkl data prepare` prints it).
UNAVAILABLE = {
    "dapo_math_frpo_9453": (
        "the PKL paper trains on 9,453 prompts 'derived from FRPO's filtered DAPO-Math data'; the "
        "paper does not state the filter, so the subset cannot be rebuilt from it. Prepare "
        "dapo_math_17k (17,398 problems) and, if you obtain the FRPO prompt list, filter it with "
        "--keep-ids FILE (one extra_info.index per line) --as dapo_math_frpo_9453, the file the "
        "controlled-staleness configs read."),
}

def search_r1_question(text: str) -> str:
    """Search-R1's question clean-up: stripped, with a question mark at the end."""
    text = text.strip()
    return text if not text or text.endswith("?") else text + "?"


_FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
_FLASHRAG_TERMS = "FlashRAG_datasets: CC BY-SA 4.0 (Hub card); the original set: "


def _qa(name: str, config: str, split: str, rows: int, original_license: str, *,
        kind: str = "eval", note: str = "") -> Source:
    return Source(name, _FLASHRAG, split, prompt=("question",), answer=("golden_answers",),
                  ids=("id",), kind=kind, config=config, clean_prompt=search_r1_question,
                  n_samples=1, expected_rows=rows, group="qa", all_answers=True, dedupe=False,
                  license=_FLASHRAG_TERMS + original_license,
                  note=note or f"SIS Table 1 / Search-R1 evaluation set ({split} split)")


# The search agent's QA sets (SIS 5.1 follows Search-R1): FlashRAG's copies, test split where
# there is one, else dev; exact match of one sample at temperature 1 (SIS Table 5).
QA_SOURCES = [
    _qa("nq_train", "nq", "train", 79168, "CC BY-SA 3.0", kind="train",
        note="Natural Questions training split, one half of the agent's training set"),
    _qa("hotpotqa_train", "hotpotqa", "train", 90447, "CC BY-SA 4.0", kind="train",
        note="HotpotQA training split, the other half of the agent's training set"),
    Source("nq_hotpotqa_train", _FLASHRAG, "train", prompt=("question",),
           answer=("golden_answers",), kind="train", group="qa", all_answers=True,
           dedupe=False, parts=("nq_train", "hotpotqa_train"), expected_rows=169615,
           license="see nq_train and hotpotqa_train",
           note="The agent's training set: NQ and HotpotQA training splits concatenated, as "
                "Search-R1's qa_search_train_merge.py does (SIS 5.1)"),
    _qa("nq", "nq", "test", 3610, "CC BY-SA 3.0"),
    _qa("triviaqa", "triviaqa", "test", 11313, "Apache 2.0"),
    _qa("popqa", "popqa", "test", 14267, "MIT"),
    _qa("hotpotqa", "hotpotqa", "dev", 7405, "CC BY-SA 4.0"),
    _qa("musique", "musique", "dev", 2417, "CC BY 4.0"),
    _qa("bamboogle", "bamboogle", "test", 125, "MIT"),
]
for _s in QA_SOURCES:
    SOURCES[_s.name] = _s


@dataclass(frozen=True)
class CorpusSource:
    """A file set of the search agent's retriever on the Hub (a corpus or a prebuilt index)."""

    name: str
    hf_id: str
    files: tuple[str, ...]  # concatenated in order (a split upload), then gunzipped if .gz
    out: str  # the file written in the output directory
    rows: Optional[int] = None
    size: str = ""
    license: str = ""
    note: str = ""


CORPORA: dict[str, CorpusSource] = {c.name: c for c in [
    CorpusSource("wiki18", "PeterJinGo/wiki-18-corpus", ("wiki-18.jsonl.gz",), "wiki18.jsonl",
                 rows=21015324, size="about 14 GB unpacked (estimate: 100-word passages)",
                 license="Wikipedia text (CC BY-SA 3.0), the December 2018 dump as DPR split it",
                 note="Search-R1's corpus: 100-word passages {id, contents}, the quoted title on "
                      "the first line of contents; "
                      "index it with `megapkl retriever index`"),
    CorpusSource("wiki18_e5_flat", "PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab"),
                 "e5_Flat.index", size="about 65 GB (21,015,324 x 768 float32)",
                 license="derived from wiki18 (CC BY-SA 3.0)",
                 note="Search-R1's flat E5 index of wiki18: `megapkl retriever index --backend e5 "
                      "--faiss-index e5_Flat.index` uses it in place"),
]}


EVAL_SETS = tuple(n for n, s in SOURCES.items() if s.kind == "eval" and s.group == "math")
QA_EVAL_SETS = tuple(n for n, s in SOURCES.items() if s.kind == "eval" and s.group == "qa")


def get_source(name: str) -> Source:
    """The dataset `name` (`SOURCES`); ValueError naming the known ones."""
    if name in UNAVAILABLE:
        raise ValueError(f"dataset '{name}' cannot be prepared: {UNAVAILABLE[name]}")
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown dataset '{name}'; known: {', '.join(sorted(SOURCES))}") from None
