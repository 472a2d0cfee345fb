"""The search agent's environment: Search-R1's tags, observations and invalid-action notice.

After each of the policy's turns (ended at `</search>` or `</answer>`, the stop strings), the
turn's text is matched against Search-R1's action pattern `<(search|answer)>(.*?)</\\1>` (the
first match):

- `<search> q </search>`: the query (stripped) goes to the retriever; its passages come back as
  "\\n\\n<information>Doc 1(Title: T) text\\nDoc 2(...) ...</information>\\n\\n", Search-R1's
  format (the title is the passage's first line, as written); the observation's closing
  "</information>\\n\\n" survives when the observation budget cuts it.
- `<answer> a </answer>`: the trajectory ends (the reward reads the answer).
- anything else: Search-R1's notice "My previous action is invalid. ..." and the policy goes on.

What differs from Search-R1 (search_r1/llm_agent/generation.py): there the engine generates
without stop strings and the text after the first `</search>` (else `</answer>`) is cut and
re-tokenized; here the engine stops at the first of the two, so a turn's tokens are exactly the
ones sampled.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from megapkl.envs.base import End, Environment, Observation, Turn

ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
STOP = ("</search>", "</answer>")
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between "
           "<search> and </search>. If I want to give the final answer, I should put the answer "
           "between <answer> and </answer>. Let me try again.\n")
CLOSING = "</information>\n\n"


def format_passages(hits: Sequence[dict]) -> str:
    """Search-R1's `_passages2string`: "Doc {i}(Title: {first line}) {other lines}\\n" each."""
    out = []
    for i, hit in enumerate(hits, 1):
        title, _, text = hit["document"]["contents"].partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


def observation(hits: Sequence[dict]) -> Observation:
    return Observation(f"\n\n<information>{format_passages(hits).strip()}{CLOSING}",
                       closing=CLOSING, tool="search")


class SearchEnv(Environment):
    """`search(query) -> hits` (`RetrieverClient.search`): one query's
    [{"document": {"id", "contents"}, "score"}, ...]."""

    stop = STOP

    def __init__(self, search: Callable[[str], list[dict]], close: Callable[[], None] = None) -> None:
        self.search, self._close = search, close

    def step(self, turn: Turn) -> Any:
        m = ACTION.search(turn.last_action)
        if m is None:
            return Observation(INVALID, source="invalid")
        if m.group(1) == "answer":
            return End("answer")
        return observation(self.search(m.group(2).strip()))

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None
