"""The rollout engine interface: what the trainer asks of any engine (embedded torch, SGLang).

    engine.update_weights(model.export_hf(), version=step)   # streamed (hf_name, full tensor)
    samples = engine.generate(prompts, n=8, sampling=SamplingParams(max_new_tokens=1024))
    engine.version, engine.health(), engine.close()

An engine holds exactly the weights last pushed to it and stamps their version on every Sample, so
a stale engine is simply one that has not been updated (periodic refresh) and a snapshot is a push
of older weights (uniform stale). Field names follow SGLang's `sampling_params` where it has one.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from torch import Tensor

from megapkl.errors import MegapklError
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.rollout.seeds import prompt_seed

if TYPE_CHECKING:
    from megapkl.rollout.turns import TurnDriver


class RolloutError(MegapklError, RuntimeError):
    """The rollout stage cannot go on: the message names the config key or the file."""


class RolloutEngineError(MegapklError, RuntimeError):
    """The engine cannot serve: closed, crashed, unreachable, or holding no weights yet."""


class WeightUpdateError(MegapklError, ValueError):
    """A pushed weight does not fit the engine's model (unknown name, wrong shape or dtype, or an
    incomplete first load), or a push to SGLang servers failed. The engine keeps its previous
    weights and version. `unreachable`: the URL of a server that stopped answering during the
    push (a dead server, not a bad weight: the others can still take the weights), else None."""

    def __init__(self, message: str, *, unreachable: Optional[str] = None):
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings (SGLang `sampling_params` names where they exist).

    temperature 0 means greedy decoding; its log-probs are then reported at temperature 1 (SGLang
    does the same). top_k -1 and top_p 1 are off. Both truncations act on the temperature-scaled
    full-vocabulary distribution and the kept set is their intersection (SGLang's sampler); the
    reported log-probs are never truncated. `stop_token_ids` None means the engine's EOS ids.
    `stop` strings end a response as SGLang matches them (rollout/stops.py); its ids keep the
    stop string, its text too with `no_stop_trim`.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: Optional[tuple[int, ...]] = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # SGLang `stop`: stop strings (a tokenizer decodes their window)
    no_stop_trim: bool = False  # SGLang `no_stop_trim`: the response's text keeps the stop string
    seed: Optional[int] = None  # SGLang `sampling_seed`; None: the engine's running generator
    # One seed per prompt of the call (overrides `seed`): the caller names each prompt's draws, so
    # a group's samples do not depend on which other prompts share the call (rollout/seeds.py).
    prompt_seeds: Optional[tuple[int, ...]] = None
    topk_logprobs: int = 0  # SGLang `top_logprobs_num`: K behavior top-K per token (SIS), 0 = off
    return_routed_experts: bool = False  # MoE routing replay (R3)

    def __post_init__(self):
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.topk_logprobs < 0:
            problems.append(f"topk_logprobs must be >= 0, got {self.topk_logprobs}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(x, str) for x in stop):
            problems.append(f"stop must be strings, got {self.stop!r}")
        if self.prompt_seeds is not None and any(not 0 <= int(x) < 2**63
                                                 for x in self.prompt_seeds):
            problems.append("prompt_seeds must be integers in [0, 2**63)")
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))
        object.__setattr__(self, "stop", stop)
        if self.prompt_seeds is not None:
            object.__setattr__(self, "prompt_seeds", tuple(int(x) for x in self.prompt_seeds))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))

    def seed_of(self, index: int) -> Optional[int]:
        """The seed of prompt `index` of the call: `prompt_seeds[index]`, else derived from
        `seed` and the index, else None (unseeded)."""
        if self.prompt_seeds is not None:
            return self.prompt_seeds[index]
        return None if self.seed is None else prompt_seed(self.seed, index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the reported log-probs use (1 for greedy decoding)."""
        return 1.0 if self.greedy else self.temperature

    @classmethod
    def from_rollout_config(cls, rollout: Any, topk_logprobs: int = 0,
                            return_routed_experts: bool = False, seed: Optional[int] = None
                            ) -> "SamplingParams":
        """From `megapkl.config.sections.RolloutConfig` (temperature, top_p, top_k,
        max_response_len). The caller resolves K (rollout.topk_logprobs or sis.top_k)."""
        return cls(max_new_tokens=rollout.max_response_len, temperature=rollout.temperature,
                   top_p=rollout.top_p, top_k=rollout.top_k, topk_logprobs=topk_logprobs,
                   return_routed_experts=return_routed_experts, seed=seed)


