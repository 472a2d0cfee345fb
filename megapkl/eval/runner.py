"""Benchmark evaluation through a rollout engine: prompts -> `engine.generate` -> scoring ->
metrics -> files. Used by `megapkl eval` and by the in-training evaluation (`megapkl.train.evaluation`); only
the `RolloutEngine` interface is touched, so any engine (embedded, SGLang) serves.

A benchmark is a synthetic task name (`next_mod10`, `add_mod10`: exact-match scoring of the task)
or a prompt/answer JSONL (`<eval.data_dir>/<name>.jsonl` from `megapkl data prepare`, or a
benchmark's `path`), scored by its `scoring`: `math`, math-verify in a worker process with a
per-sample time limit (`megapkl.rollout.bounded_verify`), or `answer_em`, the search agent's
exact match of the last <answer> the policy wrote against any gold answer (`reward.type:
answer_em`'s rule, `megapkl.rollout.rewards.answer_match`); unset, the QA sets of the dataset
table take `answer_em` and everything else `math`. A multi-turn run evaluates with its
environment: the caller hands in its turn driver (`turns`), so the benchmarks' rollouts call the
same tools (the search agent's retriever) as training does.

Files, per evaluated version v (number of optimizer updates applied):
    <out>/step_<v:06d>.json           summary: per benchmark, micro- and macro-averaged metrics,
                                      settings
    <out>/step_<v:06d>.samples.jsonl  one row per sample: benchmark, prompt_id, sample index,
                                      response, extracted answer, gold (+ every gold answer of a
                                      QA set), correct (+ error, if any)
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megapkl.errors import MegapklError
from megapkl.eval.metrics import default_ks, macro_average, micro_average, summarize
from megapkl.rollout.engine import RolloutEngine, SamplingParams
from megapkl.rollout.rewards import answer_match, gold_answers, last_action_ids
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.rollout.seeds import prompt_seed



class EvalError(MegapklError, ValueError):
    """A benchmark that cannot be evaluated (unknown name, missing file); names the key or file."""


@dataclass
class Benchmark:
    name: str
    items: list[PromptItem]  # .answer is the gold answer
    ids: list[str]
    greedy: bool
    n_samples: int
    kind: str  # 'math', 'answer_em' (exact match of the last <answer>) or 'synthetic'
    task: Any = None  # the synthetic task, for its answer reading

    def share(self, rank: int, size: int) -> list[int]:
        """Indices of the prompts rank `rank` of `size` evaluates (every size-th)."""
        return list(range(rank, len(self.items), size))


@dataclass
class SampleRecord:
    benchmark: str
    index: int  # prompt position in the benchmark
    prompt_id: str
    sample: int
    response: str
    extracted: Optional[str]
    gold: str
    correct: bool
    error: Optional[str] = None
    response_len: int = 0
    finish_reason: str = "stop"
    golds: Optional[list[str]] = None  # every gold answer (QA sets), when there are several

    def row(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "index"}
        for key in ("error", "golds"):
            if out[key] is None:
                del out[key]
        return out


# ---- building benchmarks --------------------------------------------------------------------


def load_benchmarks(eval_cfg: Any, data_cfg: Any, tokenizer: Any,
                    names: Optional[Sequence[str]] = None) -> list[Benchmark]:
    """The benchmarks of the `eval:` section (or `names`), with their prompts tokenized the way
    the run's training prompts are (data.prompt_template)."""
    from megapkl.config.sections_train import BenchmarkConfig

    configured = {b.name: b for b in eval_cfg.resolved_benchmarks()}
    if names:
        chosen = [configured.get(n) or _registry_default(n, eval_cfg) for n in names]
    else:
        chosen = list(configured.values())
        if not chosen and data_cfg.synthetic:  # a synthetic-task run evaluates its own task
            chosen = [BenchmarkConfig(name=data_cfg.synthetic, greedy=True, n_samples=1)]
    if not chosen:
        raise EvalError("eval.benchmarks is empty: name benchmarks in the config or with --benchmarks")
    return [_load_one(b, eval_cfg, data_cfg, tokenizer) for b in chosen]


def _registry_default(name: str, eval_cfg: Any):
    """A benchmark named on the command line but not in the config: the protocol of the
    dataset table (greedy or n samples), else the `eval:` section's defaults."""
    from megapkl.config.sections_train import BenchmarkConfig
    from megapkl.data.registry import SOURCES

    src = SOURCES.get(name)
    if src is not None and src.kind == "eval":
        return BenchmarkConfig(name=name, greedy=src.greedy, n_samples=src.n_samples)
    greedy = eval_cfg.greedy
    return BenchmarkConfig(name=name, greedy=greedy, n_samples=1 if greedy else eval_cfg.n_samples)


