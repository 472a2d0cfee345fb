"""`megapkl eval RUN_DIR_OR_CHECKPOINT [--benchmarks ...] [KEY=VALUE ...]`.

Loads the run's resolved config (RUN_DIR/config.yaml) and a complete megapkl checkpoint (the
latest of the run, `--step N`, or the checkpoint directory given), rebuilds the policy in this one
process (the distributed checkpoint reshards to TP = PP = 1), streams its weights to a rollout
engine through `update_weights` exactly as training does, and evaluates. Results go to
RUN_DIR/eval-cli/step_XXXXXX.json and .samples.jsonl (or --out): beside the run's own records in
RUN_DIR/eval/, never over them.

Any run directory is evaluated in this one process, whatever its job shape: the parallel layout
and the Slurm allocation are reset to one process below, and the rollout fleet to what one process
can place (`one_process`): the run's SGLang servers on the GPUs beside this process's one when the
machine has enough, else one server on this process's GPU; a model that does not fit one GPU is
refused up front with the memory figures. The run's config.yaml is resolved, so
each benchmark spells out its own `greedy` and `n_samples`; `eval.greedy` / `eval.n_samples` given
on the command line therefore apply to every benchmark evaluated (a greedy one keeps 1 sample).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

SINGLE_PROCESS = ("parallel.tensor=1", "parallel.pipeline=1", "parallel.context=1",
                  "parallel.expert=1", "parallel.data=1", "parallel.sequence_parallel=false",
                  "parallel.virtual_pipeline=null", "slurm.nodes=null", "slurm.gpus_per_node=null",
                  "checkpoint.resume=false")
SECTION_KEYS = ("eval.greedy", "eval.n_samples")  # applied to every benchmark evaluated
OUT_DIR = "eval-cli"  # RUN_DIR/eval holds what the run recorded during training: never written here
GIB = 2.0 ** 30


@dataclass
class OneProcess:
    """How a run is rebuilt in one process: config overrides, and one line saying where the
    rollouts are made."""

    overrides: list[str]
    says: str


def _fleet(cfg, gpus: int) -> OneProcess:
    """The run's rollout engine as one process can place it (placement.py's arithmetic: this
    process is one trainer rank on GPU 0, dedicated servers take the GPUs after it)."""
    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang":
        return OneProcess([], "the embedded engine, as configured")
    if sg.urls:
        return OneProcess([], f"the run's SGLang servers at {', '.join(sg.urls)}")
    fleet = f"{sg.num_engines} x {sg.tp} GPU(s)"
    n = min(sg.num_engines, (gpus - 1) // sg.tp) if gpus else 0  # dedicated, beside GPU 0
    if n >= 1:
        how = "the run's SGLang fleet" if n == sg.num_engines else \
            f"{n} of the {sg.num_engines} SGLang servers of a replica of the run"
        return OneProcess(["rollout.sglang.colocate=false", f"rollout.sglang.num_engines={n}"],
                          f"{how} ({n} x {sg.tp} GPU(s)) on GPUs 1-{n * sg.tp}, beside this process")
    return OneProcess(["rollout.sglang.colocate=true", "rollout.sglang.num_engines=1",
                       "rollout.sglang.tp=1", "rollout.sglang.ep=1", "rollout.sglang.use_router=false"],
                      f"one SGLang server on this process's {'GPU' if gpus else 'CPU'} (the run's "
                      f"fleet, {fleet}, does not fit the {gpus} GPU(s) here)")


def one_gpu_bytes(cfg, *, learner: bool, dedicated: bool) -> dict[str, float]:
    """What this process puts on its one GPU, in bytes: the policy in the model dtype, with
    `learner` (diagnose) its fp32 gradients, optimizer state (fp32 main copy + Adam, 12 bytes per
    parameter; 8 for an fp32 model) and the reference snapshot; the engine's weights unless they
    live on servers of their own (`dedicated`) or elsewhere (urls)."""
    from megapkl.models.sizes import served_weight_bytes, total_params
    from megapkl.models.spec import spec_from_model_config

    spec = spec_from_model_config(cfg.model)
    params = total_params(spec)
    per = 4 if cfg.model.dtype == "fp32" else 2
    rows = {"weights": params * per}
    if learner:
        rows["gradients, optimizer, reference"] = params * (4 + (8 if per == 4 else 12) + per)
    if cfg.rollout.engine != "sglang":
        rows["engine copy"] = params * per
    elif not cfg.rollout.sglang.urls and not dedicated:
        rows["engine copy"] = served_weight_bytes(spec, cfg.rollout.fp8)
    return rows


def one_process(cfg, *, gpus: int, gpu_gib: Optional[float], learner: bool = False,
                what: str = "eval") -> OneProcess:
    """The overrides that rebuild run config `cfg` in one process on this machine (`gpus` GPUs of
    `gpu_gib` GiB each; 0 and None on a CPU machine, where memory is not checked). EvalError, with
    the figures and what works instead, when the model does not fit one GPU."""
    from megapkl.eval.runner import EvalError

    placed = _fleet(cfg, gpus)
    dedicated = "rollout.sglang.colocate=false" in placed.overrides
    rows = one_gpu_bytes(cfg, learner=learner, dedicated=dedicated)
    total = sum(rows.values()) / GIB
    if gpu_gib is not None and total > gpu_gib:
        parts = " + ".join(f"{k} {v / GIB:.1f}" for k, v in rows.items())
        instead = ("a config of a smaller model of the same family (a Learner with its optimizer "
                   "is built in one process)" if learner else
                   f"a machine with {1 + cfg.rollout.sglang.num_engines * cfg.rollout.sglang.tp} "
                   "GPUs (the run's own SGLang fleet holds the engine's weights), or "
                   "rollout.sglang.urls of running servers" if "engine copy" in rows else
                   "a GPU with more memory")
        raise EvalError(f"{what}: {cfg.model.name} needs about {total:.1f} GiB on one GPU ({parts}"
                        f" GiB), this GPU has {gpu_gib:.1f} GiB; what works instead: {instead}")
    return placed


def this_machine() -> tuple[int, Optional[float]]:
    """(GPUs, GiB of the first) of this process; (0, None) without CUDA. The count as the server
    launcher reads it (rollout/sglang/build.py engine_slots): Slurm's, else CUDA's."""
    import os

    import torch

    if not torch.cuda.is_available():
        return 0, None
    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0) or torch.cuda.device_count()
    return gpus, torch.cuda.get_device_properties(0).total_memory / GIB


def single_process_config(path: Path, base: Sequence[str], given: Sequence[str] = (), *,
                          learner: bool = False, what: str = "eval"):
    """(config of run config `path` reshaped to one process on this machine, OneProcess): `base`
    (overrides, in order, that already reset the layout), then the fleet fitted to this machine
    except the rollout keys the command line `given` sets itself."""
    from megapkl.config import load_config

    gpus, gib = this_machine()
    placed = one_process(load_config(path, list(base)), gpus=gpus, gpu_gib=gib, learner=learner,
                         what=what)
    mine = {o.split("=", 1)[0].strip() for o in given}
    fit = [o for o in placed.overrides if o.split("=", 1)[0] not in mine]
    return load_config(path, [*base, *fit]), placed


def find_run(path: Path, step: Optional[int]) -> tuple[Path, Optional[Path]]:
    """(run directory, checkpoint directory or None for a run without one)."""
    path = path.resolve()
    for run in [path, *path.parents][:3]:
        if (run / "config.yaml").is_file():
            break
    else:
        raise FileNotFoundError(f"{path}: neither a megapkl run directory nor a checkpoint inside "
                                "one (no config.yaml here or two levels up)")
    if path != run:  # a checkpoint directory was named
        if not (path / "complete").exists():
            raise FileNotFoundError(f"{path}: not a complete megapkl checkpoint (no 'complete' marker)")
        return run, path
    return run, None


def checkpoint_root(cfg, run: Path) -> Path:
    """The run's checkpoint folder: checkpoint.dir, or RUN_DIR/checkpoints when that relative
    path does not resolve from here (the run was started in another directory)."""
    root = Path(cfg.checkpoint.dir)
    if not root.is_dir() and (run / "checkpoints").is_dir():
        return run / "checkpoints"
    return root


def resolve_checkpoint(cfg, run: Path, ckpt: Optional[Path], step: Optional[int]) -> Path:
    if ckpt is not None:
        return ckpt
    root = checkpoint_root(cfg, run)
    if step is not None:
        path = root / f"step_{step:08d}"
        if not (path / "complete").exists():
            raise FileNotFoundError(f"--step {step}: no complete checkpoint at {path}")
        return path
    done = sorted(p for p in root.glob("step_*") if (p / "complete").exists()) if root.is_dir() else []
    if not done:
        raise FileNotFoundError(f"{run}: no complete checkpoint in {root}")
    return done[-1]


def policy_weights(cfg, ckpt: Path):
    """(spec, iterator of (HF name, tensor)) of the checkpoint's policy, in this process."""
    from megapkl.models.checkpoint import load_checkpoint
    from megapkl.models.hf import export_hf_weights
    from megapkl.models.provider import build_model_chunks, options_from_config
    from megapkl.models.spec import spec_from_model_config
    from megapkl.train.loop import init_groups

    groups = init_groups(cfg.parallel, cfg.model, cfg.train.seed)
    spec = spec_from_model_config(cfg.model)
    chunks = build_model_chunks(spec, options_from_config(cfg.model, cfg.parallel))
    load_checkpoint(ckpt / "model", chunks, load_rng=False)
    return spec, export_hf_weights(chunks, spec=spec, groups=groups)


