"""What a rollout engine consumes (`PromptItem`) and produces (`Sample`). The trainer packs Samples
directly into megatron micro-batches (`megapkl.parallel.batching`); there is no other per-response
type between the engine and the loss.

Conventions (those of SGLang's HTTP API, `return_logprob` / `top_logprobs_num`, so that the embedded
engine and the SGLang engine produce interchangeable Samples):

- `logp_behav[t]` = log_softmax(logits_t / temperature)[response_ids[t]] over the FULL vocabulary,
  before any top-k / top-p truncation (SGLang's `output_token_logprobs`). The trainer must recompute
  its log-probs at the same temperature (`Sample.temperature`).
- `topk_ids[t]`, `topk_logp[t]`: the K most likely tokens of that same distribution and their
  log-probs, in decreasing order (SGLang's `output_top_logprobs`).
- `routed_experts`: int32 [P + R - 1, num_moe_layers, moe_top_k], one row per token whose next token
  is predicted: rows 0..P-1 are the prompt tokens, row P + t - 1 is response token t-1 (1 <= t < R);
  the last response token is never fed through the model, so it has no row (SGLang's
  `meta_info.routed_experts` with `routed_experts_start_len` = 0). Experts of a row are in the
  router's top-k order (largest routing probability first). Observation tokens are fed like any
  other, so they have rows too (routing replay stays exact across turns).

The trajectory contract (multi-turn tool use, docs/agents.md): a response is a sequence of
`Segment`s, each an *action* (tokens the engine sampled) or an *observation* (text the environment
inserted: a tool's answer, an invalid-action notice). `response_ids` [R] holds all of them in order,
exactly the ids the engine consumed and produced: generated ids are never decoded and re-encoded,
and an observation's text is tokenized once, by itself. Every per-token field of the behaviour
policy (`logp_behav`, `topk_ids`, `topk_logp`, `versions`) has ONE ROW PER ACTION TOKEN, A rows in
all, in response order: an observation position has no slot to hold a placeholder, so no value of
one can reach a ratio, a clip or a count. A single-turn response is the one-segment case
(`segments` None: every response token is an action, A = R).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

FINISH_REASONS = ("stop", "length", "abort")
ACTION, OBSERVATION = "action", "observation"


def _as_ids(ids: Any, what: str) -> Tensor:
    """A 1-D int64 CPU tensor from a list / tensor of token ids (Samples never hold device memory)."""
    t = torch.as_tensor(ids, dtype=torch.int64).detach().cpu()
    if t.dim() != 1:
        raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {list(t.shape)}")
    return t


@dataclass(frozen=True)
class Segment:
    """A contiguous run of a response's tokens: an `ACTION` (sampled by the engine) or an
    `OBSERVATION` (inserted by the environment; never trained on, never in a ratio)."""

    kind: str
    length: int
    text: Optional[str] = None  # action: its tokens decoded; observation: the text inserted
    source: Optional[str] = None  # observation: what inserted it ("tool", "invalid", ...)

    def __post_init__(self):
        if self.kind not in (ACTION, OBSERVATION):
            raise ValueError(f"Segment.kind: expected {ACTION!r} or {OBSERVATION!r}, got {self.kind!r}")
        if int(self.length) < 1:
            raise ValueError(f"Segment.length: a segment holds at least one token, got {self.length}")


@dataclass
class PromptItem:
    """One prompt to generate from: token ids plus what the reward needs to score a response."""

    prompt_ids: Tensor
    text: Optional[str] = None  # the rendered prompt (after the template), for logs
    answer: Optional[str] = None  # gold answer handed to the reward
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. source file/line, dataset index

    def __post_init__(self):
        self.prompt_ids = _as_ids(self.prompt_ids, "PromptItem.prompt_ids")
        if self.prompt_ids.numel() == 0:
            raise ValueError("PromptItem.prompt_ids: a prompt needs at least one token")


@dataclass
class Sample:
    """One generated response with everything the trainer needs about how it was generated."""

    uid: int  # globally unique response id (stable across minibatches; SIS draws key on it)
    group_id: int  # responses to the same prompt in the same `generate` call share it
    prompt_ids: Tensor  # [P] int64
    response_ids: Tensor  # [R] int64, includes the stop token when finish_reason == "stop"
    logp_behav: Tensor  # [A] float32, one per action token (module docstring)
    version: int  # policy version that generated the response (the oldest of `versions`)
    finish_reason: str = "length"  # "stop" (a stop token or stop string) | "length" | "abort"
    matched: Optional[str] = None  # the stop string that ended the response, when one did
    temperature: float = 1.0  # the temperature logp_behav / topk_logp were computed at
    topk_ids: Optional[Tensor] = None  # [A, K] int64
    topk_logp: Optional[Tensor] = None  # [A, K] float32
    routed_experts: Optional[Tensor] = None  # [P + R - 1, layers, moe_top_k] int32 (MoE only)
    # The response's segments in order (multi-turn); None: one action segment (single-turn).
    segments: Optional[tuple[Segment, ...]] = None
    # [A] int64: the policy version of each action token (a trajectory may span a weight push);
    # None: every action token has `version`.
    versions: Optional[Tensor] = None
    reward: Optional[float] = None  # filled by a reward function
    prompt_text: Optional[str] = None
    response_text: Optional[str] = None  # filled by engines that hold a tokenizer
    answer: Optional[str] = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # Filled by the trainer: the advantage (rollout stage), and the proximal / initial-model
    # log-probs [A] when they are recomputed per batch rather than per minibatch.
    advantage: Optional[float] = None
    logp_prox: Optional[Tensor] = None
    logp_init: Optional[Tensor] = None
    # [R] bool, True at action tokens: derived from `segments` once, at construction
    _actions: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Sample.finish_reason: expected one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        if self.segments is not None:
            self.segments = tuple(self.segments)
            self._actions = torch.cat([torch.full((int(g.length),), g.kind == ACTION)
                                       for g in self.segments]) if self.segments else None
        self.validate()

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def response_len(self) -> int:
        """R: every response token, actions and observations."""
        return int(self.response_ids.numel())

    @property
    def multi_turn(self) -> bool:
        """Does the response hold an observation?"""
        return self.segments is not None and len(self.segments) > 1

    @property
    def action_mask(self) -> Tensor:
        """[R] bool: True at the tokens the engine sampled (the only ones trained on)."""
        if self._actions is None:
            return torch.ones(self.response_len, dtype=torch.bool)
        return self._actions

    @property
    def num_actions(self) -> int:
        """A: the response's action tokens (T_m of the objectives)."""
        if self.segments is None:
            return self.response_len
        return sum(int(g.length) for g in self.segments if g.kind == ACTION)

    @property
    def turns(self) -> int:
        """Action segments (the policy's turns); 1 for a single-turn response."""
        return 1 if self.segments is None else sum(g.kind == ACTION for g in self.segments)

    def action_texts(self) -> list[str]:
        """What the policy wrote, one text per action segment (None texts skipped): the writing
        a reward reads. Single-turn: [response_text] when known."""
        if self.segments is None:
            return [] if self.response_text is None else [self.response_text]
        return [g.text for g in self.segments if g.kind == ACTION and g.text is not None]

    def action_versions(self) -> Tensor:
        """[A] int64: the policy version of every action token."""
        if self.versions is not None:
            return self.versions
        return torch.full((self.num_actions,), int(self.version), dtype=torch.int64)

    @property
    def sequence(self) -> Tensor:
        """prompt + response token ids [P + R] (what the trainer feeds, teacher-forced)."""
        return torch.cat([self.prompt_ids, self.response_ids])

    def validate(self) -> None:
        """Shape checks across the per-token fields; raises ValueError naming the field."""
        if self.segments is not None:
            self._validate_segments()
        a = self.num_actions
        if tuple(self.logp_behav.shape) != (a,):
            raise ValueError(f"Sample {self.uid}: logp_behav has shape {list(self.logp_behav.shape)}, "
                             f"expected [{a}] (one per action token)")
        if (self.topk_ids is None) != (self.topk_logp is None):
            raise ValueError(f"Sample {self.uid}: topk_ids and topk_logp must be set together")
        if self.topk_ids is not None:
            if self.topk_ids.dim() != 2 or self.topk_ids.shape[0] != a \
                    or self.topk_ids.shape != self.topk_logp.shape:
                raise ValueError(f"Sample {self.uid}: topk_ids {list(self.topk_ids.shape)} / topk_logp "
                                 f"{list(self.topk_logp.shape)} must both be [{a}, K] (one row per "
                                 "action token)")
        if self.versions is not None:
            if tuple(self.versions.shape) != (a,):
                raise ValueError(f"Sample {self.uid}: versions has shape {list(self.versions.shape)}, "
                                 f"expected [{a}] (one per action token)")
            if int(self.versions.min()) != int(self.version):
                raise ValueError(f"Sample {self.uid}: version {self.version} must be the oldest of "
                                 f"the action tokens' versions ({int(self.versions.min())})")
        if self.routed_experts is not None:
            rows = self.prompt_len + self.response_len - 1
            if self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != rows:
                raise ValueError(f"Sample {self.uid}: routed_experts has shape "
                                 f"{list(self.routed_experts.shape)}, expected [{rows}, layers, top_k] "
                                 "(prompt + response - 1 rows)")

    def _validate_segments(self) -> None:
        """Segments tile the response, alternate in kind, start and end with an action (an
        observation after the last action predicts nothing: the turn driver drops it)."""
        segs = self.segments
        if not segs:
            raise ValueError(f"Sample {self.uid}: segments is empty (None means one action segment)")
        total = sum(int(g.length) for g in segs)
        if total != self.response_len:
            raise ValueError(f"Sample {self.uid}: segments cover {total} tokens, the response has "
                             f"{self.response_len}")
        if segs[0].kind != ACTION or segs[-1].kind != ACTION:
            raise ValueError(f"Sample {self.uid}: a response starts and ends with an action segment")
        if any(a.kind == b.kind for a, b in zip(segs, segs[1:])):
            raise ValueError(f"Sample {self.uid}: two adjacent segments of one kind (merge them)")
