"""KEY=VALUE overrides on a command line: the one argparse shape every megapkl command uses
(train, eval, diagnose, plan, submit, ...), so that overrides may come before, between or after
the options."""
from __future__ import annotations

import argparse
from typing import Any


class _IntermixedParser(argparse.ArgumentParser):
    """Lets KEY=VALUE overrides follow options (`submit CONFIG --profile P seed=1`): plain
    argparse stops filling a positional list at the first option."""

    _inner = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inner:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_overrides(parser: argparse.ArgumentParser, help: str = "run config overrides") -> None:
    """The KEY=VALUE positional of a command, accepted anywhere on its line (before, between or
    after the options): every command that takes overrides registers them through here."""
    parser.__class__ = _IntermixedParser
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=help)
