"""One failure agreement across ranks: a failure on any rank stops every rank, at once, alike.

A rank that raises on its own while its peers wait in a collective leaves them there until the
process-group timeout (tens of minutes). So every section of the run that can fail on some ranks
only (an engine, a file, a reward function, a server's answer) runs its fallible work locally,
catches what it raises (`attempt`), and then meets the other ranks at one agreement (`agree`): a
single all-reduce of a failure flag (plus any flags the section wants reduced anyway). When a
rank failed, the ranks exchange their one-line reasons and every rank raises the same
`RanksFailed`, naming the failing ranks and what they raised.

    result, error = attempt(lambda: engine.generate(...))     # local: never a collective
    agree(error, group, what="the rollout")                   # collective: raises everywhere

A section whose local work consumes a collective stream (the weight export) uses `feed`, which
drains the rest of the stream after a failure, so the peers' collectives complete.

Whether an exception was raised alike on every rank is a property of the agreement (or of the
decision every rank takes from agreed data) that raised it, not of its type: `RanksFailed` is,
and what is raised from one is marked with `every_rank` (megapkl.train.failure_notice tells the
other ranks of any exception that is not).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from megapkl.errors import MegapklError
from megapkl.parallel.groups import group_device
from megapkl.rollout.engine import RolloutEngineError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RankError:
    """What one rank raised, small and picklable."""
    rank: int
    kind: str        # the exception's class name
    message: str     # on one line
    outage: bool     # an engine could not serve (RolloutEngineError): the engines are down
    where: str = ""  # the local step that raised, for a failure carried to a later agreement

    @classmethod
    def of(cls, exc: BaseException, where: str = "") -> "RankError":
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(rank, type(exc).__name__, one_line(str(exc)) or type(exc).__name__,
                   isinstance(exc, RolloutEngineError), where)

    def describe(self) -> str:
        return self.message if self.outage else f"{self.kind}: {self.message}"


def every_rank(exc: BaseException) -> BaseException:
    """`exc`, marked as raised alike on every rank (by an agreement, or by a decision every rank
    takes from agreed data): no rank needs to be told of it, and nothing may interrupt the
    collectives its way out still runs."""
    exc.every_rank = True  # type: ignore[attr-defined]
    return exc


class RanksFailed(MegapklError):
    """Raised on every rank of a section when any of them failed; the same message everywhere."""

    every_rank = True

    def __init__(self, what: str, errors: Sequence[RankError]) -> None:
        self.what, self.errors = what, list(errors)
        reasons = list(dict.fromkeys(e.describe() for e in self.errors))
        if self.outage:  # the engines name themselves (url, log) in their messages
            text = f"{what}'s engines failed: " + "; ".join(reasons)
        else:
            ranks = sorted({e.rank for e in self.errors})
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            text = f"{what} failed on {who}: " + "; ".join(reasons)
        super().__init__(text)

    @property
    def outage(self) -> bool:
        """Every failing rank's engine could not serve (no other kind of failure)."""
        return all(e.outage for e in self.errors)


def attempt(fn: Callable[[], T]) -> tuple[Optional[T], Optional[RankError]]:
    """(fn(), None), or (None, what it raised). `fn` must not enter a collective after anything
    that can raise (its peers would wait there)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every failure is agreed, then raised on every rank
        return None, RankError.of(exc)


def feed(stream: Iterable, sink: Callable[[Any], Any]) -> Optional[RankError]:
    """Hand the collective `stream` to `sink` (local work that consumes it and may raise); after a
    failure the rest of the stream is consumed anyway, so every rank's collectives complete."""
    it = iter(stream)
    _, error = attempt(lambda: sink(it))
    for _ in it:
        pass
    return error


def agree(error: Optional[RankError], group: Any = None, *, what: str,
          flags: Sequence[int] = ()) -> list[int]:
    """Collective over `group` (None: every rank): RanksFailed on every rank if any rank passes an
    error; else the element-wise maximum of `flags` over the group (free to piggyback on)."""
    many = dist.is_initialized() and dist.get_world_size(group) > 1
    vec = torch.tensor([int(error is not None), *flags], dtype=torch.int64,
                       device=group_device(group if group is not None else _world()))
    if many:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    if vec[0].item():
        said: list[Optional[RankError]] = [error]
        if many:
            said = [None] * dist.get_world_size(group)
            dist.all_gather_object(said, error, group=group)
        errors = [e for e in said if e is not None]
        raise RanksFailed(errors[0].where or what, errors)
    return [int(x) for x in vec[1:].tolist()]


def agreed(fn: Callable[[], T], group: Any = None, *, what: str) -> T:
    """`fn()` on every rank of `group`, agreed: its result, or RanksFailed on every rank."""
    result, error = attempt(fn)
    agree(error, group, what=what)
    return result  # type: ignore[return-value]


class Carried:
    """Rank-local steps between agreement points (logging, rank 0's files): what one raises is
    kept, not raised, so this rank reaches the next agreement with its peers and the failure is
    agreed there (`take()` hands it over). Once a step failed, the later ones are skipped."""

    def __init__(self) -> None:
        self.error: Optional[RankError] = None

    def run(self, fn: Callable[[], T], where: str, default: Any = None) -> Any:
        """`fn()`, or `default` when it (or an earlier step) failed. An agreed failure
        (RanksFailed: every rank raises it) is raised, not carried."""
        if self.error is not None:
            return default
        try:
            return fn()
        except RanksFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - agreed at the next agreement point
            self.error = RankError.of(exc, where)
            return default

    def take(self) -> Optional[RankError]:
        error, self.error = self.error, None
        return error


def _world() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


def one_line(text: str) -> str:
    """A multi-line message (a header, then one item a line) as one line."""
    out = ""
    for line in (" ".join(ln.split()) for ln in text.splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out
