"""Run-config sections for optimization, data, rewards, evaluation, logging, checkpoints and Slurm.

Same conventions as `sections.py`: strict dataclasses, own-field rules in `check(err)`, cross-section
rules in `megapkl.config.run`. Defaults cite the paper appendix they come from.
"""
from __future__ import annotations

import datetime
import math

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Union

from megapkl.config.typed import rng

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# sbatch --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")


@dataclass
class TrainConfig:
    """Optimizer and schedule; `steps` counts optimizer updates (Adam, gradient clip 1)."""

    steps: int = field(default=2000, metadata=rng(1))  # PKL C.2: 1.7B evaluated at 2,000 updates
    lr: float = field(default=1e-6, metadata=rng(0.0, lo_open=True))  # PKL Table 4
    lr_schedule: Literal["constant", "cosine"] = "constant"  # PKL C.2: constant
    warmup_steps: int = field(default=0, metadata=rng(0))  # linear lr warmup, in updates
    min_lr: float = field(default=0.0, metadata=rng(0.0))  # cosine floor
    adam_beta1: float = field(default=0.9, metadata=rng(0.0, 1.0, hi_open=True))  # PKL C.2
    adam_beta2: float = field(default=0.999, metadata=rng(0.0, 1.0, hi_open=True))  # PKL C.2
    adam_eps: float = field(default=1e-8, metadata=rng(0.0, lo_open=True))  # PKL C.2
    weight_decay: float = field(default=0.0, metadata=rng(0.0))  # PKL C.2: none
    grad_clip: Optional[float] = field(default=1.0, metadata=rng(0.0, lo_open=True))  # null: off
    # A non-finite loss or gradient skips the update; this many in a row stops the run.
    max_nan_skips_in_row: int = field(default=3, metadata=rng(0))
    seed: Optional[int] = field(default=None, metadata=rng(0))  # unset: the run's seed

    def check(self, err) -> None:
        if self.warmup_steps >= self.steps:
            err(f"must be < train.steps ({self.steps}), got {self.warmup_steps}", "warmup_steps",
                "steps")
        if self.min_lr > self.lr:
            err(f"must be <= train.lr ({self.lr}), got {self.min_lr}", "min_lr", "lr")


# The Llama 3.x chat template's own date when the clock is unavailable to it.
CHAT_DATE = "26 Jul 2024"


@dataclass
class DataConfig:
    """Training prompts: a JSONL/Parquet file, or a named synthetic task (CPU demo, tests)."""

    train_path: Optional[str] = None  # prompt/answer JSONL or Parquet (`megapkl data prepare`)
    synthetic: Optional[str] = None  # a synthetic task instead: next_mod10, add_mod10
    prompt_key: str = "prompt"  # field of the problem text (dotted for nested fields)
    answer_key: str = "answer"  # field of the gold answer
    # how a raw problem becomes the model prompt: qwen_math (Qwen chat, "put your final answer
    # within \boxed{}"), sis_agent (the SIS paper's search-agent instruction, Appendix C), raw
    # (the problem as is)
    prompt_template: str = "qwen_math"
    # the date a chat template that stamps one renders (Llama 3.x's system header "Today Date:"),
    # fixed so that prompts never depend on the day of the run (day month-abbreviation year)
    chat_date: str = CHAT_DATE
    shuffle: bool = True  # a new order each pass over the data
    seed: Optional[int] = field(default=None, metadata=rng(0))  # unset: the run's seed
    max_prompts: Optional[int] = field(default=None, metadata=rng(1))  # use only the first n

    def check(self, err) -> None:
        if self.train_path is None and self.synthetic is None:
            err("set data.train_path (a JSONL/Parquet file) or data.synthetic (a task name)",
                "train_path")
        if self.train_path is not None and self.synthetic is not None:
            err("data.train_path and data.synthetic are exclusive; set the other to null",
                "synthetic", "train_path")
        if self.train_path is not None and not self.train_path.endswith(DATA_SUFFIXES):
            err(f"expected a {' / '.join(DATA_SUFFIXES)} file, got '{self.train_path}'", "train_path")
        try:
            datetime.datetime.strptime(self.chat_date, "%d %b %Y")
        except ValueError:
            err(f"must be a date written like '26 Jul 2024' (what the Llama 3.x template's "
                f"strftime('%d %b %Y') writes), got {self.chat_date!r}", "chat_date")


