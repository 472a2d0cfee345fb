"""Rewards: the math verifier, the synthetic task's exact match, the search agent's answer exact
match (Search-R1's), and the user's own (a Python function or an HTTP reward server).

A reward fills `sample.reward` for a batch of samples. The built-in rewards map each sample to
`correct` or `incorrect` (PKL periodic refresh: +1 / -1; PKL controlled staleness and TETPO:
1 / 0) and never raise: unparseable output, a parser exception or a timeout give `incorrect`.

Math (the TETPO recipe): the gold answer is wrapped in \\boxed{} and parsed; the response's last
complete \\boxed{...} (nested braces allowed) is parsed and verified against it. With
`require_boxed=False`, a response without a box is parsed by math-verify's own extraction
(boxed-answer priority, then other LaTeX / plain expressions) instead of scoring `incorrect`.
math-verify runs in a worker process with a hard time limit (`megapkl.rollout.bounded_verify`),
the same verifier the evaluation uses, so a pathological answer is scored wrong and logged and
never hangs a rank.

User rewards (`reward.type: python | http`) score one prompt group per call: the prompts,
responses, gold answers and dataset fields of the group in, one reward per response out
(docs/experiments.md). A failure (an exception, a timeout, a wrong answer, a server error) either
stops the run (`reward.on_error: fail`, agreed by every rank) or scores the group `incorrect`,
logged and counted in `reward/errors` (`on_error: incorrect`).
"""
from __future__ import annotations

import json
import logging
import re
import string
import time
from typing import Any, Optional, Sequence

import torch

from megapkl.rollout.bounded_verify import last_boxed  # noqa: F401 - part of this API
from megapkl.rollout.sample import Sample

log = logging.getLogger(__name__)

ERROR_KEY = "reward_error"  # Sample.metadata key of a failed user reward (on_error: incorrect)


class Reward:
    """Base: `scores(samples) -> list[float]`; calling it on samples fills `sample.reward` and
    returns the rewards as a float32 tensor [M]."""

    def __init__(self, correct: float = 1.0, incorrect: float = -1.0):
        if not correct > incorrect:
            raise ValueError(f"reward: correct ({correct}) must be > incorrect ({incorrect})")
        self.correct, self.incorrect = float(correct), float(incorrect)

    def is_correct(self, sample: Sample) -> bool:
        raise NotImplementedError

    def score(self, sample: Sample) -> float:
        return self.correct if self.is_correct(sample) else self.incorrect

    def scores(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s) for s in samples]

    def __call__(self, samples: Sequence[Sample]) -> torch.Tensor:
        values = self.scores(samples)
        for s, v in zip(samples, values):
            s.reward = v
        return torch.tensor(values, dtype=torch.float32)

    def accuracy(self, rewards: torch.Tensor) -> float:
        """Fraction correct from rewards (PKL: (1 + mean R) / 2 for +-1)."""
        return float((rewards == self.correct).float().mean()) if rewards.numel() else 0.0

    def close(self) -> None:
        """Stop what the reward runs (a worker process); idempotent."""

    def __enter__(self) -> "Reward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def last_action_ids(sample: Sample) -> torch.Tensor:
    """The ids of the policy's last turn: the whole response when it is single-turn."""
    if sample.segments is None:
        return sample.response_ids
    return sample.response_ids[sample.response_len - sample.segments[-1].length:]


def response_text(sample: Sample, tokenizer: Any) -> str:
    if sample.response_text is not None:
        return sample.response_text
    if tokenizer is None:
        raise ValueError("the reward needs Sample.response_text or a tokenizer to decode "
                         "response_ids")
    return tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)


