"""Stop strings, matched as SGLang 0.5.23 matches them, for every engine megapkl runs.

A stop string ends a response (or a multi-turn trajectory's turn) once it appears in the text of
the response's last tokens: after each sampled token, the last `stop_str_max_len + 1` tokens of
the output (never the prompt's) are decoded with the tokenizer's plain `decode(ids)` and each
stop string is looked for in that text, in the order given; the first one found is the match
(`Req.tail_str` and `Req._check_str_based_finish`, with `stop_str_max_len` the longest stop
string's token count, `SamplingParams.normalize`). A stop string is checked before the stop
tokens, so a token that both completes a stop string and is a stop token reports the string.
The ids keep the whole stop string; only the response's *text* loses it unless `no_stop_trim`
(the detokenizer's `trim_matched_stop`).

Matching needs a tokenizer: SGLang refuses stop strings on a server started with
`--skip-tokenizer-init` (`raise_if_tokenizer_required`), with the message `unavailable` gives.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

MAX_STOP_COUNT = 32  # SGLang's limit on stop strings per request


def unavailable(stop: Sequence[str]) -> str:
    """SGLang's refusal of stop strings without a tokenizer, word for word."""
    return (f"stop={list(stop)!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching).")


class StopStrings:
    """The stop strings of one request and the tokenizer that decodes their window."""

    def __init__(self, stop: Sequence[str], tokenizer: Any) -> None:
        self.stop = tuple(stop)
        if len(self.stop) > MAX_STOP_COUNT:
            raise ValueError(f"at most {MAX_STOP_COUNT} stop strings are allowed, "
                             f"got {len(self.stop)}")
        if self.stop and tokenizer is None:
            raise ValueError(unavailable(self.stop))
        self.tokenizer = tokenizer
        longest = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop),
                      default=0)
        self.window = longest + 1  # tokens decoded to look for a stop string

    def __bool__(self) -> bool:
        return bool(self.stop)

    def match(self, output_ids: Sequence[int]) -> Optional[str]:
        """The stop string that ends an output whose ids so far are `output_ids`, else None."""
        if not self.stop or not len(output_ids):
            return None
        text = self.tokenizer.decode([int(i) for i in output_ids[-self.window:]])
        for s in self.stop:
            if s in text:
                return s
        return None


def trim_text(text: str, matched: Optional[str], no_stop_trim: bool) -> str:
    """A finished response's text after the stop string `matched` ended it: cut before the
    string, or after it with `no_stop_trim` (its first occurrence, as SGLang's detokenizer)."""
    if matched is None:
        return text
    pos = text.find(matched)
    if pos == -1:
        return text
    return text[:pos + len(matched)] if no_stop_trim else text[:pos]