@dataclass
class RewardConfig:
    """How responses are scored: `correct` / `incorrect` values (PKL B.1: +1 / -1; PKL C: 1 / 0).

    `type` unset follows the data: 'synthetic' for a synthetic task, else 'math' (boxed answer).
    'answer_em': the search agent's exact match of the last <answer> the policy wrote against any
    of the row's `golden_answers` (Search-R1's; its runs score 1 / 0: set incorrect: 0).
    'python': `function` ("package.module:callable") scores each prompt group in a worker process;
    'http': a reward server at `url` does (docs/experiments.md). `timeout_s` bounds one answer
    (math: per response; python, http: per group and request). A user reward that fails either
    stops the run (`on_error: fail`) or scores its group `incorrect` (logged, `reward/errors`).
    """

    type: Optional[Literal["math", "synthetic", "answer_em", "python", "http"]] = None  # see above
    correct: float = 1.0  # reward of a correct response
    incorrect: float = -1.0  # reward of any other response (and of a failed group, on_error incorrect)
    function: Optional[str] = None  # type python: "package.module:callable"
    url: Optional[str] = None  # type http: the reward server's endpoint (http:// or https://)
    # seconds one answer may take (math: per response; python, http: per group and request)
    timeout_s: float = field(default=10.0, metadata=rng(0.0, lo_open=True))
    max_retries: int = field(default=2, metadata=rng(0))  # type http: after a failed request
    # fail: the run stops on every rank; incorrect: the group is scored `incorrect` and logged
    on_error: Literal["fail", "incorrect"] = "fail"

    def check(self, err) -> None:
        for name in ("correct", "incorrect"):  # NaN/Inf would pass the comparison below
            if not math.isfinite(getattr(self, name)):
                err(f"must be a finite number, got {getattr(self, name)}", name)
        if self.correct <= self.incorrect:
            err(f"must be > reward.incorrect ({self.incorrect}), got {self.correct}", "correct",
                "incorrect")
        if self.type == "python" and not _DOTTED.match(self.function or ""):
            err(f"reward type python needs a function 'package.module:callable', got "
                f"{self.function!r}", "function")
        if self.type != "python" and self.function is not None:
            err("is read by reward.type: python only", "function", "type")
        if self.type == "http" and not re.match(r"^https?://\S+$", self.url or ""):
            err(f"reward type http needs the reward server's http(s) URL, got {self.url!r}", "url")
        if self.type != "http" and self.url is not None:
            err("is read by reward.type: http only", "url", "type")


_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass
class BenchmarkConfig:
    """One evaluation set; unset fields take the `eval:` section's values."""

    name: str = ""  # a prepared eval set (`megapkl data list`) or a synthetic task
    greedy: Optional[bool] = None  # unset: eval.greedy
    # unset: eval.n_samples (greedy: 1)
    n_samples: Optional[int] = field(default=None, metadata=rng(1))
    path: Optional[str] = None  # default: <eval.data_dir>/<name>.jsonl
    # math: math-verify of the last \boxed{}; answer_em: exact match of the last <answer> the policy
    # wrote against every gold answer (reward.type answer_em's rule); unset: answer_em for the QA
    # sets of `megapkl data list` (nq, triviaqa, popqa, hotpotqa, musique, bamboogle), else math
    scoring: Optional[Literal["math", "answer_em"]] = None

    def check(self, err) -> None:
        if not self.name:
            err("every benchmark needs a name", "name")
        if self.greedy and self.n_samples not in (None, 1):
            err(f"greedy decoding gives one distinct answer: n_samples must be 1, got "
                f"{self.n_samples}", "n_samples", "greedy")


