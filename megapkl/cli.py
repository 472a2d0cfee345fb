"""`megapkl` command line.

    megapkl config show FILE [KEY=VALUE ...]     print the fully resolved config (YAML)
    megapkl config validate FILE [FILE ...]      check configs, one line per file
    megapkl config reference [--out FILE]        every config key (docs/config.md)
    megapkl train CONFIG [KEY=VALUE ...] [--if-exists error|resume|overwrite]
                                                 train (validates the config first)
    megapkl demo [--compare|--lookup] [KEY=VALUE ...]  the CPU demo (configs/demo/cpu_demo.yaml)
    megapkl plot RUN_DIR... [--out DIR]          EMA-smoothed curves into PNG files
    megapkl smoke CONFIG [KEY=VALUE ...]         the config end to end on a tiny twin of its model
    megapkl compare CONFIG --methods A,B --seeds N   methods x seeds, intervals and a report

KEY=VALUE overrides may come anywhere on a command's line. A bad config is one line on stderr naming the file, line and dotted key, and exit code 2. Imports
are lazy: `config show` never imports torch. `cmd_train` and `cmd_demo` are the seams where the
trainer plugs in.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, Optional, Sequence

from megapkl.errors import MegapklError

EXIT_CONFIG = 2  # bad config or bad usage (argparse uses 2 as well)
EXIT_ERROR = 1  # anything else that stops a command: one line on stderr, the traceback with --debug
EXIT_INTERRUPTED = 130


class UsageError(MegapklError, ValueError):
    """Bad command-line usage that argparse cannot see (exit 2)."""


def _load(path: str, overrides: Sequence[str] = (), *, local: bool = False):
    """The resolved config; `local`: the files it reads here (model.hf_checkpoint) must exist."""
    from megapkl.config import load_config
    return load_config(path, list(overrides), workdir=os.getcwd() if local else None)


def cmd_config_show(args: argparse.Namespace) -> int:
    from megapkl.config import dump_config
    sys.stdout.write(dump_config(_load(args.file, args.overrides)))
    return 0


def split_files_and_overrides(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """`config validate A.yaml B.yaml objective.beta=0.3`: an item with '=' that is not an existing
    file is a dotted override, applied to every file (like on every other command)."""
    files, overrides = [], []
    for item in items:
        (overrides if "=" in item and not os.path.exists(item) else files).append(item)
    return files, overrides


def cmd_config_validate(args: argparse.Namespace) -> int:
    from megapkl.config import ConfigError
    files, overrides = split_files_and_overrides(args.files)
    overrides += args.set or []
    if not files:
        raise UsageError("config validate: no config file given (KEY=VALUE items are overrides)")
    bad = 0
    for path in files:
        try:
            cfg = _load(path, overrides, local=True)
        except ConfigError as exc:
            bad += 1
            print(f"megapkl: error: {_one_line(exc)}", file=sys.stderr)
            continue
        print(f"ok: {path} ({cfg.objective.name}, {cfg.rollout.protocol}, {cfg.model.name})")
    return EXIT_CONFIG if bad else 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from megapkl.config.reference import render

    text = render()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Validate the run config, then train on this machine (a process per GPU, or forked gloo
    ranks on a CPU machine, when DP/TP > 1)."""
    cfg = _load(args.config, args.overrides, local=True)
    from megapkl import runlog
    from megapkl.train.checkpointing import preflight
    from megapkl.train.local import claim_run_dir, train_local

    preflight(cfg.checkpoint, cfg.run_dir)  # a missing resume checkpoint or a busy run directory
    cfg = claim_run_dir(cfg, args.if_exists)  # a run already there: refuse, resume or delete it
    runlog.attach(cfg.run_dir)
    train_local(cfg)
    return 0


def demo_config_path(name: str = "cpu_demo") -> str:
    from megapkl.config import configs_dir
    return str(configs_dir() / "demo" / f"{name}.yaml")


