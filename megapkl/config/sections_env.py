"""The `env` section: multi-turn tool use (docs/agents.md).

With `env.type` unset every response is one generated turn. With it set, the rollout engine
generates each response turn by turn: after each of the policy's turns the environment returns an
observation (a tool's answer, an invalid-action notice), appended as tokens the policy reads but
is never trained on, or ends the trajectory. The budgets' defaults are Search-R1's (v0.2 and
later: 4 search rounds and a final turn, so 5 actions; 500 tokens per turn and per observation);
the response budget is rollout.max_response_len and counts action and observation tokens alike.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from megapkl.config.sections_train import _DOTTED
from megapkl.config.typed import rng

_URL = re.compile(r"^https?://\S+$")


@dataclass
class SearchConfig:
    """env.type search: the retriever the search agent queries (docs/search-agent.md). Either
    `url`, a running server with Search-R1's /retrieve contract (megapkl's or Search-R1's own),
    or `index`, an index directory (`megapkl retriever index`) that the run serves itself with
    `megapkl retriever serve`, health-checked before the first rollout and stopped on every exit.
    Values are Search-R1's where it has one."""

    url: Optional[str] = None  # e.g. http://127.0.0.1:8000/retrieve (a base URL gets /retrieve)
    index: Optional[str] = None  # an index directory: the run starts the retriever itself
    host: str = "127.0.0.1"  # index: the address it binds (loopback unless set)
    port: int = field(default=8000, metadata=rng(1, 65535))  # index: its port (Search-R1's)
    # index: more `megapkl retriever serve` flags, e.g. [--gpu, "on"], [--ef-search, "128"]
    serve_args: list[str] = field(default_factory=list)
    # index: seconds to wait for it to answer (a flat E5 index of wiki-18, 65 GB, loads in minutes)
    health_deadline_s: float = field(default=900.0, metadata=rng(0.0, lo_open=True))
    topk: int = field(default=3, metadata=rng(1, 100))  # passages per search (Search-R1: 3)
    timeout_s: float = field(default=8.0, metadata=rng(0.0, lo_open=True))  # one request
    max_retries: int = field(default=2, metadata=rng(0))  # after a refused/timed-out/5xx request
    concurrency: int = field(default=4, metadata=rng(1))  # requests in flight per environment
    max_batch: int = field(default=64, metadata=rng(1))  # queries gathered into one request
    batch_wait_ms: float = field(default=5.0, metadata=rng(0.0))  # how long to gather them

    def check(self, err) -> None:
        if self.url is not None and not _URL.match(self.url):
            err(f"must be the retriever's http(s) URL, got {self.url!r}", "url")
        if self.url is not None and self.index is not None:
            err("set url (a running retriever) or index (the run serves it), not both", "url",
                "index")

    @property
    def worst_case_s(self) -> float:
        """How long one search may take through every retry (requests and pauses)."""
        pauses = sum(0.5 * 2 ** k for k in range(self.max_retries))
        return (self.max_retries + 1) * self.timeout_s + pauses + self.batch_wait_ms / 1000


@dataclass
class EnvConfig:
    """What a multi-turn trajectory talks to, and its budgets.

    - lookup: the CPU toy task `lookup_kv` (data.synthetic): a key's value is only known by a
      tool call.
    - search: the SIS paper's search agent (Search-R1's tags, a retriever; `search`).
    - python: the user's `function` ("package.module:callable"), called in worker processes as
      fn(turn={...}) -> {"observation": text, ...} or {"end": reason} (docs/agents.md).
    """

    type: Optional[Literal["lookup", "search", "python"]] = None  # null: single-turn responses
    function: Optional[str] = None  # type python: "package.module:callable"
    # Stop strings that end a turn, kept in the output (SGLang's stop with no_stop_trim); unset:
    # the environment's own
    stop: Optional[list[str]] = None
    # actions per trajectory; Search-R1's max_turns=4 counts search rounds, then one more turn: 5
    max_turns: int = field(default=5, metadata=rng(1))
    # tokens one action may take (Search-R1: 500); null: what the response budget leaves
    max_turn_tokens: Optional[int] = field(default=500, metadata=rng(1))
    # tokens one observation may take, its text cut so its closing tag survives (Search-R1: 500)
    max_observation_tokens: int = field(default=500, metadata=rng(1))
    timeout_s: float = field(default=30.0, metadata=rng(0.0, lo_open=True))  # one step at most
    # fail: the run stops on every rank; incorrect: the trajectory ends, scored reward.incorrect
    on_error: Literal["fail", "incorrect"] = "fail"
    concurrency: int = field(default=64, metadata=rng(1))  # tool calls in flight per engine
    workers: int = field(default=4, metadata=rng(1))  # type python: worker processes
    search: SearchConfig = field(default_factory=SearchConfig)  # type search: the retriever

    def check(self, err) -> None:
        if self.type == "python" and not _DOTTED.match(self.function or ""):
            err(f"env type python needs a function 'package.module:callable', got "
                f"{self.function!r}", "function")
        if self.type != "python" and self.function is not None:
            err("is read by env.type: python only", "function", "type")
        if self.type == "search" and self.search.url is None and self.search.index is None:
            err("env type search needs a retriever: search.url (a running one) or search.index "
                "(an index directory the run serves)", "search.url", "search.index")
        if self.type != "search" and (self.search.url or self.search.index):
            err("is read by env.type: search only", "search.url" if self.search.url else
                "search.index", "type")
        if self.type == "search" and self.timeout_s < self.search.worst_case_s:
            err(f"one search may take {self.search.worst_case_s:g} s through its retries "
                f"(search.timeout_s x (max_retries + 1) + pauses); env.timeout_s "
                f"({self.timeout_s:g}) must allow it, or the step times out first", "timeout_s",
                "search.timeout_s", "search.max_retries")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            err(f"must be a list of non-empty strings, got {self.stop!r}", "stop")

    @property
    def multi_turn(self) -> bool:
        return self.type is not None
