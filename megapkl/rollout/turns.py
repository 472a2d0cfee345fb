"""Multi-turn trajectories: the environment's half of the turn loop, for any engine.

An engine generates a trajectory turn by turn (the embedded engine in rounds over a batch,
`rollout/embedded_turns.py`; the SGLang engine one request per turn and trajectory): after each of
the policy's turns it asks the `TurnDriver` what comes next. The driver holds the environment
(`megapkl.envs`), the tokenizer and the budgets; it runs the environment's steps on its own tool
threads (several trajectories' tool calls at once, each bounded in time), tokenizes what a step
returns, by itself and once, cut to the observation budget with its closing tag kept, and either
appends it to the `Trajectory` or ends it. A `Trajectory` accumulates the segments, exactly the
engine's ids and per-action-token records, and becomes a `Sample` (`rollout/sample.py`: the
trajectory contract) at the end.

Budgets (the `env` config section, docs/agents.md): at most `max_turns` actions; the response
(actions and observations) at most `max_response_tokens` (rollout.max_response_len); one action at
most `max_turn_tokens`; one observation at most `max_observation_tokens`. An observation is
inserted only when a next action has room, so a response always ends with an action.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from megapkl.errors import MegapklError
from megapkl.parallel.threads import rank_executor
from megapkl.rollout.sample import ACTION, OBSERVATION, PromptItem, Sample, Segment

log = logging.getLogger(__name__)

ENV_ERROR_KEY = "env_error"  # Sample.metadata key of a failed environment step (on_error: incorrect)


class EnvError(MegapklError, RuntimeError):
    """An environment step failed (raised, timed out, answered something else than an
    Observation or an End): handled as a user reward's failure is (`env.on_error`)."""


@dataclass(frozen=True)
class Turn:
    """The trajectory so far, as the environment sees it after one of the policy's turns."""

    prompt_ids: Tensor  # [P] the prompt as the engine got it
    response_ids: Tensor  # [R] every response token so far, actions and observations
    segments: tuple[Segment, ...]  # the response's segments so far (texts decoded/inserted)
    prompt_text: Optional[str] = None
    answer: Optional[str] = None  # the gold answer (for environments that grade as they go)
    fields: dict[str, Any] = field(default_factory=dict)  # the dataset row's other fields
    # How the last action ended: "stop" (a stop string or a stop token) or "length" (its
    # token budget); `matched` is the stop string found at its end, if one was.
    finish: str = "stop"
    matched: Optional[str] = None

    @property
    def turn(self) -> int:
        """How many actions the policy has taken (1 after its first turn)."""
        return sum(g.kind == ACTION for g in self.segments)

    @property
    def last_action(self) -> str:
        """The text of the policy's last turn (as decoded, special tokens dropped)."""
        for g in reversed(self.segments):
            if g.kind == ACTION:
                return g.text or ""
        return ""

    @property
    def last_action_ids(self) -> Tensor:
        """The token ids of the policy's last turn, exactly as sampled."""
        return self.response_ids[len(self.response_ids) - self.segments[-1].length:]


@dataclass(frozen=True)
class Observation:
    """Text to insert after the policy's turn. `closing` is a tail of `text` that must survive
    when the observation is cut to the observation budget (e.g. "</information>"): the text
    before it is shortened instead. `source` names what inserted it, for the metrics: "tool" (a
    tool call's answer) or "invalid" (a notice for an unusable action); `tool` names the tool."""

    text: str
    closing: str = ""
    source: str = "tool"
    tool: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text:
            raise EnvError(f"Observation.text must be a non-empty string, got {self.text!r}")
        if self.closing and not self.text.endswith(self.closing):
            raise EnvError(f"Observation.closing {self.closing!r} must end its text")
        if self.source not in ("tool", "invalid"):
            raise EnvError(f"Observation.source must be 'tool' or 'invalid', got {self.source!r}")


@dataclass(frozen=True)
class End:
    """The trajectory is over (`reason` for the logs: "answer", "invalid", ...)."""

    reason: str = "answer"


Step = Union[Observation, End]


