"""`megapkl smoke CONFIG [KEY=VALUE ...]`: a run config followed end to end on this machine, on a
tiny twin of its model, before it is submitted.

The twin is of the same family (Qwen3, Qwen3-MoE, Llama) as the config's model, written as a
local Hugging Face checkpoint with a tokenizer (megapkl.models.tiny). The objective, protocol,
staleness, async batches, reference, FP8 and weight-sync choices are the config's own; what
scales the run to one CPU process is replaced: model, parallel layout, batch and lengths, the
SGLang fleet (`megapkl serve` workers stand in for SGLang, one process each), Slurm keys. A few
rows of the config's training and evaluation data are taken when the files are here, synthetic
rows otherwise; a search agent gets a generated corpus, its BM25 index (served by the run, as
`env.search.index` is), QA rows and a twin scripted to call the search tool (a random twin never
would). Then the very commands a user runs: `megapkl train` (a handful of updates), `megapkl eval`
of the final checkpoint and `megapkl plot`, each in its own process with its log in the smoke
directory. The report, one screen, says what was kept, what was replaced, how each stage ended,
and what cannot be checked here. `tools/smoke_all.py` smokes every run config of
configs/experiments/.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from megapkl.launch.smoke_data import (AGENT_POSITIONS, AGENT_PROMPT_LEN, AGENT_RESPONSE_LEN,
                                       PROMPT_LEN, SEARCH_SCRIPT, data_overrides, eval_overrides,
                                       search_overrides)

STEPS = 4  # a handful of updates: one weight refresh and one snapshot refresh fall inside
INTERVAL = 2  # rollout / reference refresh intervals longer than this are shortened to it
RESPONSE_LEN, MAX_ENGINES = 8, 2  # PROMPT_LEN + RESPONSE_LEN within the tiny models' 512
NOT_CHECKED = ("GPU kernels (Transformer Engine, NCCL, CUDA graphs), the real weights and "
               "tokenizer, memory fit (`megapkl plan --profile P`), multi-node placement and "
               "Slurm, SGLang itself (`megapkl serve` stands in), FP8 numerics on GPU, speed")


@dataclass
class Plan:
    """What the smoke run is: the overrides on top of the config, in words what was kept and
    what was replaced."""

    config: str
    dir: Path
    run_dir: Path
    overrides: list[str]
    kept: list[str]
    replaced: list[str]
    given: list[str] = field(default_factory=list)  # the user's overrides, which win


@dataclass
class Stage:
    name: str
    ok: Optional[bool]  # None: not run (an earlier stage failed)
    seconds: float = 0.0
    line: str = ""  # what it produced, or its one-line error
    log: Optional[Path] = None


@dataclass
class Report:
    plan: Plan
    stages: list[Stage] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.stages) and all(s.ok for s in self.stages)


# ---- what is kept, what is replaced


def kept(cfg) -> list[str]:
    ro, sg, obj = cfg.rollout, cfg.rollout.sglang, cfg.objective
    lag = ro.effective_max_staleness()
    sis = f" (SIS top-{obj.sis.top_k})" if getattr(obj.sis, "enabled", False) else ""
    out = [f"objective {obj.name}{sis}, reference {cfg.reference.mode}, lr {cfg.train.lr:g} "
           f"{cfg.train.lr_schedule}",
           f"protocol {ro.protocol}, max staleness {'-' if lag is None else lag}, "
           f"{ro.minibatches_per_batch} minibatch(es) per batch, async batches {ro.async_batches}",
           f"engine {ro.engine}, FP8 rollouts {'on' if ro.fp8 else 'off'} (KV "
           f"{ro.kv_cache_dtype}), weight sync {sg.weight_sync}, colocate {sg.colocate}, "
           f"routing replay {'on' if cfg.model.routing_replay else 'off'}"]
    if cfg.env.type:
        out.append(f"environment {cfg.env.type} (max turns {cfg.env.max_turns}), reward "
                   f"{cfg.reward.type or 'math'}, prompt template {cfg.data.prompt_template}")
    return out


def model_overrides(cfg, twin: Path, spec, scripted: bool = False,
                    positions: Optional[int] = None) -> tuple[list[str], str]:
    experts = f", {spec.num_experts} experts" if spec.is_moe else ""
    weights = ("scripted to write `<search>king</search>` turns (a random twin never calls the "
               "tool)") if scripted else "random"
    said = (f"model {cfg.model.name} ({spec.num_layers} layers{experts}, {cfg.model.dtype}) -> "
            f"{spec.tiny_twin}, {weights}, fp32{f', {positions} positions' if positions else ''}"
            f", at {twin}")
    arch = f'{{"max_position_embeddings": {positions}}}' if positions else "{}"
    return [f"model.name={spec.tiny_twin}", f"model.hf_checkpoint={twin}", "model.tokenizer=null",
            "model.num_layers=null", "model.hidden_size=null", "model.num_experts=null",
            f"model.arch={arch}", "model.dtype=fp32", "model.recompute=none"], said


def layout_overrides(cfg) -> tuple[list[str], str]:
    p = cfg.parallel
    said = (f"layout TP {p.tensor} PP {p.pipeline} CP {p.context} EP {p.expert} DP {p.data}"
            f"{' SP' if p.sequence_parallel else ''}, {cfg.slurm.nodes or '-'} node(s) x "
            f"{cfg.slurm.gpus_per_node or '-'} GPU(s) -> one CPU process, micro-batch 2")
    return ["parallel.tensor=1", "parallel.pipeline=1", "parallel.context=1", "parallel.expert=1",
            "parallel.data=1", "parallel.sequence_parallel=false", "parallel.virtual_pipeline=null",
            "parallel.micro_batch_size=2", "slurm.nodes=null", "slurm.gpus_per_node=null"], said


def serve_command(cfg, twin: Path) -> list[str]:
    """`megapkl serve` in place of SGLang's launcher (same placeholders, same HTTP API). Under
    rollout.fp8 the servers are handed a config-only model directory and dummy weights, the
    trainer pushing block-FP8 weights before any generation: the worker starts from the twin's
    spec in FP8 instead."""
    from megapkl.models.spec import spec_from_model_config

    name = spec_from_model_config(cfg.model).tiny_twin
    source = ["--model-config", name, "--quantization", "fp8", "--tokenizer", str(twin)] \
        if cfg.rollout.fp8 else ["--hf-checkpoint", "{model_path}"]
    cmd = ["{python}", "-m", "megapkl.serve.serve", *source, "--host", "{host}", "--port", "{port}"]
    return cmd + (["--enable-return-routed-experts"] if cfg.model.routing_replay else [])


def rollout_overrides(cfg, twin: Path) -> tuple[list[str], str]:
    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang":
        return [], "rollouts: the embedded engine, as configured"
    n = min(sg.num_engines, MAX_ENGINES)
    router = " behind sglang-router" if sg.use_router else ""
    said = (f"rollouts {sg.num_engines} SGLang server(s) of TP {sg.tp} EP {sg.ep}{router} -> "
            f"{n} `megapkl serve` worker(s), no router")
    return [f"rollout.sglang.server_command={json.dumps(serve_command(cfg, twin))}",
            f"rollout.sglang.num_engines={n}", "rollout.sglang.tp=1", "rollout.sglang.ep=1",
            "rollout.sglang.use_router=false", "rollout.sglang.urls=[]",
            "rollout.sglang.router_url=null", "rollout.sglang.startup_timeout_s=300"], said


def scale_overrides(cfg, steps: int) -> tuple[list[str], list[str]]:
    """Batch, lengths, steps and refresh intervals of a CPU run of the same protocol."""
    ro, tr, ref = cfg.rollout, cfg.train, cfg.reference
    prompts = 2 * ro.minibatches_per_batch  # every minibatch keeps whole prompt groups
    plen, rlen = (AGENT_PROMPT_LEN, AGENT_RESPONSE_LEN) if cfg.env.type == "search" else \
        (PROMPT_LEN, RESPONSE_LEN)
    out = [f"rollout.prompts_per_batch={prompts}", "rollout.responses_per_prompt=2",
           f"rollout.max_prompt_len={plen}", f"rollout.max_response_len={rlen}",
           f"train.steps={steps}", f"train.warmup_steps={min(tr.warmup_steps, steps - 1)}"]
    said = [f"batch {ro.prompts_per_batch} x {ro.responses_per_prompt}, lengths "
            f"{ro.max_prompt_len}/{ro.max_response_len}, {tr.steps} updates (warmup "
            f"{tr.warmup_steps}) -> {prompts} x 2, {plen}/{rlen}, {steps} "
            f"(warmup {min(tr.warmup_steps, steps - 1)})"]
    intervals = []
    if ro.protocol == "periodic_refresh" and (ro.effective_refresh_every() or 0) > INTERVAL:
        out.append(f"rollout.refresh_every={INTERVAL}")
        intervals.append(f"weight refresh every {ro.effective_refresh_every()}")
    if ref.mode == "snapshot" and (ref.refresh_every or 0) > INTERVAL:
        out.append(f"reference.refresh_every={INTERVAL}")
        intervals.append(f"reference refresh every {ref.refresh_every}")
    if intervals:
        said.append(", ".join(intervals) + f" -> every {INTERVAL} updates (so they happen)")
    return out, said


def reward_overrides(cfg) -> tuple[list[str], str]:
    """A random tiny model answers nothing right: every response earns `incorrect`, so
    group-relative advantages would all be 0 and no weight would move. Raw rewards, made
    negative, keep the gradients nonzero."""
    out = ["advantage.mode=raw", "advantage.filter_constant_groups=false"]
    if cfg.reward.incorrect == 0:
        out.append("reward.incorrect=-1")
    said = (f"advantages {cfg.advantage.mode}"
            f"{' + dynamic sampling' if cfg.advantage.filter_constant_groups else ''} -> raw "
            f"rewards{' (incorrect 0 -> -1)' if cfg.reward.incorrect == 0 else ''}: a random "
            "model earns one reward for every response")
    return out, said


def run_overrides(cfg, run_dir: Path, steps: int) -> list[str]:
    every = steps if cfg.eval.every else 0
    return [f"run_dir={run_dir}", f"eval.every={every}", "eval.at_start=false",
            "eval.max_response_len=null", f"checkpoint.every={steps}", "checkpoint.dir=null",
            "checkpoint.resume=false", "logging.progress_bar=false", "logging.wandb.mode=disabled"]


# ---- the plan


def own_keys(overrides: Sequence[str]) -> set[str]:
    return {o.split("=", 1)[0].strip() for o in overrides}


def make_plan(config: str, overrides: Sequence[str] = (), out_dir: Optional[str] = None,
              steps: int = STEPS) -> Plan:
    """Load the config (with the user's overrides), write the twin and the data rows into the
    smoke directory, and derive the overrides of the smoke run. The user's overrides win over
    the derived ones (`rollout.engine=embedded` smokes the embedded engine)."""
    from megapkl.config import load_config
    from megapkl.models.spec import spec_from_model_config
    from megapkl.models.tiny import write_twin

    if steps < 2:
        raise ValueError(f"smoke: --steps must be at least 2, got {steps}")
    cfg = load_config(config, list(overrides))
    spec = spec_from_model_config(cfg.model)
    root = Path(out_dir or Path("runs") / "smoke" / cfg.name).absolute()
    search = cfg.env.type == "search"  # the agent's prompts and turns need more positions
    scripted = search and spec.family == "qwen3"  # the bigram script speaks the Qwen twin's ids
    positions = AGENT_POSITIONS if search else None
    twin = write_twin(root / "model", spec.tiny_twin, positions=positions,
                      script=SEARCH_SCRIPT if scripted else None)
    run_dir = root / "run"
    shutil.rmtree(root / "plots", ignore_errors=True)  # a former smoke's plots prove nothing
    model, said_model = model_overrides(cfg, twin, spec, scripted, positions)
    layout, said_layout = layout_overrides(cfg)
    rollout, said_rollout = rollout_overrides(cfg, twin)
    scale, said_scale = scale_overrides(cfg, steps)
    reward, said_reward = reward_overrides(cfg)
    mine = own_keys(overrides)
    data, said_data = ([], ["training data: data.train_path as given"]) \
        if "data.train_path" in mine else data_overrides(cfg, root / "data")
    evals, said_eval = ([], ["evaluation: eval.benchmarks as given"]) \
        if "eval.benchmarks" in mine else eval_overrides(cfg, root / "data")
    env, said_env = search_overrides(cfg, root / "data")
    derived = [*model, *layout, *rollout, *scale, *reward, *data, *evals, *env,
               *run_overrides(cfg, run_dir, steps)]
    final = [*overrides, *(o for o in derived if o.split("=", 1)[0] not in mine)]
    replaced = [said_model, said_layout, said_rollout, *said_scale, said_reward, *said_data,
                *said_eval, *said_env]
    return Plan(config, root, run_dir, final, kept(cfg), replaced, list(overrides))


# ---- the stages, each a `megapkl` command in a process of its own

Command = Callable[[list], int]  # megapkl.cli.main: argv -> exit code


def _forked(command: Command, argv: list, log: Path) -> int:
    """`command(argv)` in a forked child (it inherits the imported torch and megatron-core) with
    stdout and stderr into `log`; its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        rc = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = open(1, "w", closefd=False, buffering=1)
            sys.stderr = open(2, "w", closefd=False, buffering=1)
            import torch

            torch.set_num_threads(1)  # GNU OpenMP is not fork-safe once the parent used it
            rc = command(list(argv))
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # noqa: BLE001 - whatever it is, into the log
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _subprocess(argv: list, log: Path) -> int:
    with open(log, "w", encoding="utf-8") as f:
        return subprocess.call([sys.executable, "-m", "megapkl.cli", *argv], stdout=f,
                               stderr=subprocess.STDOUT)


def error_line(log: Path) -> str:
    """The command's one-line error (`megapkl: error: ...`), else the last line of its log."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("megapkl: error:")]
    return (errors or lines or ["(no output)"])[-1]


def run_stage(name: str, argv: list, plan: Plan, command: Optional[Command],
              check: Callable[[], str]) -> Stage:
    """One `megapkl ARGV` command; `check` says what it produced (raises when it did not)."""
    log = plan.dir / f"{name}.log"
    print(f"smoke: {name} (log {log})", file=sys.stderr, flush=True)
    start = time.monotonic()
    rc = _forked(command, argv, log) if command else _subprocess(argv, log)
    stage = Stage(name, rc == 0, time.monotonic() - start, log=log)
    if rc != 0:
        stage.line = f"exit {rc}: {error_line(log)}"
        return stage
    try:
        stage.line = check()
    except (AssertionError, OSError, ValueError, KeyError) as exc:
        stage.ok, stage.line = False, f"finished, but {' '.join(str(exc).split())}"
    return stage


def check_train(plan: Plan, steps: int, source) -> str:
    """Every update logged, and the run's resolved config.yaml still the config's objective
    and protocol."""
    from megapkl.config import load_config

    rows = [json.loads(x) for x in (plan.run_dir / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    if len(rows) != steps:
        raise ValueError(f"metrics.jsonl holds {len(rows)} updates, not {steps}")
    ran = load_config(plan.run_dir / "config.yaml")
    for key in ("objective", "rollout.protocol", "rollout.max_staleness", "rollout.fp8",
                "rollout.async_batches", "rollout.sglang.weight_sync", "model.routing_replay"):
        a, b = ran, source
        for part in key.split("."):
            a, b = getattr(a, part), getattr(b, part)
        if a != b:
            raise ValueError(f"the run's {key} is {a!r}, the config's {b!r}")
    replayed = ""
    if source.model.routing_replay:  # the served samples must carry their routed experts
        tokens = rows[0].get("mismatch/routing_tokens") or 0
        if tokens <= 0:
            raise ValueError("routing replay is on, but no sample came with its routed experts")
        replayed = f", routed experts of {tokens:g} tokens replayed"
    last = rows[-1]
    grad = last.get("grad_norm")
    return (f"{len(rows)} updates in metrics.jsonl (last loss {last.get('loss', float('nan')):.4g}"
            + (f", grad norm {grad:.3g}" if isinstance(grad, (int, float)) else "") + replayed
            + ")")


def check_eval(plan: Plan) -> str:
    done = sorted((plan.run_dir / "eval-cli").glob("step_*.json"))
    if not done:
        raise ValueError(f"no result in {plan.run_dir / 'eval-cli'}")
    summary = json.loads(done[-1].read_text())
    mic = summary["micro_average"]
    return (f"{len(summary['benchmarks'])} benchmark(s) at update {summary['step']}, "
            f"{mic['num_samples']} samples scored ({done[-1].name})")


def check_plot(plan: Plan) -> str:
    pngs = sorted((plan.dir / "plots").glob("*.png"))
    if not pngs:
        raise ValueError(f"no PNG in {plan.dir / 'plots'}")
    return f"{len(pngs)} PNG(s) in {plan.dir / 'plots'}"


def smoke(config: str, overrides: Sequence[str] = (), out_dir: Optional[str] = None,
          steps: int = STEPS, command: Optional[Command] = None) -> Report:
    """Smoke `config`: plan, then train, eval and plot (each skipped once one fails). `command`:
    megapkl's CLI entry point, run in forked children (imports shared); without it each stage
    is `python -m megapkl.cli` in a subprocess."""
    from megapkl.config import load_config

    plan = make_plan(config, overrides, out_dir, steps)
    report = Report(plan)
    if command is not None:  # imported once here, inherited by every forked stage
        from megapkl.parallel.forked import preload_megatron

        preload_megatron()
    source = load_config(config, list(overrides))
    stages = [("train", ["train", config, *plan.overrides, "--if-exists", "overwrite"],
               lambda: check_train(plan, steps, source)),
              ("eval", ["eval", str(plan.run_dir)], lambda: check_eval(plan)),
              ("plot", ["plot", str(plan.run_dir), "--out", str(plan.dir / "plots")],
               lambda: check_plot(plan))]
    for name, argv, check in stages:
        if report.stages and not report.stages[-1].ok:
            report.stages.append(Stage(name, None, line="not run"))
            continue
        report.stages.append(run_stage(name, argv, plan, command, check))
    return report


def format_report(report: Report) -> str:
    """One screen: the verdict, kept, replaced, each stage, what was not checked, what next."""
    p = report.plan
    lines = [f"smoke {p.config}: {'ok' if report.ok else 'FAILED'} ({p.dir})", "kept:"]
    lines += [f"  {line}" for line in p.kept] + ["replaced:"]
    lines += [f"  {line}" for line in p.replaced]
    if p.given:
        lines.append(f"given (these win): {' '.join(p.given)}")
    lines.append("stages:")
    for s in report.stages:
        verdict = {True: "ok", False: "FAILED", None: "-"}[s.ok]
        lines.append(f"  {s.name:5s} {verdict:6s} {s.seconds:6.1f} s  {s.line}")
    lines += ["not checked here:", f"  {NOT_CHECKED}"]
    if report.ok:
        lines.append(f"next: megapkl submit {p.config} --profile PROFILE "
                     "model.hf_checkpoint=/path/to/the/checkpoint")
    return "\n".join(lines)
