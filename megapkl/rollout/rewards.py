"""Verifier rewards: a math reward on math-verify (boxed answers) and the synthetic-task reward.

A reward maps a Sample to `correct` or `incorrect` (PKL periodic refresh: +1 / -1; PKL controlled
staleness and TETPO: 1 / 0). Scoring a response never raises: unparseable output, a parser
exception or a timeout all give `incorrect`, since one odd completion must not stop a run.

Math (the TETPO recipe): the gold answer is wrapped in \\boxed{} and parsed; the response's last
complete \\boxed{...} (nested braces allowed) is parsed and verified against it. With
`require_boxed=False`, a response without a box is parsed by math-verify's own extraction
(boxed-answer priority, then other LaTeX / plain expressions) instead of scoring `incorrect`.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional, Sequence

import torch

from megapkl.rollout.sample import Sample

log = logging.getLogger(__name__)

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed{...} (or \\fbox{...}) in `text`, braces balanced;
    None when there is none (a box cut off by the length limit does not count)."""
    best: Optional[tuple[int, str]] = None
    for command in _BOX_COMMANDS:
        start = text.rfind(command)
        while start != -1:
            content = _braced_after(text, start + len(command))
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(command, 0, start)
    return None if best is None else best[1]


def _braced_after(text: str, i: int) -> Optional[str]:
    """The balanced {...} group starting at text[i] (spaces allowed before '{'), else None."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


class Reward:
    """Base: `score(sample) -> float`; calling it on samples fills `sample.reward` and returns the
    rewards as a float32 tensor [M]."""

    def __init__(self, correct: float = 1.0, incorrect: float = -1.0):
        if not correct > incorrect:
            raise ValueError(f"reward: correct ({correct}) must be > incorrect ({incorrect})")
        self.correct, self.incorrect = float(correct), float(incorrect)

    def is_correct(self, sample: Sample) -> bool:
        raise NotImplementedError

    def score(self, sample: Sample) -> float:
        return self.correct if self.is_correct(sample) else self.incorrect

    def __call__(self, samples: Sequence[Sample]) -> torch.Tensor:
        values = [self.score(s) for s in samples]
        for s, v in zip(samples, values):
            s.reward = v
        return torch.tensor(values, dtype=torch.float32)

    def accuracy(self, rewards: torch.Tensor) -> float:
        """Fraction correct from rewards (PKL: (1 + mean R) / 2 for +-1)."""
        return float((rewards == self.correct).float().mean()) if rewards.numel() else 0.0


class MathReward(Reward):
    """Boxed-answer correctness verified by math-verify.

    `timeout_s` bounds parsing and verification with math-verify's own guard, which relies on
    SIGALRM and so only works in the main thread; elsewhere it is turned off (math-verify refuses
    to run with it there) and a pathological expression could block the calling thread.
    """

    def __init__(self, correct: float = 1.0, incorrect: float = -1.0, tokenizer: Any = None,
                 require_boxed: bool = True, timeout_s: Optional[int] = 5):
        super().__init__(correct, incorrect)
        import math_verify  # noqa: F401  (fail at construction, not at the first sample)

        self.tokenizer = tokenizer
        self.require_boxed = require_boxed
        self.timeout_s = timeout_s

    def response_text(self, sample: Sample) -> str:
        if sample.response_text is not None:
            return sample.response_text
        if self.tokenizer is None:
            raise ValueError("MathReward needs Sample.response_text or a tokenizer to decode "
                             "response_ids")
        return self.tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)

    def is_correct(self, sample: Sample) -> bool:
        if sample.answer is None:
            raise ValueError(f"sample {sample.uid} has no gold answer (PromptItem.answer)")
        return self.check(self.response_text(sample), sample.answer)

    def check(self, response: str, gold: str) -> bool:
        """True when the response's answer verifies against `gold`; False on any failure."""
        try:
            return self._check(response, gold)
        except BaseException as e:  # math-verify's TimeoutException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            log.debug("math reward: verification failed (%s: %s)", type(e).__name__, e)
            return False

    def _timeout(self) -> Optional[int]:
        main = threading.current_thread() is threading.main_thread()
        return self.timeout_s if main and self.timeout_s else None

    def _check(self, response: str, gold: str) -> bool:
        from math_verify import parse, verify

        timeout = self._timeout()
        gold_parsed = _parse_gold(gold, timeout)
        if not gold_parsed:
            log.warning("math reward: gold answer %r does not parse; scoring incorrect", gold)
            return False
        boxed = last_boxed(response)
        if boxed is not None:
            pred = parse("\\boxed{" + boxed + "}", parsing_timeout=timeout)
        elif self.require_boxed:
            return False
        else:
            pred = parse(response, parsing_timeout=timeout)
        if not pred:
            return False
        return bool(verify(gold_parsed, pred, timeout_seconds=timeout))


@functools.lru_cache(maxsize=65536)
def _parse_gold(gold: str, timeout: Optional[int]):
    """Gold answers repeat across a group's responses and across epochs: parse each once."""
    from math_verify import parse

    text = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    return parse(text, parsing_timeout=timeout)


class SyntheticReward(Reward):
    """Exact-match correctness as defined by a synthetic task (`task.is_correct(ids, answer)`).
    A task with partial credit (`task.fraction_correct(ids, answer)` in [0, 1], e.g. count_up_8)
    scores incorrect + (correct - incorrect) * fraction, and `correct` only when all of it is right,
    so `accuracy` still counts fully correct responses."""

    def __init__(self, task: Any, correct: float = 1.0, incorrect: float = -1.0):
        super().__init__(correct, incorrect)
        self.task = task

    def is_correct(self, sample: Sample) -> bool:
        try:
            return bool(self.task.is_correct(sample.response_ids, sample.answer))
        except Exception as e:  # a task bug must not look like a crash of the run either
            log.debug("synthetic reward: %s", e)
            return False

    def score(self, sample: Sample) -> float:
        fraction = getattr(self.task, "fraction_correct", None)
        if fraction is None or self.is_correct(sample):
            return super().score(sample)
        try:
            f = float(fraction(sample.response_ids, sample.answer))
        except Exception as e:
            log.debug("synthetic reward: %s", e)
            return self.incorrect
        return self.incorrect + (self.correct - self.incorrect) * min(max(f, 0.0), 1.0)


def build_reward(reward_cfg: Any, data_cfg: Any = None, tokenizer: Any = None, task: Any = None
                 ) -> Reward:
    """From `RewardConfig` (type, correct, incorrect); a synthetic reward needs the task (or
    data_cfg.synthetic to build it)."""
    kind = reward_cfg.type or ("synthetic" if data_cfg is not None and data_cfg.synthetic else "math")
    if kind == "math":
        return MathReward(reward_cfg.correct, reward_cfg.incorrect, tokenizer=tokenizer)
    if kind == "synthetic":
        if task is None:
            if data_cfg is None or not data_cfg.synthetic:
                raise ValueError("reward type synthetic needs a synthetic task (data.synthetic)")
            from megapkl.rollout.synthetic import make_synthetic_task

            task = make_synthetic_task(data_cfg.synthetic)
        return SyntheticReward(task, reward_cfg.correct, reward_cfg.incorrect)
    raise ValueError(f"unknown reward type {kind!r}; expected 'math' or 'synthetic'")