class MathReward(Reward):
    """Boxed-answer correctness verified by math-verify, in a worker process with a hard limit of
    `timeout_s` per answer (megapkl.rollout.bounded_verify.BoundedVerifier)."""

    def __init__(self, correct: float = 1.0, incorrect: float = -1.0, tokenizer: Any = None,
                 require_boxed: bool = True, timeout_s: Optional[float] = 5):
        super().__init__(correct, incorrect)
        import math_verify  # noqa: F401  (fail at construction, not at the first sample)

        from megapkl.rollout.bounded_verify import BoundedVerifier

        self.tokenizer = tokenizer
        limit = max(1, round(timeout_s)) if timeout_s else None
        self.verifier = BoundedVerifier(timeout_s=limit, require_boxed=require_boxed)

    def response_text(self, sample: Sample) -> str:
        return response_text(sample, self.tokenizer)

    def is_correct(self, sample: Sample) -> bool:
        if sample.answer is None:
            raise ValueError(f"sample {sample.uid} has no gold answer (PromptItem.answer)")
        return self.check(self.response_text(sample), sample.answer,
                          where=f"sample {sample.uid} ({_origin(sample)})")

    def check(self, response: str, gold: str, where: str = "") -> bool:
        """True when the response's answer verifies against `gold`; False on any failure (a slow
        answer is logged by the verifier)."""
        return self.verifier.score(response, gold, where=where).correct

    def close(self) -> None:
        self.verifier.close()


class SyntheticReward(Reward):
    """Exact-match correctness as defined by a synthetic task (`task.is_correct(ids, answer)`).
    A task with partial credit (`task.fraction_correct(ids, answer)` in [0, 1], e.g. count_up_8)
    scores incorrect + (correct - incorrect) * fraction, and `correct` only when all of it is right,
    so `accuracy` still counts fully correct responses. The task reads the policy's last turn
    (the whole response when it is single-turn; never an observation)."""

    def __init__(self, task: Any, correct: float = 1.0, incorrect: float = -1.0):
        super().__init__(correct, incorrect)
        self.task = task

    def is_correct(self, sample: Sample) -> bool:
        try:
            return bool(self.task.is_correct(last_action_ids(sample), sample.answer))
        except Exception as e:  # a task bug must not look like a crash of the run either
            log.debug("synthetic reward: %s", e)
            return False

    def score(self, sample: Sample) -> float:
        fraction = getattr(self.task, "fraction_correct", None)
        if fraction is None or self.is_correct(sample):
            return super().score(sample)
        try:
            f = float(fraction(last_action_ids(sample), sample.answer))
        except Exception as e:
            log.debug("synthetic reward: %s", e)
            return self.incorrect
        return self.incorrect + (self.correct - self.incorrect) * min(max(f, 0.0), 1.0)


class GroupReward(Reward):
    """A user's reward, one prompt group per call (`score_group`); see the module docstring."""

    def __init__(self, correct: float, incorrect: float, *, tokenizer: Any, on_error: str,
                 what: str) -> None:
        super().__init__(correct, incorrect)
        self.tokenizer, self.on_error, self.what = tokenizer, on_error, what

    def score_group(self, payload: dict) -> list[float]:
        raise NotImplementedError

    def scores(self, samples: Sequence[Sample]) -> list[float]:
        from megapkl.rollout.bounded_verify import RewardError, check_rewards

        by_group: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            by_group.setdefault(s.group_id, []).append(i)
        out = [self.incorrect] * len(samples)
        for members in by_group.values():
            group = [samples[i] for i in members]
            try:
                values = check_rewards(self.score_group(self.payload(group)), len(group))
            except (RewardError, ValueError) as exc:
                if self.on_error == "fail":
                    raise RewardError(f"{self.what} failed on the group of {_origin(group[0])}: "
                                      f"{exc}") from None
                log.warning("%s failed on the group of %s (scored reward.incorrect, "
                            "reward.on_error): %s", self.what, _origin(group[0]), exc)
                for s in group:
                    s.metadata[ERROR_KEY] = str(exc)
                continue
            for i, v in zip(members, values):
                out[i] = v
        return out

    def payload(self, group: Sequence[Sample]) -> dict:
        """What the user's function / server gets: one entry per response of the group."""
        return {"prompts": [s.prompt_text for s in group],
                "responses": [response_text(s, self.tokenizer) for s in group],
                "answers": [s.answer for s in group],
                "fields": [_jsonable(s.metadata.get("fields", {})) for s in group]}


