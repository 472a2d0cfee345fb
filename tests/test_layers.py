"""Imports flow one way between megapkl's packages: a package imports only packages of a lower
layer, and no two modules import each other, directly or around a loop. Both rules read every
import statement, function-level ones included: an import put inside a function still runs.

    errors, runlog <- config, data <- objectives <- parallel <- models <- rollout <- envs
    <- serve, eval, retriever <- train <- analysis, launch <- cli

`envs` (multi-turn environments) sits between the rollout and the trainer; `retriever` (a search
service beside `serve`) is imported by no training code: only the commands that start it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megapkl"
LAYER = {"errors": 0, "runlog": 0, "config": 1, "data": 1, "objectives": 2, "parallel": 3,
         "models": 4, "rollout": 5, "envs": 6, "serve": 7, "eval": 7, "retriever": 7,
         "train": 8, "analysis": 9, "launch": 9, "cli": 10}
# Services: which packages may import them (everything else talks to them over their API)
ONLY_FROM = {"retriever": {"launch", "cli"}}


def module_name(path: Path) -> str:
    parts = ("megapkl",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(tree: ast.AST, here: str, is_package: bool = False) -> set[str]:
    """The megapkl modules a module's syntax tree imports (anywhere in it): `from P import name`
    counts as P.name where that is a module, else as P."""
    package = here if is_package else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for name in targets:
            while name and name not in MODULES:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name.startswith("megapkl") and name != here:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    return {m: imports(ast.parse(p.read_text(), str(p)), m, p.name == "__init__.py")
            for m, p in MODULES.items()}


def package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_package_has_a_layer():
    names = {p.name.removesuffix(".py") for p in PKG.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or
             (p.suffix == ".py" and p.name != "__init__.py")}
    assert names <= set(LAYER), f"packages without a layer: {sorted(names - set(LAYER))}"


def test_imports_flow_one_way():
    bad = [f"{MODULES[m].relative_to(PKG.parent)}: {package(m)} imports {package(t)}"
           for m, targets in graph().items() if package(m) for t in targets
           if package(t) and package(t) != package(m)
           and (LAYER[package(t)] >= LAYER[package(m)]
                or package(m) not in ONLY_FROM.get(package(t), {package(m)}))]
    assert not bad, "imports against the layers (" + __doc__.split("\n\n")[1].strip() + "):\n" + \
        "\n".join(bad)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "modules that import each other (move the shared code to a lower " \
        "module; an import inside a function still counts):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_see_function_level_imports_and_cycles():
    tree = ast.parse("def f():\n    from megapkl.train.loop import Trainer\n    import megapkl.cli\n"
                     "    from megapkl import models\n    from . import layout\n")
    assert imports(tree, "megapkl.config.run") == {
        "megapkl.train.loop", "megapkl.cli", "megapkl.models", "megapkl.config.layout"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