def engine_weights(cfg, weights):
    """What the engine is given, as in training: with FP8 rollouts only ever FP8 weights (an
    SGLang server of an FP8 run serves a block-FP8 checkpoint)."""
    if not cfg.rollout.fp8:
        return weights
    from megapkl.rollout.fp8 import FP8Transform

    return FP8Transform()(weights)


def push_weights(engine, cfg, weights, version: int) -> None:
    """Policy weights (HF names) outside training to the engine of run config `cfg`, transformed
    as training transforms them (`engine_weights`): the one way `megapkl eval` and `megapkl
    diagnose` load a policy into an engine."""
    engine.update_weights(engine_weights(cfg, weights), version=version)


def section_overrides(overrides: Sequence[str]) -> dict:
    """{'greedy': ..., 'n_samples': ...} from eval.greedy / eval.n_samples overrides."""
    from megapkl.config import parse_override

    pairs = [parse_override(o) for o in overrides]
    return {key.split(".")[1]: value for key, value in pairs if key in SECTION_KEYS}


def apply_section_overrides(benches, given: dict, n_default: int) -> None:
    """Every benchmark evaluated takes the section's greedy / n_samples given on the command
    line; greedy decoding has one sample, a benchmark turned to sampling takes `n_default`."""
    for b in benches:
        was_greedy = b.greedy
        b.greedy = given.get("greedy", b.greedy)
        if b.greedy:
            b.n_samples = 1
        elif "n_samples" in given or was_greedy:
            b.n_samples = given.get("n_samples", n_default)