def _load_one(b: Any, eval_cfg: Any, data_cfg: Any, tokenizer: Any) -> Benchmark:
    from megapkl.rollout.synthetic import SYNTHETIC_TASKS, make_synthetic_task

    n = 1 if b.greedy else b.n_samples
    if b.name in SYNTHETIC_TASKS and b.path is None:
        task = make_synthetic_task(b.name)
        items, seen = [], set()
        for p in task.problems():  # the tasks repeat problems; evaluate each once
            if p.prompt in seen:
                continue
            seen.add(p.prompt)
            ids = task.tokenizer.encode(p.prompt, add_special_tokens=True)
            items.append(PromptItem(ids, text=p.prompt, answer=p.answer))
        return Benchmark(b.name, items, [it.text for it in items], b.greedy, n, "synthetic", task)
    path = Path(b.path or Path(eval_cfg.data_dir) / f"{b.name}.jsonl")
    if not path.is_file():
        raise EvalError(f"eval benchmark '{b.name}': no prompt file at {path} (run `megapkl data "
                        f"prepare {b.name} --out {path.parent}` or set the benchmark's path)")
    if tokenizer is None:
        raise EvalError(f"eval benchmark '{b.name}' needs the model's tokenizer (model.tokenizer)")
    from megapkl.rollout.data import PromptDataset

    ds = PromptDataset.from_file(str(path), tokenizer, data_cfg.prompt_template,
                                 chat_date=data_cfg.chat_date)
    ids = _row_ids(path)
    return Benchmark(b.name, list(ds.items), [ids.get(it.metadata["line"], f"line{it.metadata['line']}")
                                              for it in ds.items], b.greedy, n, scoring_of(b))


def scoring_of(b: Any) -> str:
    """A prompt file's scoring: the benchmark's `scoring`, else `answer_em` for the QA sets of
    the dataset table (the search agent's benchmarks) and `math` for the rest."""
    from megapkl.data.registry import QA_EVAL_SETS

    if getattr(b, "scoring", None):
        return b.scoring
    return "answer_em" if b.name in QA_EVAL_SETS else "math"


def _row_ids(path: Path) -> dict[int, str]:
    out = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            rid = json.loads(line).get("id")
            if rid is not None:
                out[i] = str(rid)
    return out


# ---- generating and scoring -----------------------------------------------------------------


def sampling_for(b: Benchmark, eval_cfg: Any, rollout_cfg: Any, seed: int) -> SamplingParams:
    max_new = eval_cfg.max_response_len or rollout_cfg.max_response_len
    if b.greedy:
        return SamplingParams(max_new_tokens=max_new, temperature=0.0, seed=seed)
    return SamplingParams(max_new_tokens=max_new, temperature=eval_cfg.temperature,
                          top_p=eval_cfg.top_p, top_k=eval_cfg.top_k, seed=seed)


@dataclass
class Scoring:
    """Scores samples of any benchmark; math answers through one bounded verifier."""

    tokenizer: Any = None
    timeout_s: int = 5
    _verifier: Any = field(default=None, repr=False)

    def text(self, b: Benchmark, s: Sample) -> str:
        if s.response_text is not None:
            return s.response_text
        tok = self.tokenizer if self.tokenizer is not None else getattr(b.task, "tokenizer", None)
        if tok is None:
            raise EvalError(f"benchmark '{b.name}': samples carry no text and no tokenizer is set")
        return tok.decode(s.response_ids.tolist(), skip_special_tokens=True)

    def __call__(self, b: Benchmark, s: Sample, where: str) -> tuple[bool, Optional[str], Optional[str]]:
        if b.kind == "synthetic":
            got = b.task.extract(last_action_ids(s))  # the policy's last turn
            return got == s.answer, got, None
        if b.kind == "answer_em":  # only the policy's own turns: never a passage or the prompt
            got, correct = answer_match(s, self.tokenizer)
            return correct, got, None
        if self._verifier is None:
            from megapkl.rollout.bounded_verify import BoundedVerifier

            self._verifier = BoundedVerifier(timeout_s=self.timeout_s)
        r = self._verifier.score(self.text(b, s), s.answer, where=where)
        return r.correct, r.extracted, r.error

    def close(self) -> None:
        if self._verifier is not None:
            self._verifier.close()
            self._verifier = None


