"""A config field that nothing reads is a defect: every field of the run config's dataclasses must
be read by code outside `megapkl/config/` (where fields are only defined, validated and resolved).

"Read" is found in the syntax tree, not in the text (a field's name in a string, a docstring or a
comment is not a read, and neither is another section's field of the same name): an attribute
access `x.<field>` counts for a section when `x` holds that section. What holds a section is
followed through the code: `cfg` is the run config, `cfg.rollout` its rollout section, a name
assigned a section holds it (`r = cfg.rollout`, `self.cfg = cfg`), and so does the parameter of
a package function that some call passes a section to (`build_reward(cfg.reward)` ->
`build_reward(reward_cfg, ...)`), until nothing changes. `getattr(x, "field")` counts too.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from collections import defaultdict
from pathlib import Path

from megapkl.config.run import RunConfig

PACKAGE = Path(__file__).resolve().parents[1] / "megapkl"

# Fields nothing needs to read, each with its reason.
NOT_READ = {
    "description": "free text for people, kept in the run's resolved config.yaml",
    "objective.sis.top_k": "resolved into rollout.topk_logprobs (the K the engines record)",
}
# Sections read field by field through a table of their field names: the table's keys (a dict
# literal at module level) are reads of that section.
READ_BY_NAME = {("launch/shape.py", "_SLURM_TO_PROFILE"): "slurm"}


def sections(cls=RunConfig, prefix: str = "") -> dict[str, dict[str, str | None]]:
    """{section path: {field: subsection path or None}}; '' is the run config itself."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dict[str, str | None]] = {prefix: {}}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        path = f"{prefix}.{f.name}" if prefix else f.name
        if nested and typing.get_origin(tp) is not list:
            out[prefix][f.name] = path
            out.update(sections(nested[0], path))
        else:
            out[prefix][f.name] = None
    return out


SECTIONS = sections()
LEAVES = {f"{p}.{f}" if p else f for p, fs in SECTIONS.items() for f, sub in fs.items() if sub is None}


