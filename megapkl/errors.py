"""The common base of the errors megapkl raises on purpose.

Every error class of the package derives from `MegapklError` (and, where callers already catch a
builtin kind, from that too: `ConfigError` is also a ValueError). `except MegapklError` therefore
tells megapkl's own, explained failures (whose message is the one line a user needs) from bugs
and third-party exceptions. This module imports nothing, so any layer can use it.
"""
from __future__ import annotations


class MegapklError(Exception):
    """A failure megapkl explains in its message (which names the key, file or rank)."""
