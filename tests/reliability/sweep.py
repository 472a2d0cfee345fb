"""Fault injection at every call site: trace one short DP=2 run, then make each traced megapkl
function raise on one rank at update 2 and check what the exit leaves behind.

    sites, skipped = trace(run_forked, run_dir)        # every megapkl function called in update 2
    result = try_site(run_forked, site, tmp)          # one fresh run with that function failing

`trace` runs the tiny trainer (tests/reliability/conftest.py's config, train.steps=3, an
evaluation after every update, checkpoints after updates 2 and 3) on two forked gloo ranks with
`sys.settrace` (and `threading.settrace`, for the generation thread) on both ranks, counting the
calls of every function whose code lies under megapkl/, and where update 2 begins (the call of
`Schedule.plan(2)`). A site is a function called in update 2 (the rest of the run: its training,
evaluation, final checkpoint and closing) by name `module:Qualname`, with the index of its first
call in update 2, on rank 1 where rank 1 calls it, else on rank 0 (rank 0 alone writes the logs,
the evaluation's results and the checkpoint's manifest). Functions that `fail_at` cannot replace
are skipped, each with the reason: nested and anonymous functions (no name to patch), generators
(each resumption is a traced call: the call index would be wrong), properties, and code that its
name does not resolve to (a decorated function's inner code).

`try_site` runs the same config afresh with `fail_at(site, call=...)` raising
RuntimeError("injected fault") in that rank and checks: both ranks leave run() within
EXIT_WITHIN_S of the fault (the fault's mark file against each rank's exit time), with the same one
line naming the failing rank and the error, the finished updates in a checkpoint that verifies
(the one the line names, or where the failure was the save itself the newest one kept), no child
process or megapkl thread left, the run directory's lock free. A site whose fault never fired
(another path ran this time) is 'not reached'.

A fault inside collective work (the training step, a weight export) is told out of band
(megapkl.train.failure_notice): the line then names the newest checkpoint as intact ('kept'). The
ranks' process groups wait at most FAULT_TIMEOUT_S in a collective after the first update
(loop.STEP_TIMEOUT_MIN_S, 120 s in a real run, is lowered in the forked ranks), so a fault that
nothing tells costs that long, not two minutes; such an exit fails the 30 s bound anyway.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .conftest import tiny_cfg
from .exits import TORCH_SHM_MANAGER, checked_run, read_facts

EXIT_WITHIN_S = 30.0
FAULT_TIMEOUT_S = 31.0  # a collective's wait after the first update: just over EXIT_WITHIN_S
RUN_TIMEOUT_S = 150.0   # the whole forked run (startup included): a hang is killed then
UPDATE = 2
OVERRIDES = ["train.steps=3", "eval.every=1"]
ERROR = "injected fault"  # in the line (a CheckpointError keeps the message, not the type)
ROOT = str(Path(__file__).resolve().parents[2] / "megapkl")
ANONYMOUS = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<module>")
GENERATOR = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


@dataclasses.dataclass(frozen=True)
class Site:
    target: str  # 'module:Qualname', as fail_at takes it
    rank: int    # the rank that raises
    call: int    # the index (from 1) of its first call in update 2 on that rank
    thread: str = dataclasses.field(default="", compare=False)  # the thread of that call


@dataclasses.dataclass
class Result:
    site: Site
    outcome: str                  # 'pass', 'not reached' or 'fail: why'
    exit_s: Optional[float]       # the last rank's exit, seconds after the fault
    error: Optional[str] = None   # the one line the ranks stopped with
    checkpoint: str = ""          # 'named step_N', 'kept step_N' (the save itself failed)


def config(run_dir: Path, *extra: str):
    return tiny_cfg(run_dir, *OVERRIDES, *extra, data=2)


# ------------------------------------------------------------------ tracing


def _module(filename: str) -> str:
    rel = Path(filename).resolve().relative_to(Path(ROOT).parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


class _Tracer:
    """Calls per code object under megapkl/, and the call index of each one's first call in
    update UPDATE (a 'call' trace event; the first update is read from Schedule.plan's argument)."""

    def __init__(self) -> None:
        self.update = -1
        self.calls: dict[Any, int] = {}
        self.first: dict[Any, int] = {}
        self.thread: dict[Any, str] = {}
        self._mine: dict[Any, bool] = {}

    def __call__(self, frame, event, arg):  # noqa: ARG002 - the sys.settrace signature
        code = frame.f_code
        mine = self._mine.get(code)
        if mine is None:
            mine = self._mine[code] = code.co_filename.startswith(ROOT)
        if not mine or event != "call":
            return None
        n = self.calls[code] = self.calls.get(code, 0) + 1
        if code.co_qualname == "Schedule.plan":
            self.update = frame.f_locals.get("update", self.update)
        if self.update >= UPDATE and code not in self.first:
            self.first[code], self.thread[code] = n, threading.current_thread().name
        return None

    def start(self) -> None:
        threading.settrace(self)
        sys.settrace(self)

    def stop(self) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]

    def sites(self) -> dict[str, tuple[int, str, str]]:
        """'module:Qualname' -> (first call index in update 2, its thread, '' or why fail_at
        cannot use it)."""
        return {f"{_module(c.co_filename)}:{c.co_qualname}": (n, self.thread[c], _why_not(c))
                for c, n in self.first.items()}


