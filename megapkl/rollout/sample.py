"""What a rollout engine consumes (`PromptItem`) and produces (`Sample`), and the packing of Samples
into the per-token tensors of `megapkl.objectives.TokenBatch`.

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
  router's top-k order (largest routing probability first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

FINISH_REASONS = ("stop", "length", "abort")


def _as_ids(ids: Any, what: str) -> Tensor:
    """A 1-D int64 CPU tensor from a list / tensor of token ids (Samples never hold device memory)."""
    t = torch.as_tensor(ids, dtype=torch.int64).detach().cpu()
    if t.dim() != 1:
        raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {list(t.shape)}")
    return t


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
    logp_behav: Tensor  # [R] float32, see the module docstring
    version: int  # policy version of the engine weights that generated the response
    finish_reason: str = "length"  # "stop" (a stop token was sampled) | "length" | "abort"
    temperature: float = 1.0  # the temperature logp_behav / topk_logp were computed at
    topk_ids: Optional[Tensor] = None  # [R, K] int64
    topk_logp: Optional[Tensor] = None  # [R, K] float32
    routed_experts: Optional[Tensor] = None  # [P + R - 1, layers, moe_top_k] int32 (MoE only)
    reward: Optional[float] = None  # filled by a reward function
    prompt_text: Optional[str] = None
    response_text: Optional[str] = None  # filled by engines that hold a tokenizer
    answer: Optional[str] = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Sample.finish_reason: expected one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        self.validate()

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def response_len(self) -> int:
        return int(self.response_ids.numel())

    @property
    def sequence(self) -> Tensor:
        """prompt + response token ids [P + R] (what the trainer feeds, teacher-forced)."""
        return torch.cat([self.prompt_ids, self.response_ids])

    def validate(self) -> None:
        """Shape checks across the per-token fields; raises ValueError naming the field."""
        r = self.response_len
        if tuple(self.logp_behav.shape) != (r,):
            raise ValueError(f"Sample {self.uid}: logp_behav has shape {list(self.logp_behav.shape)}, "
                             f"expected [{r}] (one per response token)")
        if (self.topk_ids is None) != (self.topk_logp is None):
            raise ValueError(f"Sample {self.uid}: topk_ids and topk_logp must be set together")
        if self.topk_ids is not None:
            if self.topk_ids.dim() != 2 or self.topk_ids.shape[0] != r \
                    or self.topk_ids.shape != self.topk_logp.shape:
                raise ValueError(f"Sample {self.uid}: topk_ids {list(self.topk_ids.shape)} / topk_logp "
                                 f"{list(self.topk_logp.shape)} must both be [{r}, K]")
        if self.routed_experts is not None:
            rows = self.prompt_len + r - 1
            if self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != rows:
                raise ValueError(f"Sample {self.uid}: routed_experts has shape "
                                 f"{list(self.routed_experts.shape)}, expected [{rows}, layers, top_k] "
                                 "(prompt + response - 1 rows)")


@dataclass
class PackedSamples:
    """Samples packed in order, one row per response token (the layout of `TokenBatch`).

    Per-token [N]: token_ids, response_index (0..M-1, non-decreasing), positions (1..T_m),
    logp_behav; [N, K]: topk_ids, topk_logp_behav (None unless every sample has them).
    Per-response [M]: group_index (the samples' global group ids), response_uid, lengths,
    prompt_lengths, versions, rewards (NaN where unset).
    """

    token_ids: Tensor
    response_index: Tensor
    positions: Tensor
    logp_behav: Tensor
    group_index: Tensor
    response_uid: Tensor
    lengths: Tensor
    prompt_lengths: Tensor
    versions: Tensor
    rewards: Tensor
    topk_ids: Optional[Tensor] = None
    topk_logp_behav: Optional[Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def per_token(self, per_response: Tensor) -> Tensor:
        """Broadcast a per-response [M] tensor (e.g. advantages) to the packed tokens [N]."""
        return per_response.index_select(0, self.response_index.to(per_response.device))

    def to_token_batch(self, logp: Tensor, advantages: Tensor, **extra: Any):
        """A `TokenBatch` from the learner log-probs [N] and advantages ([M] or [N]).

        `extra` passes the remaining TokenBatch fields (logp_prox, logp_init, topk_logp, entropy,
        step). The imports stay local: objectives is a lower room and loads only when used.
        """
        from megapkl.objectives.batch import TokenBatch

        if advantages.shape[0] != self.num_tokens:
            advantages = self.per_token(advantages)
        dev = logp.device
        return TokenBatch(
            logp=logp, logp_behav=self.logp_behav.to(dev), advantages=advantages.to(dev),
            response_index=self.response_index.to(dev), group_index=self.group_index.to(dev),
            positions=self.positions.to(dev), token_ids=self.token_ids.to(dev),
            topk_ids=None if self.topk_ids is None else self.topk_ids.to(dev),
            topk_logp_behav=None if self.topk_logp_behav is None else self.topk_logp_behav.to(dev),
            response_uid=self.response_uid.to(dev), **extra)


def pack_samples(samples: Sequence[Sample]) -> PackedSamples:
    """Pack samples (in the given order) into the per-token tensors the objectives need.

    Responses with zero tokens cannot appear in a TokenBatch (every response holds >= 1 action
    token), so they are an error here rather than a silent drop that would shift indices.
    """
    if not samples:
        raise ValueError("pack_samples: no samples")
    empty = [s.uid for s in samples if s.response_len == 0]
    if empty:
        raise ValueError(f"pack_samples: samples {empty[:5]} have empty responses")
    lengths = torch.tensor([s.response_len for s in samples], dtype=torch.int64)
    m = len(samples)
    response_index = torch.repeat_interleave(torch.arange(m), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(1, int(lengths.sum()) + 1) - starts.index_select(0, response_index)
    has_topk = all(s.topk_ids is not None for s in samples)
    if has_topk and len({s.topk_ids.shape[1] for s in samples}) > 1:
        raise ValueError("pack_samples: samples carry different top-K widths")
    return PackedSamples(
        token_ids=torch.cat([s.response_ids for s in samples]),
        response_index=response_index,
        positions=positions,
        logp_behav=torch.cat([s.logp_behav.float() for s in samples]),
        group_index=torch.tensor([s.group_id for s in samples], dtype=torch.int64),
        response_uid=torch.tensor([s.uid for s in samples], dtype=torch.int64),
        lengths=lengths,
        prompt_lengths=torch.tensor([s.prompt_len for s in samples], dtype=torch.int64),
        versions=torch.tensor([s.version for s in samples], dtype=torch.int64),
        rewards=torch.tensor([float("nan") if s.reward is None else s.reward for s in samples],
                             dtype=torch.float32),
        topk_ids=torch.cat([s.topk_ids for s in samples]) if has_topk else None,
        topk_logp_behav=torch.cat([s.topk_logp.float() for s in samples]) if has_topk else None,
    )