def cmd_demo(args: argparse.Namespace) -> int:
    """The CPU demo (Proximal KL), or with --compare Proximal KL, GRPO and PG over seeds, or
    with --lookup the multi-turn demo (a tool call)."""
    if args.lookup and args.compare:
        raise UsageError("megapkl demo: --lookup and --compare are separate demos; pick one")
    path = demo_config_path("cpu_lookup" if args.lookup else "cpu_demo")
    _load(path, args.overrides)  # a bad override is a config error before anything starts
    from megapkl import runlog
    from megapkl.analysis.demo import run_demo

    runs = run_demo(path, args.overrides, args.compare, seeds=args.seeds,
                    name="cpu_lookup" if args.lookup else "cpu_demo_proximal_kl")
    runlog.attach(runs[0])  # what this process held (the ranks wrote theirs there already)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Every method x seed, then curves with bands and a report with paired intervals."""
    from megapkl.analysis.compare import Criteria, compare, headline

    cfg = _load(args.config, args.overrides)
    base = cfg.seed if args.seed_base is None else args.seed_base
    runner = None
    if args.profile:
        from megapkl.launch.cli import _wait
        from megapkl.launch.compare import slurm_runner

        runner = slurm_runner(args.profile, parallelism=args.parallelism,
                              wait=lambda jobs: _wait(jobs, quiet=True))
    crit = Criteria(metric=args.metric, ema_alpha=args.ema, threshold=args.threshold,
                    collapse_drop=args.collapse_drop)
    summary, report = compare(args.config, args.methods.split(","),
                              list(range(base, base + args.seeds)), args.overrides, out=args.out,
                              criteria=crit, runner=runner, analyze_only=args.analyze)
    print("\n".join(headline(summary)))
    print(f"report: {report}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """EMA-smoothed curves of one or several run directories into PNG files."""
    from megapkl.analysis.plot import plot_runs, run_ema_alpha

    alpha = args.ema if args.ema is not None else run_ema_alpha(args.runs[0])
    files = plot_runs(args.runs, args.out, alpha=alpha)
    print(f"wrote {len(files)} plots to {args.out}")
    return 0


def cmd_smoke(args: argparse.Namespace) -> int:
    """The run config on a tiny twin of its model, end to end on this machine (docs/experiments.md)."""
    from megapkl.launch.smoke import format_report, smoke

    report = smoke(args.config, args.overrides, out_dir=args.out, steps=args.steps, command=main)
    print(format_report(report))
    return 0 if report.ok else EXIT_ERROR


def cmd_serve(args: argparse.Namespace) -> int:
    """The embedded engine behind SGLang's HTTP API (its own options: `megapkl serve --help`)."""
    from megapkl.serve.serve import main as serve_main

    return serve_main(args.serve_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megapkl", description="Off-policy RL post-training "
                                     "of LLMs on megatron-core (Proximal KL, GRPO, SIS, TETPO, ...).")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error "
                        "and other libraries' warnings (otherwise in the run's megapkl.log; also "
                        "accepted anywhere on the line, or MEGAPKL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # KEY=VALUE overrides anywhere on a command's line (megapkl.launch.cli.add_overrides)
    from megapkl.config.overrides_cli import _IntermixedParser, add_overrides

    config = sub.add_parser("config", help="show, validate or list the keys of run configs")
    csub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the fully resolved config as YAML")
    show.add_argument("file", help="run config YAML")
    add_overrides(show, help="e.g. objective.beta=0.3")
    show.set_defaults(func=cmd_config_show)
    validate = csub.add_parser("validate", help="check configs; exit 2 if any is bad")
    validate.__class__ = _IntermixedParser  # --set may come first, files and KEY=VALUE after
    validate.add_argument("files", nargs="+", metavar="FILE|KEY=VALUE",
                          help="configs to check; KEY=VALUE items override every file")
    validate.add_argument("--set", action="append", metavar="KEY=VALUE",
                          help="override applied to every file (repeatable)")
    validate.set_defaults(func=cmd_config_validate)
    reference = csub.add_parser("reference", help="every section and key with its type, default, "
                                "range and meaning (Markdown; docs/config.md)")
    reference.add_argument("--out", help="write to this file instead of stdout")
    reference.set_defaults(func=cmd_config_reference)

    train = sub.add_parser("train", help="train from a run config")
    train.add_argument("config", help="run config YAML")
    add_overrides(train)
    train.add_argument("--if-exists", choices=("error", "resume", "overwrite"), default="error",
                       help="when the run directory already holds a run: refuse (default), "
                       "continue from its latest checkpoint, or delete it and start again")
    train.set_defaults(func=cmd_train)

    demo = sub.add_parser("demo", help="CPU demo: a tiny model learns a synthetic task")
    demo.add_argument("--compare", action="store_true",
                      help="Proximal KL, GRPO and PG over several seeds, with intervals")
    demo.add_argument("--seeds", type=int, default=3, help="seeds per method with --compare")
    demo.add_argument("--lookup", action="store_true",
                      help="the multi-turn demo: the model learns to call a tool (docs/agents.md)")
    add_overrides(demo)
    demo.set_defaults(func=cmd_demo)

    cmp = sub.add_parser("compare", help="methods x seeds with paired intervals and a report")
    cmp.add_argument("config", help="base run config YAML")
    cmp.add_argument("--methods", required=True,
                     help="comma-separated objective presets (configs/objectives/NAME.yaml or paths)")
    cmp.add_argument("--seeds", type=int, default=5, help="seeds per method (default 5, at least 2)")
    cmp.add_argument("--seed-base", type=int, default=None,
                     help="first seed (default: the config's seed); seeds are consecutive")
    cmp.add_argument("--out", default=None, help="output directory (default runs/<name>_compare)")
    cmp.add_argument("--profile", default=None, help="run on Slurm with this cluster profile")
    cmp.add_argument("--parallelism", type=int, default=None, help="Slurm array parallelism")
    cmp.add_argument("--analyze", action="store_true", help="only analyze finished runs")
    cmp.add_argument("--metric", default=None, help="primary metric (default: the in-training "
                     "evaluation eval/micro_avg/accuracy when the runs log it, else train/accuracy)")
    cmp.add_argument("--threshold", type=float, default=0.9, help="for updates-to-threshold")
    cmp.add_argument("--ema", type=float, default=0.2, help="EMA alpha of curves (default 0.2)")
    cmp.add_argument("--collapse-drop", type=float, default=0.2,
                     help="a fall this far below the running best counts as a collapse")
    add_overrides(cmp)
    cmp.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="EMA-smoothed curves of run directories into PNGs")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", default="plots", help="output directory (default: plots)")
    plot.add_argument("--ema", type=float, default=None,
                      help="EMA alpha (default: the first run's logging.ema_alpha, else 0.1)")
    plot.set_defaults(func=cmd_plot)

    smoke = sub.add_parser("smoke", help="the run config end to end on a tiny twin of its model, "
                           "on this machine: train, eval, plot (before submitting it)")
    smoke.add_argument("config", help="run config YAML")
    smoke.add_argument("--out", default=None, help="smoke directory (default: runs/smoke/<name>)")
    smoke.add_argument("--steps", type=int, default=4, help="updates to run (default 4)")
    add_overrides(smoke)
    smoke.set_defaults(func=cmd_smoke)

    from megapkl.analysis.diagnose import add_subcommand as add_diagnose  # diagnose ...

    add_diagnose(sub)

    # Its options are parsed by megapkl.serve.serve (prefix "+" passes every "--x" through), so
    # building this parser never imports torch.
    serve = sub.add_parser("serve", add_help=False, prefix_chars="+", help="the embedded engine "
                           "behind SGLang's HTTP API (not SGLang; docs/serve.md)")
    serve.add_argument("serve_args", nargs="*")
    serve.set_defaults(func=cmd_serve)

    from megapkl.launch.cli import add_subcommands  # submit, sweep, status, cancel, logs

    add_subcommands(sub)
    from megapkl.data.cli import add_subcommands as add_data  # data prepare, data list
    from megapkl.analysis.eval_cli import add_subcommands as add_eval  # eval

    from megapkl.retriever.cli import add_subcommands as add_retriever  # retriever index|serve

    add_data(sub)
    add_eval(sub)
    add_retriever(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def describe(exc: BaseException) -> str:
    """One line for any exception. A forked rank's error carries the rank's traceback: keep its
    last line (the exception itself). Errors that are not megapkl's own name their type."""
    text = str(exc)
    if "Traceback (most recent call last)" in text:
        head = text.split("\n", 1)[0].rstrip(":")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = f"{head}: {lines[-1]}"
    line = " ".join(text.split()) or type(exc).__name__
    if not type(exc).__module__.startswith("megapkl") and not isinstance(exc, (OSError, ValueError)):
        line = f"{type(exc).__name__}: {line}"
    return line


def _exit_code(exc: BaseException) -> int:
    from megapkl.config import ConfigError
    return EXIT_CONFIG if isinstance(exc, (ConfigError, UsageError)) else EXIT_ERROR


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `megapkl` console script; returns the exit code.

    The single error boundary of the CLI: whatever a command raises ends as one line
    `megapkl: error: ...` on stderr (exit 2 for config/usage errors, 1 otherwise, 130 on Ctrl-C);
    `--debug` (anywhere on the line) or MEGAPKL_DEBUG=1 prints the traceback as well.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MEGAPKL_DEBUG", "") not in ("", "0")
    if not debug:  # other libraries' warnings: into the run's megapkl.log, not the terminal
        from megapkl import runlog

        runlog.quiet()
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        print("megapkl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one boundary between megapkl and the terminal
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"megapkl: error: {describe(exc)}" + ("" if _exit_code(exc) == EXIT_CONFIG else hint),
              file=sys.stderr)
        return _exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