@dataclass(frozen=True)
class Budgets:
    max_turns: int
    max_response_tokens: int
    max_turn_tokens: Optional[int] = None  # None: what is left of the response budget
    max_observation_tokens: int = 500

    def __post_init__(self):
        if self.max_turns < 1 or self.max_response_tokens < 1 or self.max_observation_tokens < 1 \
                or (self.max_turn_tokens is not None and self.max_turn_tokens < 1):
            raise ValueError(f"Budgets: every budget must be >= 1, got {self}")


# ------------------------------------------------------------------ one trajectory


class Trajectory:
    """One response under construction: segments appended turn by turn, with the engine's
    per-action-token records (log-probs, top-K, version) and, for MoE, the routed experts of
    every token fed through the model."""

    def __init__(self, prompt: PromptItem, index: int) -> None:
        self.prompt, self.index = prompt, index  # index: the response's place in the call
        self.ids: list[Tensor] = []
        self.segments: list[Segment] = []
        self.logp: list[Tensor] = []
        self.topk_ids: list[Tensor] = []
        self.topk_logp: list[Tensor] = []
        self.versions: list[Tensor] = []
        self.experts: list[Tensor] = []
        self.length = 0  # response tokens so far
        self.sampled = 0  # action tokens so far (the embedded engine's draw counter)
        self.finish, self.matched = "length", None
        self.end_reason: Optional[str] = None  # set when the trajectory is over
        self.error: Optional[str] = None
        self.env_steps, self.env_seconds = 0, 0.0  # the environment's steps and their wall time

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def turns(self) -> int:
        return sum(g.kind == ACTION for g in self.segments)

    @property
    def response_ids(self) -> Tensor:
        return torch.cat(self.ids) if self.ids else torch.zeros(0, dtype=torch.int64)

    def context_ids(self) -> Tensor:
        """prompt + response so far: what the next turn continues (SGLang's input_ids)."""
        return torch.cat([self.prompt.prompt_ids, self.response_ids])

    def add_action(self, ids: Tensor, logp: Tensor, *, version: int, text: Optional[str],
                   finish: str, matched: Optional[str] = None, topk_ids: Optional[Tensor] = None,
                   topk_logp: Optional[Tensor] = None, experts: Optional[Tensor] = None) -> None:
        """A turn the engine generated: its ids, their log-probs [n] (and top-K [n, K]), the
        weight version, and (MoE) the routed experts of the tokens it fed through the model."""
        n = int(ids.numel())
        if n < 1 or tuple(logp.shape) != (n,):
            raise ValueError(f"Trajectory.add_action: {n} ids with log-probs {list(logp.shape)}")
        self.ids.append(ids.to(torch.int64))
        self.logp.append(logp.float())
        if topk_ids is not None:
            self.topk_ids.append(topk_ids)
            self.topk_logp.append(topk_logp)
        self.versions.append(torch.full((n,), int(version), dtype=torch.int64))
        if experts is not None:
            self.experts.append(experts)
        self.segments.append(Segment(ACTION, n, text=text))
        self.length += n
        self.sampled += n
        self.finish, self.matched = finish, matched

    def add_observation(self, ids: Tensor, text: str, source: str) -> None:
        self.ids.append(ids.to(torch.int64))
        self.segments.append(Segment(OBSERVATION, int(ids.numel()), text=text, source=source))
        self.length += int(ids.numel())

    def end(self, reason: str, error: Optional[str] = None) -> None:
        self.end_reason, self.error = reason, error

    def turn(self) -> Turn:
        p = self.prompt
        return Turn(prompt_ids=p.prompt_ids, response_ids=self.response_ids,
                    segments=tuple(self.segments), prompt_text=p.text, answer=p.answer,
                    fields=dict(p.metadata.get("fields", {})), finish=self.finish,
                    matched=self.matched)

    def to_sample(self, uid: int, group: int, temperature: float,
                  text: Optional[str] = None) -> Sample:
        """The finished trajectory as a Sample (one action segment: a single-turn Sample)."""
        multi = len(self.segments) > 1
        versions = torch.cat(self.versions)
        metadata = dict(self.prompt.metadata)
        metadata["trajectory"] = {"end": self.end_reason, "env_steps": self.env_steps,
                                  "env_seconds": self.env_seconds}
        if self.error is not None:
            metadata[ENV_ERROR_KEY] = self.error
        cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
        return Sample(uid=uid, group_id=group, prompt_ids=self.prompt.prompt_ids,
                      response_ids=self.response_ids, logp_behav=torch.cat(self.logp),
                      version=int(versions.min()), finish_reason=self.finish,
                      matched=self.matched,
                      temperature=temperature, topk_ids=cat(self.topk_ids),
                      topk_logp=cat(self.topk_logp), routed_experts=cat(self.experts),
                      segments=tuple(self.segments) if multi else None,
                      versions=versions if bool((versions != versions[0]).any()) else None,
                      prompt_text=self.prompt.text, response_text=text, answer=self.prompt.answer,
                      metadata=metadata)


