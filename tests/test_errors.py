"""One exception hierarchy: every error class megapkl defines derives from
`megapkl.errors.MegapklError`, and no two share a name (`except X` always means one class)."""
from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

from megapkl.errors import MegapklError

PACKAGE = Path(__file__).resolve().parents[1] / "megapkl"
# Classes that travel as exceptions to steer control flow, not to report an error.
CONTROL_FLOW = {
    "megapkl.launch.runtime.Requeued": "a BaseException that unwinds a requeued Slurm task",
    "megapkl.serve.serve_state._Interrupted": "ends a stand-in server's generation early",
    "megapkl.serve.serve_protocol._Reply": "carries an HTTP answer out of a request handler",
}


def exception_classes() -> list[tuple[str, type]]:
    """(module.Class, class) of every class defined in the package that is an exception."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
        if not names:
            continue
        mod = importlib.import_module(module)
        for name in names:
            cls = getattr(mod, name)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                out.append((f"{module}.{name}", cls))
    return out


def test_every_error_derives_from_the_common_base_and_names_are_unique():
    classes = exception_classes()
    assert len(classes) >= 25  # the walk finds them (config, rollout, train, launch, serve ...)
    stray = [q for q, cls in classes if not issubclass(cls, MegapklError) and q not in CONTROL_FLOW]
    assert not stray, f"errors without the MegapklError base: {stray}"
    by_name = defaultdict(list)
    for qual, _ in classes:
        by_name[qual.rsplit(".", 1)[1]].append(qual)
    repeated = {n: q for n, q in by_name.items() if len(q) > 1}
    assert not repeated, f"exception classes sharing a name: {repeated}"
