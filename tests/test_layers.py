"""Imports flow one way between megapkl's packages: a package imports only packages of a lower
layer (function-level imports included), so there is no cycle, lazy or not.

    errors, runlog <- config, data <- objectives <- parallel <- models <- rollout <- serve, eval,
    envs, retriever <- train <- analysis, launch <- cli

The retrieval service (retriever) runs as its own command: only the CLI imports it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megapkl"
LAYER = {"errors": 0, "runlog": 0, "config": 1, "data": 1, "objectives": 2, "parallel": 3,
         "models": 4, "rollout": 5, "serve": 6, "eval": 6, "envs": 6, "retriever": 6, "train": 7,
         "analysis": 8,
         "launch": 8, "cli": 9}


def imported(tree: ast.AST) -> set[str]:
    """The megapkl top-level packages a module's syntax tree imports (anywhere in it)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "megapkl" else \
                [f"megapkl.{a.name}" for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("megapkl.")}
    return out


def edges() -> list[tuple[str, str, str]]:
    """(importing package, imported package, file) for every import across packages."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue
        pkg = rel.parts[0].removesuffix(".py")
        for tgt in imported(ast.parse(path.read_text(), str(path))) - {pkg}:
            found.append((pkg, tgt, rel.as_posix()))
    return found


def test_every_package_has_a_layer():
    names = {p.name.removesuffix(".py") for p in PKG.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or
             (p.suffix == ".py" and p.name != "__init__.py")}
    assert names == set(LAYER), f"packages without a layer: {sorted(names - set(LAYER))}"


def test_imports_flow_one_way():
    bad = [f"megapkl/{f}: {a} imports {b}" for a, b, f in edges() if LAYER[b] >= LAYER[a]]
    assert not bad, "imports against the layers (" + __doc__.split("\n\n")[1].strip() + "):\n" + \
        "\n".join(bad)


def test_only_the_cli_imports_the_retriever_service():
    bad = [f"megapkl/{f}" for a, b, f in edges() if b == "retriever" and a != "cli"]
    assert not bad, f"the retrieval service is imported by training code: {bad}"


def test_the_check_sees_function_level_imports():
    tree = ast.parse("def f():\n    from megapkl.train.loop import run\n    import megapkl.cli\n"
                     "    from megapkl import models\n")
    assert imported(tree) == {"train", "cli", "models"}