class FunctionReward(GroupReward):
    """`reward.type: python`: `reward.function` ("package.module:callable") called as
    fn(prompts=[...], responses=[...], answers=[...], fields=[...]) -> [reward per response], in a
    worker process bounded by `reward.timeout_s` (megapkl.rollout.bounded_verify.BoundedFunction)."""

    def __init__(self, function: str, correct: float = 1.0, incorrect: float = -1.0, *,
                 tokenizer: Any = None, timeout_s: float = 10.0, on_error: str = "fail") -> None:
        from megapkl.rollout.bounded_verify import BoundedFunction

        super().__init__(correct, incorrect, tokenizer=tokenizer, on_error=on_error,
                         what=f"reward.function {function}")
        self.function = BoundedFunction(function, timeout_s=timeout_s)

    def score_group(self, payload: dict) -> list[float]:
        return self.function.call(**payload)

    def close(self) -> None:
        self.function.close()


class HttpReward(GroupReward):
    """`reward.type: http`: POST the group's payload as JSON to `reward.url`; the answer is
    {"rewards": [reward per response]} (or the bare list). Each request waits at most
    `reward.timeout_s`; a connection failure, a timeout or a 5xx is retried `reward.max_retries`
    times with a doubling pause (0.5 s, 1 s, ...), a 4xx is not (the request is wrong)."""

    def __init__(self, url: str, correct: float = 1.0, incorrect: float = -1.0, *,
                 tokenizer: Any = None, timeout_s: float = 10.0, max_retries: int = 2,
                 on_error: str = "fail") -> None:
        super().__init__(correct, incorrect, tokenizer=tokenizer, on_error=on_error,
                         what=f"reward.url {url}")
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries

    def score_group(self, payload: dict) -> list[float]:
        import urllib.error
        import urllib.request

        from megapkl.rollout.bounded_verify import RewardError

        body = json.dumps(payload).encode()
        errors: list[str] = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    answer = json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                text = exc.read().decode("utf-8", "replace")[:200]
                errors.append(f"HTTP {exc.code}: {' '.join(text.split())}")
                if exc.code < 500:
                    break
                continue
            except (OSError, ValueError) as exc:  # refused, reset, timed out, not JSON
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            return answer["rewards"] if isinstance(answer, dict) and "rewards" in answer else answer
        raise RewardError(f"{len(errors)} attempt(s) failed: " + " | ".join(errors[-3:]))