def generate_and_score(engine: RolloutEngine, b: Benchmark, indices: Sequence[int],
                       sampling: SamplingParams, scoring: Scoring, turns: Any = None
                       ) -> list[SampleRecord]:
    """Records of the samples for prompts `indices` of `b` (n per prompt, prompt-major);
    `turns`: the multi-turn environment's driver (rollout/turns.py), or None."""
    if not indices:
        return []
    if sampling.seed is not None:  # per prompt of the benchmark: the same on any DP share
        sampling = dataclasses.replace(sampling, prompt_seeds=tuple(
            prompt_seed(sampling.seed, i) for i in indices))
    if turns is not None:  # the evaluation's response budget
        turns = turns.limited(sampling.max_new_tokens)
    samples = engine.generate([b.items[i] for i in indices], b.n_samples, sampling, turns=turns)
    out = []
    for j, s in enumerate(samples):
        i = indices[j // b.n_samples]
        where = f"{b.name}/{b.ids[i]}#{j % b.n_samples}"
        correct, extracted, error = scoring(b, s, where)
        golds = gold_answers(s) if b.kind == "answer_em" else None
        out.append(SampleRecord(b.name, i, b.ids[i], j % b.n_samples, scoring.text(b, s), extracted,
                                s.answer, bool(correct), error, s.response_len, s.finish_reason,
                                golds if golds and golds != [s.answer] else None))
    return out


# ---- summary and files ----------------------------------------------------------------------


def summarize_records(benchmarks: Sequence[Benchmark], records: Sequence[SampleRecord]) -> dict:
    """{benchmark: metrics}, the micro average (pooled samples) and the macro average (the mean
    of the benchmarks' accuracies: the SIS paper's "Avg" column), from the sample records."""
    per: dict[str, dict] = {}
    for b in benchmarks:
        grid: list[list[bool]] = [[] for _ in b.items]
        for r in records:
            if r.benchmark == b.name:
                grid[r.index].append(r.correct)
        missing = [b.ids[i] for i, g in enumerate(grid) if len(g) != b.n_samples]
        if missing:
            raise EvalError(f"benchmark '{b.name}': prompts {missing[:5]} have a wrong number of "
                            "samples")
        ks = [] if b.greedy else default_ks(b.n_samples)
        per[b.name] = summarize(grid, ks=ks, greedy=b.greedy)
        per[b.name]["errors"] = sum(1 for r in records if r.benchmark == b.name and r.error)
    return {"benchmarks": per, "micro_average": micro_average(per),
            "macro_average": macro_average(per)}


def flat_metrics(summary: dict) -> dict[str, float]:
    """The summary as metrics.jsonl / TensorBoard scalars: eval/<bench>/<metric>."""
    out: dict[str, float] = {}
    for name, m in summary["benchmarks"].items():
        for k, v in m.items():
            if k not in ("num_prompts", "num_samples", "num_correct"):
                out[f"eval/{name}/{k}"] = float(v)
    out["eval/micro_avg/accuracy"] = float(summary["micro_average"]["accuracy"])
    out["eval/macro_avg/accuracy"] = float(summary["macro_average"]["accuracy"])
    out["eval/version"] = float(summary["step"])
    return out


def write_results(out_dir: str | Path, step: int, summary: dict,
                  records: Sequence[SampleRecord]) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"step_{step:06d}"
    samples = base.with_suffix(".samples.jsonl")
    with open(samples, "w", encoding="utf-8") as f:
        for r in sorted(records, key=lambda r: (r.benchmark, r.index, r.sample)):
            f.write(json.dumps(r.row(), ensure_ascii=False) + "\n")
    summary_path = base.with_suffix(".json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary_path, samples


def evaluate(engine: RolloutEngine, benchmarks: Sequence[Benchmark], eval_cfg: Any,
             rollout_cfg: Any, *, step: int, seed: int, scoring: Scoring,
             share: tuple[int, int] = (0, 1), turns: Any = None) -> list[SampleRecord]:
    """This share's records of every benchmark (the engine holds the weights to evaluate);
    `turns`: multi-turn rollouts with the run's environment (rollout/turns.py)."""
    records: list[SampleRecord] = []
    for k, b in enumerate(benchmarks):
        sampling = sampling_for(b, eval_cfg, rollout_cfg, seed=(seed * 1_000_003 + step) * 101 + k)
        records += generate_and_score(engine, b, b.share(*share), sampling, scoring, turns)
    return records


def settings(eval_cfg: Any, rollout_cfg: Any, benchmarks: Sequence[Benchmark]) -> dict:
    return {"benchmarks": {b.name: {"greedy": b.greedy, "n_samples": b.n_samples,
                                    "prompts": len(b.items), "scoring": b.kind}
                           for b in benchmarks},
            "temperature": eval_cfg.temperature, "top_p": eval_cfg.top_p, "top_k": eval_cfg.top_k,
            "max_response_len": eval_cfg.max_response_len or rollout_cfg.max_response_len}