class _Flow:
    """Which names hold which sections, and which fields are read (see the module docstring).
    A holder is a section path ('' the run config, 'rollout', 'rollout.sglang', ...) or an
    instance '@module:Class' of a package class (its attributes are followed per class)."""

    def __init__(self, modules: dict[str, ast.Module]) -> None:
        self.modules = modules
        self.held: dict[tuple[str, str], set[str]] = defaultdict(set)  # (scope, name) -> holders
        self.reads: set[str] = set()
        self.defs: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)  # name -> scopes
        self.classes: dict[str, str] = {}  # class name -> '@module:Class'
        self._annotated: dict[str, list[ast.arg]] = {}
        for mod, tree in modules.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name] = f"@{mod}:{node.name}"
                    fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                              and isinstance(s.target, ast.Name)]
                    if fields:  # a dataclass: its constructor sets the instance's fields
                        self.defs[node.name].append((f"@{mod}:{node.name}", ["self", *fields]))
            for scope, fn, cls in self._functions(mod, tree):
                a = fn.args
                params = a.posonlyargs + a.args + a.kwonlyargs
                names = [x.arg for x in params]
                self.defs[fn.name].append((scope, names))
                if fn.name == "__init__":  # calling the class calls it
                    self.defs[cls].append((scope, names))
                self._annotated[scope] = params

        for scope, params in self._annotated.items():  # `x: RolloutConfig`, `s: Stats`
            for x in params:
                ann = x.annotation
                name = ann.id if isinstance(ann, ast.Name) else \
                    ann.value if isinstance(ann, ast.Constant) else None
                self.held[(scope, x.arg)] |= CLASS_SECTIONS.get(name, set())
                if name in self.classes:
                    self.held[(scope, x.arg)].add(self.classes[name])

    @staticmethod
    def _functions(mod: str, tree: ast.Module):
        """(scope, function node, class name or '') of every function, methods included."""
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield f"{mod}:{node.name}.{item.name}", item, node.name
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{mod}:{node.name}", node, ""

    def paths(self, e: ast.AST, scope: str, cls: str) -> set[str]:
        """The holders expression `e` evaluates to (recording the reads it makes)."""
        if isinstance(e, ast.Name):
            if e.id == "self" and cls:
                return {cls}
            return self.held[(scope, e.id)] | ({""} if e.id == "cfg" else set())
        if isinstance(e, ast.Attribute):
            got = self.member(self.paths(e.value, scope, cls), e.attr)
            # `<anything>.cfg` of an object the flow does not know: the run config by convention
            return got or ({""} if e.attr == "cfg" else set())
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Name) and f.id == "getattr" and len(e.args) >= 2:
                held = self.paths(e.args[0], scope, cls)
                return set().union(set(), *(self.member(held, k)
                                            for k in self._strings(e.args[1], scope)))
            if isinstance(f, ast.Name) and f.id in self.classes:
                return {self.classes[f.id]}
            if isinstance(f, ast.Attribute) and f.attr == "get" and e.args and \
                    isinstance(e.args[0], ast.Constant) and isinstance(e.args[0].value, str):
                return self.key(self.paths(f.value, scope, cls), e.args[0].value)
            if isinstance(f, ast.Attribute):  # a method of a section reads what it reads
                self.paths(f, scope, cls)
            return set()
        if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant) and \
                isinstance(e.slice.value, str):
            return self.key(self.paths(e.value, scope, cls), e.slice.value)
        if isinstance(e, ast.IfExp):
            return self.paths(e.body, scope, cls) | self.paths(e.orelse, scope, cls)
        if isinstance(e, ast.BoolOp):
            return set().union(*(self.paths(v, scope, cls) for v in e.values))
        return set()

    def key(self, holders: set[str], name: str) -> set[str]:
        """`x["name"]` / `x.get("name")`: a resolved config read back as a mapping."""
        return self.member(holders or ({""} if name in SECTIONS[""] else set()), name)

    def _strings(self, e: ast.AST, scope: str) -> list[str]:
        """The constant strings `e` may be: a constant, or a loop variable over constants."""
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [e.value]
        if isinstance(e, ast.Name):
            return [s for s in self.loops.get((scope, e.id), ())]
        return []

    def member(self, holders: set[str], name: str) -> set[str]:
        out = set()
        for p in holders:
            if p.startswith("@"):
                out |= self.held[(p, name)]
                continue
            fields = SECTIONS.get(p, {})
            if name in fields:
                self.reads.add(f"{p}.{name}" if p else name)
                if fields[name] is not None:
                    out.add(fields[name])
            else:
                for f in METHOD_READS.get((p, name), ()):
                    self.reads.add(f"{p}.{f}" if p else f)
        return out

    def bind(self, key: tuple[str, str], paths: set[str]) -> bool:
        new = paths - self.held[key]
        self.held[key] |= new
        return bool(new)

    def sweep(self) -> bool:
        """One pass over every function; True if a binding changed."""
        changed = False
        self.loops: dict[tuple[str, str], list[str]] = {}
        for mod, tree in self.modules.items():
            for scope, fn, cls_name in self._functions(mod, tree):
                cls = f"@{mod}:{cls_name}" if cls_name else ""
                for node in ast.walk(fn):
                    if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                            isinstance(node.iter, (ast.Tuple, ast.List)):
                        self.loops[(scope, node.target.id)] = [
                            c.value for c in node.iter.elts
                            if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                for node in ast.walk(fn):
                    changed |= self._node(node, scope, cls)
        return changed

    def _node(self, node: ast.AST, scope: str, cls: str) -> bool:
        changed = False
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                pairs = [(t, node.value)]
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(t.elts, node.value.elts))
                for target, value in pairs:
                    got = self.paths(value, scope, cls)
                    if isinstance(target, ast.Name):
                        changed |= self.bind((scope, target.id), got)
                    elif isinstance(target, ast.Attribute):
                        for holder in self.paths(target.value, scope, cls):
                            if holder.startswith("@"):
                                changed |= self.bind((holder, target.attr), got)
        elif isinstance(node, ast.Call):
            self.paths(node, scope, cls)
            name = node.func.id if isinstance(node.func, ast.Name) else \
                node.func.attr if isinstance(node.func, ast.Attribute) else None
            for callee, params in self.defs.get(name or "", []):
                offset = 1 if params[:1] in (["self"], ["cls"]) else 0
                for i, arg in enumerate(node.args):
                    if i + offset < len(params):
                        changed |= self.bind((callee, params[i + offset]),
                                             self.paths(arg, scope, cls))
                for kw in node.keywords:
                    if kw.arg in params:
                        changed |= self.bind((callee, kw.arg), self.paths(kw.value, scope, cls))
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            self.paths(node, scope, cls)
        return changed