def _why_not(code) -> str:
    """'' when fail_at can replace the function of `code` by its name, else the reason."""
    import inspect

    from megapkl.train.faults import _owner

    qual = code.co_qualname
    if "<locals>" in qual or qual in ANONYMOUS or qual.rsplit(".", 1)[-1] in ANONYMOUS:
        return "nested or anonymous"
    if code.co_flags & GENERATOR:
        return "generator"
    try:
        owner, name = _owner(f"{_module(code.co_filename)}:{qual}")
    except AttributeError:
        return "not reachable by its name"
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, property):
        return "property"
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if getattr(inspect.unwrap(func), "__code__", None) is not code:
        return "its name holds other code (decorated)"
    return ""


def _trace_rank(rank, world, cfgs):  # noqa: ARG001 - run_forked's signature
    from megapkl.train.loop import run

    tracer = _Tracer()
    tracer.start()
    try:
        run(cfgs[rank])
    finally:
        tracer.stop()
    return tracer.sites()


def trace(dist_run: Callable, run_dir: Path, *extra: str,
          per_rank: Sequence[Sequence[str]] = ((), ())) -> tuple[list[Site], dict[str, list]]:
    """The injectable sites of update 2 (rank 1's, then rank 0's own), and the skipped ones by
    reason (`per_rank`: each rank's own overrides)."""
    cfgs = [config(run_dir, *extra, *per_rank[r]) for r in range(2)]
    seen = dist_run(_trace_rank, 2, cfgs, timeout=RUN_TIMEOUT_S)
    sites, skipped = [], {}
    for rank in (1, 0):
        for target, (call, thread, why) in sorted(seen[rank].items()):
            if rank == 0 and target in seen[1]:
                continue
            if why:
                skipped.setdefault(why, []).append(target)
            else:
                sites.append(Site(target, rank, call, thread))
    return sites, skipped


# ------------------------------------------------------------------ one fault


def inject(site: Site, mark: Path) -> None:
    """fail_at on `site`, also where another megapkl module holds the function by its own name
    (`from x import f`), with one call count; a static or class method stays one."""
    import inspect

    from megapkl.train import loop
    from megapkl.train.faults import _owner, fail_at

    loop.STEP_TIMEOUT_MIN_S = FAULT_TIMEOUT_S
    owner, name = _owner(site.target)
    raw = inspect.getattr_static(owner, name)
    real = getattr(owner, name)
    fail_at(site.target, call=site.call, error=RuntimeError("injected fault"), mark=mark)
    faulty = getattr(owner, name)
    if isinstance(raw, (staticmethod, classmethod)):  # `real` is bound already (a class method)
        setattr(owner, name, staticmethod(faulty))
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("megapkl") and m]:
        for attr, value in list(vars(mod).items()):
            if value is real and mod is not owner:
                setattr(mod, attr, faulty)


def _fault_rank(rank, world, cfgs, marks, site):
    def patch(r):
        if r == site.rank:
            inject(site, marks / "fault")
    got = checked_run(rank, world, cfgs[rank], marks, patch)
    left = [t.name for t in threading.enumerate() if t.name.startswith("megapkl")]
    (marks / f"threads{rank}").write_text(" ".join(left))
    return got


