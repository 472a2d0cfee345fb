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
  router's top-k order (largest routing probability first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

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
    # Filled by the trainer: the advantage (rollout stage), and the proximal / initial-model
    # log-probs [R] when they are recomputed per batch rather than per minibatch.
    advantage: Optional[float] = None
    logp_prox: Optional[Tensor] = None
    logp_init: Optional[Tensor] = None

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