def _class_sections() -> dict[str, set[str]]:
    """{config class name: the section paths of that type} ('RolloutConfig': {'rollout'})."""
    out: dict[str, set[str]] = defaultdict(set)

    def walk(cls, prefix):
        out[cls.__name__].add(prefix)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            sub = SECTIONS[prefix].get(f.name)
            if sub is not None:
                tp = hints[f.name]
                walk([a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)][0],
                     sub)
    walk(RunConfig, "")
    return out


CLASS_SECTIONS = _class_sections()


def _method_reads() -> dict[tuple[str, str], set[str]]:
    """{(section path, method name): the section's fields the method reads as self.<field>}."""
    import inspect
    import textwrap

    out = {}
    hints_of = {}

    def walk(cls, prefix):
        hints_of[prefix] = cls
        for f in dataclasses.fields(cls):
            sub = SECTIONS[prefix].get(f.name)
            if sub is not None:
                tp = typing.get_type_hints(cls)[f.name]
                nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
                walk(nested[0], sub)
    walk(RunConfig, "")
    for path, cls in hints_of.items():
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("__"):
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            out[(path, name)] = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                 and isinstance(n.value, ast.Name) and n.value.id == "self"
                                 and n.attr in SECTIONS[path]}
    return out


METHOD_READS = _method_reads()


def fields_read(sources: dict[str, str]) -> set[str]:
    """The dotted config fields the code in `sources` ({module: text}) reads."""
    trees = {mod: ast.parse(text) for mod, text in sources.items()}
    flow = _Flow(trees)
    while flow.sweep():
        pass
    for (mod, table), section in READ_BY_NAME.items():
        for node in trees[mod].body if mod in trees else ():
            if isinstance(node, ast.Assign) and any(isinstance(x, ast.Name) and x.id == table
                                                    for x in node.targets):
                for k in node.value.keys:
                    flow.member({section}, k.value)
    return flow.reads


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")
            if p.relative_to(PACKAGE).parts[0] != "config"}


def test_every_config_field_is_read_outside_the_config_package() -> None:
    unread = sorted(LEAVES - fields_read(package_sources()) - set(NOT_READ))
    assert not unread, f"config fields nothing reads (wire them up or delete them): {unread}"


def test_the_check_sees_reads_not_names() -> None:
    """A field's name in a string, or another section's field of the same name, is not a read;
    a read through a section handed to a function is."""
    src = {"m.py": '''
def metrics_file(cfg):
    every = cfg.checkpoint.every           # not logging.every
    return "metrics.jsonl", "export_hf"    # names in strings: not reads

def wire(cfg):
    helper(cfg.logging, run=cfg)

def helper(section, run):
    sg = run.rollout.sglang
    return section.tensorboard, sg.bucket_mb, getattr(section, "ema_alpha")
'''}
    got = fields_read(src)
    assert {"checkpoint.every", "logging.tensorboard", "rollout.sglang.bucket_mb",
            "logging.ema_alpha"} <= got
    assert not {"logging.every", "logging.jsonl", "checkpoint.export_hf", "eval.every"} & got


def test_plot_smooths_with_the_runs_ema_alpha(tmp_path) -> None:
    """`logging.ema_alpha` is read back by `megapkl plot` from the run's resolved config."""
    import yaml

    from megapkl.analysis.plot import run_ema_alpha
    from megapkl.config import load_config
    from megapkl.config.typed import to_dict

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/base/controlled_staleness.yaml")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    assert run_ema_alpha(tmp_path) == cfg.logging.ema_alpha == 0.20
    assert run_ema_alpha(tmp_path / "missing") == 0.1