def try_site(dist_run: Callable, site: Site, tmp: Path, *extra: str,
             per_rank: Sequence[Sequence[str]] = ((), ())) -> Result:
    """A fresh run with `site` failing (`per_rank`: each rank's own overrides); the checks of the
    module docstring."""
    from megapkl.parallel.forked import WorkerError

    marks, run_dir = tmp / "marks", tmp / "run"
    marks.mkdir(parents=True)
    cfgs = [config(run_dir, *extra, *per_rank[r]) for r in range(2)]
    try:
        dist_run(_fault_rank, 2, cfgs, marks, site, timeout=RUN_TIMEOUT_S)
    except WorkerError as exc:  # a rank overran the run's timeout, or the harness's last barrier
        return judge(site, marks, run_dir, killed=f"{type(exc).__name__}: "
                     + str(exc).strip().splitlines()[-1][:160])
    return judge(site, marks, run_dir)


def judge(site: Site, marks: Path, run_dir: Path, killed: str = "") -> Result:
    """The Result of a finished (or `killed`: why) run from what its ranks recorded."""
    facts = read_facts(marks)
    if sorted(facts) != [0, 1]:
        fault = marks / "fault"
        took = round(time.time() - float(fault.read_text()), 1) if fault.exists() else None
        stuck = sorted({0, 1} - set(facts))
        alone = f"; rank {site.rank} raised it alone" if facts.get(site.rank, {}).get("error") \
            == f"RuntimeError: {ERROR}" else ""
        return Result(site, f"fail: rank {stuck} never left run() (killed {took} s after the "
                      f"fault{alone}: {killed})", took,
                      next(iter(facts.values()), {}).get("error"))
    errors = {f["error"] for f in facts.values()}
    error = next(iter(errors)) if len(errors) == 1 else None
    if not (marks / "fault").exists():
        return Result(site, "not reached" if errors == {None} else
                      f"fail: an error without the fault: {errors}", None, error)
    fault = float((marks / "fault").read_text())
    took = round(max(f["exit"] - fault for f in facts.values()), 2)
    r = Result(site, "pass", took, error)
    r.outcome = _first_failure(site, facts, errors, took, run_dir, r) or "pass"
    return r


def _first_failure(site, facts, errors, took, run_dir, r: Result) -> Optional[str]:
    if errors == {None}:
        return "fail: absorbed (the run finished as if nothing failed)"
    alone = [rank for rank, f in sorted(facts.items()) if f["error"] == f"RuntimeError: {ERROR}"]
    if alone:
        return f"fail: not agreed (rank {alone[0]} raised it alone; the last rank out {took} s after)"
    if len(errors) > 1:
        return "fail: the ranks stopped with different errors: " + " | ".join(
            sorted(str(e) for e in errors))
    if ERROR not in r.error or f"rank {site.rank}" not in r.error:
        return f"fail: the line does not name rank {site.rank} and {ERROR!r}"
    if took >= EXIT_WITHIN_S:
        return f"fail: a rank left {took} s after the fault"
    r.checkpoint, why = _checkpointed(r.error, run_dir)
    if why:
        return f"fail: {why}"
    for rank, f in sorted(facts.items()):
        left = [c for c in f["children"] if Path(c.split()[1]).name != TORCH_SHM_MANAGER]
        if left:
            return f"fail: rank {rank} left processes {left}"
    if not facts[0]["lock_free"]:
        return "fail: the run directory is still locked"
    threads = {r: (run_dir.parent / "marks" / f"threads{r}").read_text() for r in facts}
    if any(threads.values()):
        return f"fail: megapkl threads left {threads}"
    return None


def _checkpointed(error: str, run_dir: Path) -> tuple[str, str]:  # noqa: ARG001
    """(which checkpoint holds the finished updates, '' or why that fails): the one the line
    names, or where the failure was the save itself, the previous one it says is intact."""
    from megapkl.train import checkpointing as ckpt

    named = re.search(r"checkpoint (\S+) holds the (\d+) finished updates", error)
    kept = re.search(r"the previous checkpoint (\S+) is intact", error)
    if not (named or kept):
        return "", "the line names no checkpoint of the finished updates"
    path = Path((named or kept).group(1))
    try:
        manifest = ckpt.verify(path)
    except Exception as exc:  # noqa: BLE001 - reported: the checkpoint does not verify
        return "", f"the checkpoint does not verify: {exc}"
    if int(manifest["step"]) < 1:
        return "", f"{path} holds no finished update"
    return f"{'named' if named else 'kept'} {path.name}", ""