@dataclass
class _IdCounters:
    next_uid: int = 0
    next_group: int = 0


class RolloutEngine(abc.ABC):
    """Base class of rollout engines. Subclasses implement the abstract methods; the base class
    owns the uid / group-id counters so every engine numbers Samples the same way, and those
    counters are part of `state_dict` so a resumed run numbers them exactly as an unbroken one."""

    def __init__(self) -> None:
        self._ids = _IdCounters()
        self._closed = False

    # ---- the interface -------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, prompts: Sequence[PromptItem], n: int, sampling: SamplingParams,
                 turns: Optional["TurnDriver"] = None) -> list[Sample]:
        """`n` responses per prompt, returned prompt-major (prompt 0's n responses first).

        Responses to one prompt share a fresh group id; every response gets a fresh uid; every
        Sample carries the version of the weights that generated it. With `turns` (a
        `megapkl.rollout.turns.TurnDriver`) every response is a multi-turn trajectory: the
        engine generates a turn (at most `turns.turn_tokens(...)` tokens, ended by `turns.stop`
        strings kept in the output), hands it to the driver, continues after the observation it
        returns, and so on; `sampling.max_new_tokens` is then the whole response's budget."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Replace the weights from a stream of (Hugging Face name, full tensor) and adopt
        `version`. Atomic: on WeightUpdateError the previous weights and version stay."""

    @property
    @abc.abstractmethod
    def version(self) -> Optional[int]:
        """Version of the weights held (None before the first update)."""

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """A small status mapping; raises RolloutEngineError when the engine cannot serve."""

    def new_batch(self) -> None:
        """A new batch of rollouts begins (engines keeping per-batch state reset it)."""

    def keep_answers(self) -> None:
        """The batch is interrupted: keep what was generated for a resumed run, where the engine
        can (SGLangEngine: sglang/answers.py)."""

    def idle(self) -> None:
        """The trainer takes the accelerator back until the engine's next call: an engine that
        shares the trainer's GPUs hands its memory back (colocated SGLang servers); nothing by
        default. A generation does it on its own way out; a push that no generation follows
        does not."""

    def interrupt(self) -> None:
        """Make every call in flight, and every later one, fail at once: the engine is about to
        be closed and a thread still using it must end within seconds (nothing by default: an
        engine whose calls cannot block on another process)."""

    def close(self) -> None:
        """Release the engine; any later call raises RolloutEngineError. Idempotent."""
        self._closed = True

    # ---- shared helpers --------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._closed:
            raise RolloutEngineError(f"{type(self).__name__} is closed")

    def _allocate_ids(self, num_prompts: int, n: int) -> tuple[list[int], list[int]]:
        """(group id per prompt, uid per response) for a prompt-major batch."""
        g0, u0 = self._ids.next_group, self._ids.next_uid
        self._ids.next_group += num_prompts
        self._ids.next_uid += num_prompts * n
        return list(range(g0, g0 + num_prompts)), list(range(u0, u0 + num_prompts * n))

    def state_dict(self) -> dict[str, Any]:
        """Counters (and, in subclasses, sampler RNG) for checkpoint/resume."""
        return {"next_uid": self._ids.next_uid, "next_group": self._ids.next_group}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ids = _IdCounters(int(state["next_uid"]), int(state["next_group"]))

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_generate_args(prompts: Sequence[PromptItem], n: int, sampling: SamplingParams) -> None:
    """Argument checks every engine runs before any work (clear errors, not deep tracebacks)."""
    if n < 1:
        raise ValueError(f"generate: n (responses per prompt) must be >= 1, got {n}")
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"generate: sampling must be SamplingParams, got {type(sampling).__name__}")
    if sampling.prompt_seeds is not None and len(sampling.prompt_seeds) != len(prompts):
        raise ValueError(f"generate: {len(sampling.prompt_seeds)} prompt_seeds for "
                         f"{len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, PromptItem):
            raise TypeError(f"generate: prompts[{i}] must be a PromptItem, got {type(p).__name__}")