def run_turn_driver(cfg, tokenizer, hold):
    """The run's multi-turn environment driver (env section), or None for single-turn runs;
    with env.search.index, the retriever it serves, started here (`hold(x)`: closed with the
    evaluation)."""
    from megapkl.envs import build_retriever, build_turn_driver
    from megapkl.rollout.synthetic import make_synthetic_task

    task = make_synthetic_task(cfg.data.synthetic) if cfg.data.synthetic else None
    retriever = hold(build_retriever(cfg.env, cfg.run_dir))
    if retriever is not None:
        retriever.start()
    return hold(build_turn_driver(cfg.env, cfg.rollout.max_response_len, tokenizer, task,
                                  retriever=retriever))


def run_eval(target: str, benchmarks: Sequence[str] = (), overrides: Sequence[str] = (),
             step: Optional[int] = None, out: Optional[str] = None) -> dict:
    import json

    from megapkl.config.layout import Layout
    from megapkl.envs import stop_strings
    from megapkl.rollout.factory import build_run_engine, load_tokenizer
    from megapkl.eval.runner import (Scoring, evaluate, load_benchmarks, settings,
                                     summarize_records, write_results)

    run, ckpt = find_run(Path(target), step)
    from megapkl import runlog

    runlog.attach(run)  # other libraries' warnings: into the run's megapkl.log
    cfg, placed = single_process_config(run / "config.yaml", [*overrides, *SINGLE_PROCESS],
                                        overrides)
    print(f"rollouts: {placed.says}", flush=True)
    ckpt = resolve_checkpoint(cfg, run, ckpt, step)
    version = json.loads((ckpt / "complete").read_text())["step"]
    tokenizer = load_tokenizer(cfg.model, cfg.data, required=False)
    benches = load_benchmarks(cfg.eval, cfg.data, tokenizer, benchmarks)
    apply_section_overrides(benches, section_overrides(overrides), cfg.eval.n_samples)
    spec, weights = policy_weights(cfg, ckpt)
    engine = build_run_engine(cfg.rollout, cfg.model, spec, tokenizer, work_dir=cfg.run_dir,
                              seed=cfg.seed, layout=Layout.of(cfg.parallel, world=1),  # 1 process
                              stop=stop_strings(cfg.env))
    with contextlib.ExitStack() as held:  # the engine (its SGLang servers) closed however this ends
        held.callback(engine.close)
        hold = lambda x: x if x is None else held.enter_context(contextlib.closing(x))  # noqa: E731
        scoring = hold(Scoring(tokenizer=tokenizer, timeout_s=cfg.eval.verify_timeout_s))
        turns = run_turn_driver(cfg, tokenizer, hold)  # multi-turn runs: their environment
        push_weights(engine, cfg, weights, version)
        records = evaluate(engine, benches, cfg.eval, cfg.rollout, step=version,
                           seed=cfg.seed, scoring=scoring, turns=turns)
    summary = {"step": version, "checkpoint": str(ckpt), **summarize_records(benches, records),
               "settings": settings(cfg.eval, cfg.rollout, benches)}
    paths = write_results(out or run / OUT_DIR, version, summary, records)
    summary["files"] = [str(p) for p in paths]
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"eval of {summary['checkpoint']} (update {summary['step']})"]
    for name, m in summary["benchmarks"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in m.items()
                          if k.startswith(("pass@", "mean@")) and isinstance(v, float))
        per = m["num_samples"] // m["num_prompts"]
        lines.append(f"  {name:16s} {m['num_prompts']:5d} prompts x {per}"
                     f": {shown} ({m['num_correct']}/{m['num_samples']} correct"
                     + (f", {m['errors']} scoring errors" if m["errors"] else "") + ")")
    mic, mac = summary["micro_average"], summary["macro_average"]
    lines.append(f"  micro average    {mic['accuracy']:.4f} ({mic['num_correct']}/{mic['num_samples']})")
    lines.append(f"  macro average    {mac['accuracy']:.4f} (mean over {mac['benchmarks']} "
                 "benchmarks: the papers' Avg)")
    lines.append("  files: " + ", ".join(summary["files"]))
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> int:
    from megapkl.eval.runner import EvalError

    names = [b for b in args.benchmarks or () if "=" not in b]
    overrides = [*args.overrides, *(b for b in args.benchmarks or () if "=" in b)]
    try:
        summary = run_eval(args.target, names, overrides, args.step, args.out)
    except (EvalError, FileNotFoundError, ValueError) as e:
        print(f"megapkl: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def add_subcommands(sub) -> None:
    from megapkl.config.overrides_cli import _IntermixedParser

    ev = sub.add_parser("eval", help="evaluate a run's checkpoint on benchmarks")
    ev.__class__ = _IntermixedParser  # KEY=VALUE anywhere on the line
    ev.add_argument("target", metavar="RUN_DIR_OR_CHECKPOINT")
    ev.add_argument("--benchmarks", nargs="+", metavar="NAME",
                    help="benchmark names (default: the run's eval.benchmarks)")
    ev.add_argument("--step", type=int, help="the checkpoint after this many updates (default: latest)")
    ev.add_argument("--out", help=f"output directory (default: RUN_DIR/{OUT_DIR}; RUN_DIR/eval "
                    "holds the in-training evaluation and is never written)")
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. eval.n_samples=4")
    ev.set_defaults(func=cmd_eval)