# ------------------------------------------------------------------ the environment's half


class TurnDriver:
    """What comes after each of the policy's turns, for an engine generating trajectories:
    budgets, the environment's step (on the driver's tool threads, bounded by `timeout_s`), and
    the observation's tokens.

    `env`: has `step(Turn) -> Observation | End` and `stop` (stop strings); `tokenizer`: has
    `encode(text, add_special_tokens=False)` and `decode(ids, skip_special_tokens=True)`;
    `on_error`: "fail" (an EnvError ends the generation: the run's agreement stops every rank)
    or "incorrect" (the trajectory ends, its sample carries the error and scores
    reward.incorrect)."""

    def __init__(self, env: Any, tokenizer: Any, budgets: Budgets, *, timeout_s: float = 30.0,
                 on_error: str = "fail", concurrency: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if on_error not in ("fail", "incorrect"):
            raise ValueError(f"env.on_error must be 'fail' or 'incorrect', got {on_error!r}")
        if tokenizer is None:
            raise ValueError("multi-turn rollouts need a tokenizer (observations are text)")
        self.env, self.tokenizer, self.budgets = env, tokenizer, budgets
        self.timeout_s, self.on_error, self.clock = float(timeout_s), on_error, clock
        self.stop: tuple[str, ...] = tuple(getattr(env, "stop", ()) or ())
        self._pool = rank_executor(concurrency, "megapkl-tool")

    def limited(self, max_response_tokens: int) -> "TurnDriver":
        """This driver (the same environment and tool threads) with another response budget
        (an evaluation's); closing it closes nothing."""
        view = copy.copy(self)
        view.budgets = dataclasses.replace(self.budgets, max_response_tokens=max_response_tokens)
        view.close = lambda: None
        return view

    # ---- budgets

    def turn_tokens(self, traj: Trajectory) -> int:
        """max_new_tokens of the trajectory's next turn: what is left of the response budget,
        capped by the turn budget."""
        left = self.budgets.max_response_tokens - traj.length
        cap = self.budgets.max_turn_tokens
        return max(0, left if cap is None else min(cap, left))

    def must_end(self, traj: Trajectory) -> Optional[str]:
        """Why the trajectory ends without asking the environment (None: ask it)."""
        if traj.turns >= self.budgets.max_turns:
            return "max_turns"
        if self.budgets.max_response_tokens - traj.length < 2:  # an observation and an action
            return "budget"
        return None

    # ---- the environment

    def react(self, trajs: Sequence[Trajectory]) -> list[Optional[Tensor]]:
        """After each trajectory's latest action: its observation's ids (also appended to it),
        or None when it ended. The steps of all of them run at once on the tool threads."""
        out: list[Optional[Tensor]] = [None] * len(trajs)
        todo = []
        for i, t in enumerate(trajs):
            why = self.must_end(t)
            if why is not None:
                t.end(why)
            else:
                todo.append(i)
        started = self.clock()
        futures = {i: self._pool.submit(self._step, trajs[i]) for i in todo}
        for i, fut in futures.items():
            t = trajs[i]
            try:
                step = fut.result(timeout=max(0.0, self.timeout_s - (self.clock() - started)))
            except cf.TimeoutError:
                fut.cancel()
                step = EnvError(f"no answer within env.timeout_s ({self.timeout_s:g} s)")
            except Exception as exc:  # noqa: BLE001 - the environment's failure, per on_error
                step = exc if isinstance(exc, EnvError) else EnvError(f"{type(exc).__name__}: {exc}")
            out[i] = self._apply(t, step)
        return out

    def _step(self, traj: Trajectory) -> Any:
        t0 = self.clock()
        try:
            return self.env.step(traj.turn())
        finally:
            traj.env_steps += 1
            traj.env_seconds += self.clock() - t0

    def _apply(self, traj: Trajectory, step: Any) -> Optional[Tensor]:
        if isinstance(step, EnvError) or not isinstance(step, (Observation, End)):
            error = step if isinstance(step, EnvError) else EnvError(
                f"step returned {type(step).__name__}, expected an Observation or an End")
            where = _origin(traj.prompt)
            if self.on_error == "fail":
                raise EnvError(f"the environment failed on {where}: {error}") from None
            log.warning("the environment failed on %s (trajectory ended, scored "
                        "reward.incorrect; env.on_error): %s", where, error)
            traj.end("error", error=str(error))
            return None
        if isinstance(step, End):
            traj.end(step.reason)
            return None
        room = self.budgets.max_response_tokens - traj.length - 1  # one token for the next turn
        ids, text = self.observation_ids(step, min(room, self.budgets.max_observation_tokens))
        if ids is None:
            traj.end("budget")
            return None
        traj.add_observation(ids, text, step.source)
        return ids

    def observation_ids(self, obs: Observation, budget: int) -> tuple[Optional[Tensor], str]:
        """The observation's ids (its text tokenized once, by itself) within `budget` tokens: the
        text before `closing` is shortened until the whole fits; (None, "") when not even the
        closing fits."""
        ids = self.encode(obs.text)
        if len(ids) <= budget:
            return torch.tensor(ids, dtype=torch.int64), obs.text
        body = obs.text[:len(obs.text) - len(obs.closing)] if obs.closing else obs.text
        lo, hi = 0, len(body)  # the longest prefix of body whose text fits (binary search)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.encode(body[:mid] + obs.closing)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        text = body[:lo] + obs.closing
        ids = self.encode(text) if text else []
        if not ids or len(ids) > budget:
            return None, ""
        return torch.tensor(ids, dtype=torch.int64), text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Tensor) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def close(self, wait_s: float = 2.0) -> None:
        """Stop the tool threads: idle ones end at once; one still inside a step is waited for
        at most `wait_s` in all (a step bounded by its own timeouts ends soon after)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + wait_s
        for t in list(getattr(self._pool, "_threads", ())):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


def _origin(prompt: PromptItem) -> str:
    meta = prompt.metadata or {}
    if "source" in meta and "line" in meta:
        return f"prompt {meta['source']}:{meta['line']}"
    return "a prompt" if prompt.text is None else f"prompt {prompt.text[:40]!r}"


# ------------------------------------------------------------------ per-update metrics

def trajectory_sums(samples: Sequence[Sample]) -> list[float]:
    """Sums over `samples` (mergeable over ranks) that `trajectory_metrics` turns into means:
    trajectories, turns, those that called a tool, tool calls, invalid actions, action and
    observation tokens, environment steps and their seconds, environment failures."""
    out = [0.0] * 10
    for s in samples:
        segs = s.segments or ()
        calls = sum(g.kind == OBSERVATION and g.source == "tool" for g in segs)
        info = s.metadata.get("trajectory", {})
        out = [a + b for a, b in zip(out, (
            1, s.turns, calls > 0, calls,
            sum(g.kind == OBSERVATION and g.source == "invalid" for g in segs),
            s.num_actions, s.response_len - s.num_actions, info.get("env_steps", 0),
            info.get("env_seconds", 0.0), ENV_ERROR_KEY in s.metadata))]
    return out


def trajectory_metrics(sums: Sequence[float]) -> dict[str, float]:
    """turns/mean, tool/call_rate (trajectories that called a tool), tool/calls, tool/invalid
    (per trajectory), tokens/action, tokens/observation (per trajectory), env/errors (count),
    and time/env_step_s, the mean wall time of an environment step (a wall-clock field: it
    alone differs between two runs of one config)."""
    n, turns, called, calls, invalid, act, obs, steps, seconds, errors = sums
    n = max(n, 1.0)
    return {"turns/mean": turns / n, "tool/call_rate": called / n, "tool/calls": calls / n,
            "tool/invalid": invalid / n, "tokens/action": act / n, "tokens/observation": obs / n,
            "time/env_step_s": seconds / max(steps, 1.0), "env/errors": errors}
