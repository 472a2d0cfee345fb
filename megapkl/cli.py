"""`megapkl` command line.

    megapkl config show FILE [KEY=VALUE ...]     print the fully resolved config (YAML)
    megapkl config validate FILE [FILE ...]      check configs, one line per file
    megapkl train CONFIG [KEY=VALUE ...]         train (validates the config first)
    megapkl demo [--compare] [KEY=VALUE ...]     the CPU demo (configs/demo/cpu_demo.yaml)
    megapkl plot RUN_DIR... [--out DIR]          EMA-smoothed curves into PNG files
    megapkl compare CONFIG --methods A,B --seeds N   methods x seeds, intervals and a report

A bad config is one line on stderr naming the file, line and dotted key, and exit code 2. Imports
are lazy: `config show` never imports torch. `cmd_train` and `cmd_demo` are the seams where the
trainer plugs in.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

EXIT_CONFIG = 2  # bad config or bad usage (argparse uses 2 as well)


def _load(path: str, overrides: Sequence[str] = ()):
    from megapkl.config import load_config
    return load_config(path, list(overrides))


def cmd_config_show(args: argparse.Namespace) -> int:
    from megapkl.config import dump_config
    sys.stdout.write(dump_config(_load(args.file, args.overrides)))
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from megapkl.config import ConfigError
    bad = 0
    for path in args.files:
        try:
            cfg = _load(path, args.set or ())
        except ConfigError as exc:
            bad += 1
            print(f"megapkl: error: {_one_line(exc)}", file=sys.stderr)
            continue
        print(f"ok: {path} ({cfg.objective.name}, {cfg.rollout.protocol}, {cfg.model.name})")
    return EXIT_CONFIG if bad else 0


def cmd_train(args: argparse.Namespace) -> int:
    """Validate the run config, then train on this machine (forked gloo ranks when DP/TP > 1)."""
    cfg = _load(args.config, args.overrides)
    from megapkl.train.local import train_local

    train_local(cfg)
    return 0


def demo_config_path() -> str:
    from megapkl.config import configs_dir
    return str(configs_dir() / "demo" / "cpu_demo.yaml")


def cmd_demo(args: argparse.Namespace) -> int:
    """The CPU demo (Proximal KL), or with --compare Proximal KL, GRPO and PG over seeds."""
    path = demo_config_path()
    _load(path, args.overrides)  # a bad override is a config error before anything starts
    from megapkl.train.demo import run_demo

    run_demo(path, args.overrides, args.compare, seeds=args.seeds)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Every method x seed, then curves with bootstrap bands and a report with intervals."""
    from megapkl.train.compare import Criteria, compare, headline

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
    from megapkl.train.plot import plot_runs

    files = plot_runs(args.runs, args.out, alpha=args.ema)
    print(f"wrote {len(files)} plots to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megapkl", description="Off-policy RL post-training "
                                     "of LLMs on megatron-core (Proximal KL, GRPO, SIS, TETPO, ...).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = sub.add_parser("config", help="show or validate run configs")
    csub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the fully resolved config as YAML")
    show.add_argument("file", help="run config YAML")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. objective.beta=0.3")
    show.set_defaults(func=cmd_config_show)
    validate = csub.add_parser("validate", help="check configs; exit 2 if any is bad")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--set", action="append", metavar="KEY=VALUE",
                          help="override applied to every file (repeatable)")
    validate.set_defaults(func=cmd_config_validate)

    train = sub.add_parser("train", help="train from a run config")
    train.add_argument("config", help="run config YAML")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    train.set_defaults(func=cmd_train)

    demo = sub.add_parser("demo", help="CPU demo: a tiny model learns a synthetic task")
    demo.add_argument("--compare", action="store_true",
                      help="Proximal KL, GRPO and PG over several seeds, with intervals")
    demo.add_argument("--seeds", type=int, default=3, help="seeds per method with --compare")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    demo.set_defaults(func=cmd_demo)

    from megapkl.launch.cli import _IntermixedParser

    cmp = sub.add_parser("compare", help="methods x seeds with bootstrap intervals and a report")
    cmp.__class__ = _IntermixedParser  # KEY=VALUE overrides may follow the options
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
    cmp.add_argument("--metric", default="train/accuracy", help="metric to compare")
    cmp.add_argument("--threshold", type=float, default=0.9, help="for updates-to-threshold")
    cmp.add_argument("--ema", type=float, default=0.2, help="EMA alpha of curves (default 0.2)")
    cmp.add_argument("--collapse-drop", type=float, default=0.2,
                     help="a fall this far below the running best counts as a collapse")
    cmp.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    cmp.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="EMA-smoothed curves of run directories into PNGs")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", default="plots", help="output directory (default: plots)")
    plot.add_argument("--ema", type=float, default=0.1, help="EMA alpha (default 0.1)")
    plot.set_defaults(func=cmd_plot)

    from megapkl.launch.cli import add_subcommands  # submit, sweep, status, cancel, logs

    add_subcommands(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `megapkl` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    from megapkl.config import ConfigError
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        print(f"megapkl: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
