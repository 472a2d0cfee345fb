"""A user's environment (`env.type: python`), run as a user's reward is: in worker processes.

`env.function` names "package.module:callable", called for each step as `fn(turn={...})` with
the trajectory so far as JSON:

    {"prompt": str | None, "answer": str | None, "fields": {...}, "turn": 1,
     "last_action": "...</search>", "finish": "stop", "matched": "</search>",
     "segments": [{"kind": "action", "text": "...", "source": None}, ...],
     "prompt_ids": [...], "response_ids": [...]}

and answers {"observation": text, "closing": "</tag>", "source": "tool" | "invalid",
"tool": name} (only "observation" is required) or {"end": reason} (or null: end). Each call runs
in one of `env.workers` processes (a fresh interpreter each, as `reward.function`'s), bounded by
`env.timeout_s`: a call that does not return is killed with its worker, which is restarted. A
step is a function of the trajectory so far, so a worker holds no state a run depends on.
"""
from __future__ import annotations

import queue
from typing import Any, Optional, Sequence

from megapkl.envs.base import End, EnvError, Environment, Observation, Turn
from megapkl.rollout.bounded_verify import BoundedFunction, RewardError


class PythonEnv(Environment):
    def __init__(self, function: str, *, timeout_s: float = 30.0, workers: int = 4,
                 stop: Optional[Sequence[str]] = None) -> None:
        self.function, self.stop = function, tuple(stop or ())
        self._idle: "queue.Queue[BoundedFunction]" = queue.Queue()
        self._all: list[BoundedFunction] = []
        try:
            for _ in range(workers):
                w = BoundedFunction(function, timeout_s=timeout_s, kind="result",
                                    what="env.function")
                self._all.append(w)
                self._idle.put(w)
        except RewardError as exc:
            self.close()
            raise EnvError(str(exc)) from None

    def step(self, turn: Turn) -> Observation | End:
        worker = self._idle.get()
        try:
            answer = worker.call(turn=turn_json(turn))
        except RewardError as exc:
            raise EnvError(f"env.function {self.function}: {exc}") from None
        finally:
            self._idle.put(worker)
        return parse_step(answer, self.function)

    def close(self) -> None:
        for w in self._all:
            w.close()
        self._all = []


def turn_json(turn: Turn) -> dict[str, Any]:
    return {"prompt": turn.prompt_text, "answer": turn.answer, "fields": turn.fields,
            "turn": turn.turn, "last_action": turn.last_action, "finish": turn.finish,
            "matched": turn.matched,
            "segments": [{"kind": g.kind, "text": g.text, "source": g.source}
                         for g in turn.segments],
            "prompt_ids": turn.prompt_ids.tolist(), "response_ids": turn.response_ids.tolist()}


def parse_step(answer: Any, function: str) -> Observation | End:
    """A user's answer as an Observation or an End; EnvError naming what is wrong."""
    if answer is None:
        return End("end")
    if isinstance(answer, dict) and "end" in answer and "observation" not in answer:
        return End(str(answer["end"]) if answer["end"] not in (True, None) else "end")
    if isinstance(answer, dict) and isinstance(answer.get("observation"), str):
        extra = set(answer) - {"observation", "closing", "source", "tool"}
        if extra:
            raise EnvError(f"env.function {function}: unknown keys {sorted(extra)} in its answer")
        return Observation(answer["observation"], closing=answer.get("closing") or "",
                           source=answer.get("source") or "tool", tool=answer.get("tool"))
    raise EnvError(f"env.function {function}: expected {{'observation': text, ...}} or "
                   f"{{'end': reason}}, got {str(answer)[:80]}")