def _paper_benchmarks() -> list[Union[BenchmarkConfig, str]]:
    """PKL 6.1 / C.1: greedy pass@1 on four sets, mean@16 (and pass@16) on AIME/AMC."""
    greedy = ["math500", "olympiadbench", "minerva_math", "gaokao2023en"]
    sampled = ["aime24", "aime25", "amc23", "amc24"]
    return [BenchmarkConfig(name=n, greedy=True, n_samples=1) for n in greedy] + \
        [BenchmarkConfig(name=n, greedy=False, n_samples=16) for n in sampled]


@dataclass
class EvalConfig:
    """Held-out evaluation every `every` updates (0: off; `at_start` also evaluates the initial
    policy), run by `megapkl.eval`. A benchmark is a name (a prepared eval set, a synthetic task)
    or a mapping {name, greedy, n_samples, path, scoring}; the resolved config shows the full
    mappings. Greedy benchmarks report pass@1, sampled ones mean@n and pass@k for k = 1, 2, 4,
    ..., n; every evaluation also reports the micro average (pooled samples) and the macro average
    (the mean over benchmarks, the papers' "Avg")."""

    every: int = field(default=0, metadata=rng(0))  # updates between evaluations; 0: off
    at_start: bool = False  # also evaluate the initial policy
    # names or {name, greedy, n_samples, path, scoring}; default: the PKL protocol (PKL 6.1 / C.1)
    benchmarks: list[Union[BenchmarkConfig, str]] = field(default_factory=_paper_benchmarks)
    n_samples: int = field(default=16, metadata=rng(1))  # k for mean@k / pass@k
    greedy: bool = False  # for benchmarks that do not say
    temperature: float = field(default=1.0, metadata=rng(0.0, lo_open=True))  # sampled benchmarks
    top_p: float = field(default=1.0, metadata=rng(0.0, 1.0, lo_open=True))  # sampled benchmarks
    top_k: int = field(default=-1, metadata=rng(-1))  # sampled benchmarks; -1 = off
    max_response_len: Optional[int] = field(default=None, metadata=rng(1))  # unset: rollout's
    data_dir: str = "data/eval"  # <name>.jsonl from `megapkl data prepare`
    verify_timeout_s: int = field(default=5, metadata=rng(1))  # math-verify limit per sample

    def check(self, err) -> None:
        names = [b.name if isinstance(b, BenchmarkConfig) else b for b in self.benchmarks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            err(f"duplicate benchmark(s): {', '.join(dup)}", "benchmarks")
        if self.top_k == 0:
            err("must be -1 (off) or >= 1, got 0", "top_k")

    def resolved_benchmarks(self) -> list[BenchmarkConfig]:
        out = []
        for b in self.benchmarks:
            b = BenchmarkConfig(name=b) if isinstance(b, str) else b
            greedy = self.greedy if b.greedy is None else b.greedy
            n = b.n_samples if b.n_samples is not None else (1 if greedy else self.n_samples)
            out.append(BenchmarkConfig(name=b.name, greedy=greedy, n_samples=n, path=b.path,
                                       scoring=b.scoring))
        return out


@dataclass
class WandbConfig:
    """Weights & Biases logging beside TensorBoard (`pip install -e .[wandb]`). `offline` writes the
    run under <run_dir>/wandb for a later `wandb sync`; `disabled` (default) never imports wandb."""

    mode: Literal["online", "offline", "disabled"] = "disabled"  # see above
    project: str = "megapkl"  # W&B project
    entity: Optional[str] = None  # W&B team or user; unset: your default


@dataclass
class LoggingConfig:
    """Metrics output (names: docs/objectives.md and docs/engines.md): every update's row goes to
    <run_dir>/metrics.jsonl, and to TensorBoard and W&B when on; curves are smoothed with EMA alpha
    (PKL Figure 3: 0.10)."""

    # <run_dir>/tensorboard (off here; configs/base/default.yaml turns it on for paper runs)
    tensorboard: bool = False
    # `megapkl plot`'s default
    ema_alpha: float = field(default=0.1, metadata=rng(0.0, 1.0, lo_open=True))
    progress_bar: bool = True  # a progress line on the terminal (rank 0)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    # Keys older versions wrote into <run_dir>/config.yaml: accepted at the value that is now
    # always the behaviour (so those runs still resume), refused at any other.
    RETIRED: ClassVar[dict] = {"jsonl": (True, "metrics.jsonl is always written"),
                               "every": (1, "every update is logged")}


@dataclass
class CheckpointConfig:
    """Checkpointing. `every` 0 saves only at the end; `keep` null keeps all; `resume` true picks
    the latest checkpoint in `dir`, a string names one."""

    dir: Optional[str] = None  # unset: <run_dir>/checkpoints
    # updates between checkpoints; 0: at the end only
    every: int = field(default=100, metadata=rng(0))
    keep: Optional[int] = field(default=3, metadata=rng(1))  # the latest n kept; null: all
    # true: the latest in dir (`submit --if-exists resume` sets it); a path: that checkpoint
    resume: Union[bool, str] = False
    export_hf: bool = False  # at the end, also write the final weights as HF safetensors (<dir>/hf)

    def check(self, err) -> None:
        if isinstance(self.resume, str) and not self.resume.strip():
            err("must be true, false or a checkpoint path", "resume")


@dataclass
class SlurmConfig:
    """Where `megapkl submit` runs the job. The trainer world size is known when both `nodes` and
    `gpus_per_node` are set (minus SGLang GPUs when engines are not colocated); a local run leaves
    them null. One rule for every key: a key set here (a file or an override) > the cluster
    profile's value (slurm/profiles/, by `profile` name or --profile) > the code's default."""

    # slurm/profiles/<name>.yaml or a path, when --profile is not given
    profile: Optional[str] = None
    nodes: Optional[int] = field(default=None, metadata=rng(1))  # unset: the profile's
    gpus_per_node: Optional[int] = field(default=None, metadata=rng(1))  # unset: the profile's
    cpus_per_task: Optional[int] = field(default=None, metadata=rng(1))  # unset: the profile's
    mem: Optional[str] = None  # e.g. '0' (all) or '500G'
    # the job's time limit (sbatch --time; it requeues itself at the end); unset: the profile's
    time: Optional[str] = None
    partition: Optional[str] = None  # unset: the profile's
    account: Optional[str] = None  # unset: the profile's
    qos: Optional[str] = None  # unset: the profile's
    constraint: Optional[str] = None  # sbatch --constraint (GPU type); unset: the profile's
    job_name: Optional[str] = None  # unset: the run name
    exclusive: Optional[bool] = None  # whole nodes (sbatch --exclusive); unset: the profile's
    setup: list[str] = field(default_factory=list)  # shell lines run before the trainer
    extra: dict[str, Any] = field(default_factory=dict)  # extra sbatch parameters

    def check(self, err) -> None:
        if self.time is not None and not _SLURM_TIME.match(self.time):
            err(f"expected a Slurm time such as '04:00:00' or '1-12:00:00', got '{self.time}'",
                "time")
        if (self.nodes is None) != (self.gpus_per_node is None):
            missing = "gpus_per_node" if self.gpus_per_node is None else "nodes"
            err(f"slurm.nodes and slurm.gpus_per_node go together; set slurm.{missing} too",
                missing, "nodes" if missing == "gpus_per_node" else "gpus_per_node")

    @property
    def total_gpus(self) -> Optional[int]:
        if self.nodes is None or self.gpus_per_node is None:
            return None
        return self.nodes * self.gpus_per_node
