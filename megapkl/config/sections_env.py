"""The `env` section: multi-turn tool use (docs/agents.md).

With `env.type` unset every response is one generated turn. With it set, the rollout engine
generates each response turn by turn: after each of the policy's turns the environment returns an
observation (a tool's answer, an invalid-action notice), appended as tokens the policy reads but
is never trained on, or ends the trajectory. The budgets' defaults are Search-R1's (v0.2 and
later: 4 turns, 500 tokens per turn and per observation); the response budget is
rollout.max_response_len and counts action and observation tokens alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megapkl.config.sections_train import _DOTTED
from megapkl.config.typed import rng


@dataclass
class EnvConfig:
    """What a multi-turn trajectory talks to, and its budgets.

    - lookup: the CPU toy task `lookup_kv` (data.synthetic): a key's value is only known by a
      tool call.
    - python: the user's `function` ("package.module:callable"), called in worker processes as
      fn(turn={...}) -> {"observation": text, ...} or {"end": reason} (docs/agents.md).
    """

    type: Optional[Literal["lookup", "python"]] = None  # null: single-turn responses
    function: Optional[str] = None  # type python: "package.module:callable"
    # Stop strings that end a turn, kept in the output (SGLang's stop with no_stop_trim); unset:
    # the environment's own
    stop: Optional[list[str]] = None
    max_turns: int = field(default=4, metadata=rng(1))  # actions per trajectory (Search-R1: 4)
    # tokens one action may take (Search-R1: 500); null: what the response budget leaves
    max_turn_tokens: Optional[int] = field(default=500, metadata=rng(1))
    # tokens one observation may take, its text cut so its closing tag survives (Search-R1: 500)
    max_observation_tokens: int = field(default=500, metadata=rng(1))
    timeout_s: float = field(default=30.0, metadata=rng(0.0, lo_open=True))  # one step at most
    # fail: the run stops on every rank; incorrect: the trajectory ends, scored reward.incorrect
    on_error: Literal["fail", "incorrect"] = "fail"
    concurrency: int = field(default=64, metadata=rng(1))  # tool calls in flight per engine
    workers: int = field(default=4, metadata=rng(1))  # type python: worker processes

    def check(self, err) -> None:
        if self.type == "python" and not _DOTTED.match(self.function or ""):
            err(f"env type python needs a function 'package.module:callable', got "
                f"{self.function!r}", "function")
        if self.type != "python" and self.function is not None:
            err("is read by env.type: python only", "function", "type")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            err(f"must be a list of non-empty strings, got {self.stop!r}", "stop")

    @property
    def multi_turn(self) -> bool:
        return self.type is not None
