"""Device discipline, checked without a GPU: every tensor handed to a torch.distributed collective
must live on the group's device (NCCL: this process's GPU). On CPU (gloo) a tensor made without
`device=` works, so the tests of this repository cannot see the mistake; on a GPU cluster it is
`No backend type associated with device type cpu` at the first collective.

The rule, checked on the source of `megapkl/` (AST): inside a function that calls a collective, a
tensor factory call (torch.tensor, zeros, ones, empty, full, arange, rand*, eye, linspace, ...)
must pass `device=` or be moved at once (`torch.zeros(n).to(dev)`, `.cuda()`). A factory of the
`_like` / `new_*` kind takes the device of its argument, which is checked where that argument was
made, so it is not flagged.

Collectives are torch.distributed's tensor collectives, megatron-core's tensor-parallel mappings
and the functions of `megapkl/` that themselves call a collective on a tensor they are handed
(found by the same walk, one level deep). A factory call the rule flags but that is right must
be in ALLOWED with the reason it never reaches an NCCL group.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1] / "megapkl"

DIST_COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
    "all_to_all", "all_to_all_single", "batch_isend_irecv", "P2POp", "_all_gather_base",
    "_reduce_scatter_base"})
MEGATRON_COLLECTIVES = frozenset({
    "reduce_from_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region", "all_to_all"})
FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand",
                       "randn", "randint", "randperm", "eye", "linspace", "logspace",
                       "empty_strided"})
MOVES = frozenset({"to", "cuda"})

# (file relative to megapkl/, function, factory) -> why the flagged tensor never crosses NCCL.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("launch/toy.py", "run", "tensor"):
        "the toy's parameter x stays on the host; only its gradient crosses the group",
    ("launch/toy.py", "run", "randn"):
        "drawn on the host from a CPU generator (the same numbers on any machine), then moved "
        "to ctx.device before the all_reduce",
    ("parallel/vocab.py", "_global_sums", "zeros"):
        "a 0-dim scalar operand of torch.where: the result takes the device of the other "
        "operands (the logits' device)",
    ("train/mismatch.py", "_routing", "tensor"):
        "response uids are matched against the batch on its own device (counted_rows moves "
        "them); they are never sent",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_dist_call(call: ast.Call) -> bool:
    name = _dotted(call.func)
    head, _, last = name.rpartition(".")
    return last in DIST_COLLECTIVES and (head.endswith("dist") or head.endswith("distributed"))


def _callee(call: ast.Call) -> str:
    return _dotted(call.func).rpartition(".")[2]


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `fn`'s body, nested functions and lambdas excluded (they are walked alone)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _sources() -> list[tuple[str, ast.AST]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), filename=str(p)))
            for p in sorted(ROOT.rglob("*.py"))]


def wrapper_names(sources) -> set[str]:
    """megapkl functions that call a torch.distributed collective on one of their parameters."""
    names = set()
    for _, tree in sources:
        for fn in _functions(tree):
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            for node in _own_nodes(fn):
                if isinstance(node, ast.Call) and _is_dist_call(node):
                    used = {n.id for a in node.args for n in ast.walk(a) if isinstance(n, ast.Name)}
                    if used & params:
                        names.add(fn.name)
    return names


def _moved(call: ast.Call, parents: dict) -> bool:
    up = parents.get(call)
    return (isinstance(up, ast.Attribute) and up.attr in MOVES
            and isinstance(parents.get(up), ast.Call))


def violations(sources=None) -> list[tuple[str, str, str, int]]:
    """(file, function, factory, line) of every factory call without a device in a function
    that calls a collective."""
    sources = sources if sources is not None else _sources()
    collectives = MEGATRON_COLLECTIVES | wrapper_names(sources)
    found = []
    for rel, tree in sources:
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for fn in _functions(tree):
            calls = [n for n in _own_nodes(fn) if isinstance(n, ast.Call)]
            if not any(_is_dist_call(c) or _callee(c) in collectives for c in calls):
                continue
            for c in calls:
                name = _dotted(c.func)
                if not (name.startswith("torch.") and name.count(".") == 1
                        and _callee(c) in FACTORIES):
                    continue
                if any(k.arg == "device" for k in c.keywords) or _moved(c, parents):
                    continue
                found.append((rel, fn.name, _callee(c), c.lineno))
    return found


def test_no_collective_gets_a_tensor_made_without_a_device():
    bad = [v for v in violations() if v[:3] not in ALLOWED]
    assert not bad, "tensor factories without device= in functions that call a collective " \
        "(NCCL needs the group's device; pass device= or add a justified ALLOWED entry):\n" + \
        "\n".join(f"  megapkl/{f}:{line} {fn}(): torch.{fac}(...)" for f, fn, fac, line in bad)


def test_every_allowlist_entry_is_still_needed():
    found = {v[:3] for v in violations()}
    stale = [k for k in ALLOWED if k not in found]
    assert not stale, f"ALLOWED entries that no longer match a flagged call: {stale}"


def _flags(src: str) -> list[tuple[str, str, int]]:
    return [(fn, fac, line) for _, fn, fac, line in violations([("x.py", ast.parse(src))])]


def test_the_rule_on_small_cases():
    """What is flagged and what is not, on the shapes the real defects took."""
    assert _flags(
        "def all_ok(ok):\n"
        "    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)\n"
        "    dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n") == [("all_ok", "tensor", 2)]
    assert _flags(  # a buffer broadcast into over a pipeline group
        "def export(pp):\n"
        "    t = torch.empty(shape, dtype=d)\n"
        "    torch.distributed.broadcast(t, src=0, group=pp)\n") == [("export", "empty", 2)]
    assert _flags(  # device given, moved at once, or a _like of a checked tensor: fine
        "def ok(g):\n"
        "    a = torch.zeros(3, device=dev)\n"
        "    b = torch.tensor([1]).to(dev)\n"
        "    c = torch.zeros_like(a)\n"
        "    dist.all_reduce(a, group=g)\n") == []
    assert _flags(  # no collective in the function: not this rule's business
        "def local():\n"
        "    return torch.tensor([1.0])\n") == []
    assert _flags(  # a megapkl wrapper of a collective counts as one
        "def _all_gather(t, group):\n"
        "    dist.all_gather(out, t, group=group)\n"
        "def user(g):\n"
        "    _all_gather(torch.ones(2), g)\n") == [("user", "ones", 4)]


# A thread starts on CUDA device 0 whatever its starter uses: every thread megapkl starts goes
# through megapkl/parallel/threads.py (start_thread, rank_executor), which set the starter's
# device first (tests/train/test_thread_devices.py runs that on the real components).
THREAD_MAKERS = frozenset({"Thread", "ThreadPoolExecutor", "Timer"})
THREAD_HOME = "parallel/threads.py"


def thread_starts(sources=None) -> list[tuple[str, int, str]]:
    """(file, line, call) of every thread made outside the rank-device helpers."""
    sources = sources if sources is not None else _sources()
    found = []
    for rel, tree in sources:
        if rel == THREAD_HOME:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) in THREAD_MAKERS:
                found.append((rel, node.lineno, _dotted(node.func)))
    return sorted(found)


def test_every_thread_megapkl_starts_sets_the_ranks_device_first():
    bad = thread_starts()
    assert not bad, "threads started without the rank's CUDA device (use " \
        "megapkl.parallel.threads.start_thread / rank_executor):\n" + \
        "\n".join(f"  megapkl/{f}:{line} {call}(...)" for f, line, call in bad)
    assert thread_starts([("x.py", ast.parse(
        "import threading\nthreading.Thread(target=f).start()\n"
        "with ThreadPoolExecutor(2) as pool: pass\n"))]) == [
        ("x.py", 2, "threading.Thread"), ("x.py", 3, "ThreadPoolExecutor")]
