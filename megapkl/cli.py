"""`megapkl` command line.

    megapkl config show FILE [KEY=VALUE ...]     print the fully resolved config (YAML)
    megapkl config validate FILE [FILE ...]      check configs, one line per file
    megapkl train CONFIG [KEY=VALUE ...]         train (validates the config first)
    megapkl demo [--compare] [KEY=VALUE ...]     the CPU demo (configs/demo/cpu_demo.yaml)

A bad config is one line on stderr naming the file, line and dotted key, and exit code 2. Imports
are lazy: `config show` never imports torch. `cmd_train` and `cmd_demo` are the seams where the
trainer plugs in.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

EXIT_CONFIG = 2  # bad config or bad usage (argparse uses 2 as well)
EXIT_NOT_BUILT = 3  # the command exists but its machinery does not yet
NOT_BUILT = "megapkl: the trainer is not built yet (see issue: RL trainer)"
# The GRPO arm of `demo --compare` (PKL Table 4: reference refresh 32, clip 0.2).
DEMO_COMPARE_OVERRIDES = ("objective.name=grpo", "name=cpu_demo_grpo")


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
    """Validate the run config, then train. Placeholder until the trainer lands."""
    _load(args.config, args.overrides)
    print(NOT_BUILT, file=sys.stderr)
    return EXIT_NOT_BUILT


def demo_config_path() -> str:
    from megapkl.config import configs_dir
    return str(configs_dir() / "demo" / "cpu_demo.yaml")


def cmd_demo(args: argparse.Namespace) -> int:
    """Validate the CPU demo config (and its GRPO twin with --compare), then run it. Placeholder."""
    path = demo_config_path()
    _load(path, args.overrides)
    if args.compare:
        _load(path, [*args.overrides, *DEMO_COMPARE_OVERRIDES])
    print(NOT_BUILT, file=sys.stderr)
    return EXIT_NOT_BUILT


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
    demo.add_argument("--compare", action="store_true", help="also run GRPO on the same task")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    demo.set_defaults(func=cmd_demo)

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