# ---- the search agent's reward: Search-R1's exact match (verl/utils/reward_score/qa_em.py)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Search-R1's (SQuAD's) normalisation: lower-case, punctuation removed, the articles a / an /
    the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Does the normalised prediction equal any normalised gold answer?"""
    p = normalize_answer(prediction)
    return any(normalize_answer(g) == p for g in golds)


def last_answer(texts: Sequence[str]) -> Optional[str]:
    """The last <answer>...</answer> (stripped) in the policy's writing, one text per action
    segment (a match never spans an observation); None when there is none."""
    for text in reversed(texts):
        found = _ANSWER.findall(text or "")
        if found:
            return found[-1].strip()
    return None


def gold_answers(sample: Sample) -> list[str]:
    """Every gold answer of a sample: the row's `golden_answers` list (how `megapkl data prepare`
    writes the QA sets, beside `answer`, the first of them), else `answer` alone."""
    golds = (sample.metadata.get("fields") or {}).get("golden_answers")
    if isinstance(golds, (list, tuple)) and golds and all(isinstance(g, str) for g in golds):
        return list(golds)
    if isinstance(golds, str) and golds:
        return [golds]
    if sample.answer is None:
        raise ValueError(f"sample {sample.uid} ({_origin(sample)}) has no gold answer "
                         "(answer or golden_answers)")
    return [sample.answer]


class AnswerEMReward(Reward):
    """`reward.type: answer_em`: `correct` when the last <answer> the policy wrote matches any
    gold answer exactly after normalisation (Search-R1's exact match), else `incorrect`; outcome
    only, no format shaping. Only the policy's own writing is read (Sample.action_texts): the
    prompt's template example and the retrieved passages never count, so Search-R1's rule of
    skipping the prompt's example answer is not needed."""

    def __init__(self, correct: float = 1.0, incorrect: float = 0.0, tokenizer: Any = None):
        super().__init__(correct, incorrect)
        self.tokenizer = tokenizer

    def texts(self, sample: Sample) -> list[str]:
        return policy_texts(sample, self.tokenizer)

    def is_correct(self, sample: Sample) -> bool:
        return answer_match(sample, self.tokenizer)[1]


def policy_texts(sample: Sample, tokenizer: Any = None) -> list[str]:
    """What the policy wrote: one text per action segment (a single-turn response is one)."""
    if sample.segments is None:
        return [response_text(sample, tokenizer)]
    return sample.action_texts()


def answer_match(sample: Sample, tokenizer: Any = None) -> tuple[Optional[str], bool]:
    """(the last <answer> the policy wrote or None, whether it matches a gold answer exactly):
    the rule of `reward.type: answer_em`, which the evaluation of QA benchmarks applies too."""
    answer = last_answer(policy_texts(sample, tokenizer))
    return answer, answer is not None and exact_match(answer, gold_answers(sample))


def data_source(sample: Sample) -> str:
    """The dataset a sample's prompt comes from: the row's `source` (prepared QA sets) or
    `data_source` (Search-R1's files), else "all"."""
    fields = sample.metadata.get("fields") or {}
    src = fields.get("source", fields.get("data_source"))
    return str(src) if isinstance(src, str) and src else "all"


def match_counts(samples: Sequence[Sample], correct: float) -> dict[str, list[int]]:
    """{source: [samples, correct ones]} of scored samples (mergeable over ranks by summing)."""
    counts: dict[str, list[int]] = {}
    for s in samples:
        if s.reward is None:
            raise ValueError(f"sample {s.uid} is not scored yet (call the reward first)")
        c = counts.setdefault(data_source(s), [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + int(s.reward == correct)
    return counts


def match_metrics(counts: dict[str, list[int]], prefix: str = "em/") -> dict[str, float]:
    """{prefix}{source}: fraction correct per data source, and {prefix}avg: the unweighted mean
    over the sources (the SIS paper's table averages its benchmarks)."""
    out = {f"{prefix}{k}": h / n for k, (n, h) in sorted(counts.items())}
    if out:
        out[f"{prefix}avg"] = sum(out.values()) / len(out)
    return out


def exact_match_by_source(samples: Sequence[Sample], reward: Reward,
                          prefix: str = "em/") -> dict[str, float]:
    """Exact match per data source of scored samples (`match_metrics` of one process)."""
    return match_metrics(match_counts(samples, reward.correct), prefix)


def _origin(sample: Sample) -> str:
    """Where a sample's prompt comes from, for messages: 'file:line', else its group."""
    meta = sample.metadata or {}
    if "source" in meta and "line" in meta:
        return f"prompt {meta['source']}:{meta['line']}"
    return f"prompt group {sample.group_id}"


def _jsonable(fields: dict) -> dict:
    """The dataset row's other fields that JSON can carry (Parquet may hold bytes, dates)."""
    return {k: v for k, v in fields.items() if _is_json(v)}


def _is_json(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def build_reward(reward_cfg: Any, data_cfg: Any = None, tokenizer: Any = None, task: Any = None
                 ) -> Reward:
    """From `RewardConfig` (the reward section); a synthetic reward needs the task (or
    data_cfg.synthetic to build it)."""
    r = reward_cfg
    kind = r.type or ("synthetic" if data_cfg is not None and data_cfg.synthetic else "math")
    if kind == "math":
        return MathReward(r.correct, r.incorrect, tokenizer=tokenizer, timeout_s=r.timeout_s)
    if kind == "synthetic":
        if task is None:
            if data_cfg is None or not data_cfg.synthetic:
                raise ValueError("reward type synthetic needs a synthetic task (data.synthetic)")
            from megapkl.rollout.synthetic import make_synthetic_task

            task = make_synthetic_task(data_cfg.synthetic)
        return SyntheticReward(task, r.correct, r.incorrect)
    if kind == "answer_em":
        return AnswerEMReward(r.correct, r.incorrect, tokenizer=tokenizer)
    if kind == "python":
        return FunctionReward(r.function, r.correct, r.incorrect, tokenizer=tokenizer,
                              timeout_s=r.timeout_s, on_error=r.on_error)
    if kind == "http":
        return HttpReward(r.url, r.correct, r.incorrect, tokenizer=tokenizer,
                          timeout_s=r.timeout_s, max_retries=r.max_retries, on_error=r.on_error)
    raise ValueError(f"unknown reward type {kind!r}; expected math, synthetic, answer_em, python "
                     "or http")
