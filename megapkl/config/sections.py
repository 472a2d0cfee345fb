"""Run-config sections for the model, its parallel layout and the RL algorithm around the objective.

Each section is a dataclass read by `typed.build`: unknown keys, wrong types and out-of-range values
are errors naming the dotted key. `check(err)` holds the rules that involve only the section's own
fields; rules spanning sections live in `megapkl.config.run`. Defaults are the paper settings of
SPEC section 10 (Proximal KL paper, Appendix B: periodic refresh) unless a comment says otherwise.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from megapkl.config.typed import rng

# Model names that denote a mixture-of-experts model: an explicit "moe" or Qwen's "<total>b-a<active>b".
_MOE_NAME = re.compile(r"moe|\d+(\.\d+)?b-a\d+(\.\d+)?b", re.IGNORECASE)


@dataclass
class ModelConfig:
    """Which policy model to train.

    `name` selects a provider (e.g. 'qwen3-1.7b', 'tiny-qwen3', 'tiny-qwen3-moe'); the model room
    owns the list, so the config accepts any non-empty name. `arch` is a free mapping of
    architecture overrides handed to that provider unchanged; the few fields the config itself must
    reason about (layers for pipeline splits, experts for expert parallelism) are typed fields.
    """

    name: str = "qwen3-1.7b"
    hf_checkpoint: Optional[str] = None  # HF directory or hub id to import weights from
    tokenizer: Optional[str] = None  # defaults to hf_checkpoint
    dtype: Literal["bf16", "fp32"] = "bf16"  # PKL B.2: BF16 optimization
    num_layers: Optional[int] = field(default=None, metadata=rng(1))
    hidden_size: Optional[int] = field(default=None, metadata=rng(1))
    num_experts: Optional[int] = field(default=None, metadata=rng(1))
    arch: dict[str, Any] = field(default_factory=dict)
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
    routing_replay: bool = False  # MoE: replay the rollout's routed experts in training (SIS R3)

    def check(self, err) -> None:
        if not self.name.strip():
            err("must be a non-empty model name (e.g. 'qwen3-1.7b', 'tiny-qwen3')", "name")
        if self.routing_replay and not self.is_moe:
            err(f"routing replay needs a mixture-of-experts model; '{self.name}' is dense "
                "(set model.num_experts or use a MoE model)", "routing_replay")

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model, from `num_experts`, `arch` or the model name."""
        experts = self.num_experts or self.arch.get("num_experts") or self.arch.get("num_moe_experts")
        if isinstance(experts, int) and not isinstance(experts, bool):
            return experts > 1
        return bool(_MOE_NAME.search(self.name))


@dataclass
class ParallelConfig:
    """Megatron-core parallel layout of the trainer (SPEC section 7: the loss is partition invariant,
    so these change speed and memory, never the result).

    `data` may be 'auto': the data-parallel size is then the trainer world size divided by
    tensor x pipeline x context, resolved as soon as the world size is known (slurm nodes x GPUs).
    """

    tensor: int = field(default=1, metadata=rng(1))
    pipeline: int = field(default=1, metadata=rng(1))
    context: int = field(default=1, metadata=rng(1))
    expert: int = field(default=1, metadata=rng(1))
    data: Union[int, Literal["auto"]] = field(default="auto", metadata=rng(1))
    sequence_parallel: bool = False
    virtual_pipeline: Optional[int] = field(default=None, metadata=rng(2))
    micro_batch_size: int = field(default=1, metadata=rng(1))
    # Token-balanced micro-batches: when set, responses are packed by this budget of padded
    # tokens per micro-batch (first-fit decreasing; prompt + response, rounded to the CP/SP
    # multiple; one-row layout: rows x the longest) instead of micro_batch_size responses, and
    # every DP rank runs the same number of micro-batches.
    max_tokens_per_micro_batch: Optional[int] = field(default=None, metadata=rng(1))
    distributed_optimizer: bool = True
    # How responses share micro-batch rows: "none" = one right-padded row per response (BSHD);
    # "thd" = all responses of a micro-batch packed into one row with cu_seqlens (no padding
    # between responses beyond 2*cp multiples; megapkl.parallel.batching.pack_thd).
    packing: Literal["none", "thd"] = "none"

    def check(self, err) -> None:
        if self.sequence_parallel and self.tensor < 2:
            err("sequence parallelism splits activations across the tensor-parallel group and needs "
                f"parallel.tensor > 1, got tensor={self.tensor}", "sequence_parallel", "tensor")
        if self.expert > 1 and self.tensor > 1 and not self.sequence_parallel:
            err("megatron-core needs sequence parallelism when expert and tensor parallelism are "
                f"combined (expert={self.expert}, tensor={self.tensor}); set "
                "parallel.sequence_parallel: true", "sequence_parallel", "expert", "tensor")
        if self.virtual_pipeline is not None and self.pipeline < 2:
            err("an interleaved (virtual) pipeline needs parallel.pipeline > 1, "
                f"got pipeline={self.pipeline}", "virtual_pipeline", "pipeline")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one model replica: tensor x pipeline x context."""
        return self.tensor * self.pipeline * self.context

    @property
    def sequence_multiple(self) -> int:
        """Every sequence is padded to this: 2*cp equal CP chunks, each split over TP under SP
        (`megapkl.parallel.batching.pad_multiple`)."""
        return 2 * self.context * (self.tensor if self.sequence_parallel else 1)

    def data_size(self, world_size: Optional[int]) -> Optional[int]:
        """The data-parallel size, or None while 'auto' and the world size is unknown."""
        if isinstance(self.data, int):
            return self.data
        if world_size is None or world_size % self.model_parallel_size:
            return None
        return world_size // self.model_parallel_size


@dataclass
class AdvantageConfig:
    """Per-response advantages from rewards (SPEC section 3)."""

    mode: Literal["group_mean", "group_std", "raw"] = "group_mean"  # PKL B.2 periodic refresh
    perturb_baseline: bool = False  # PKL C.1: add 1{max R > min R} after normalization
    filter_constant_groups: bool = False  # DAPO dynamic sampling: drop all-equal groups, refill
    std_eps: float = field(default=1e-5, metadata=rng(0.0, lo_open=True))  # PKL eq. A.2
    # Dynamic sampling gives up (and trains on a smaller batch) after this many refill rounds.
    max_fill_rounds: int = field(default=16, metadata=rng(1))


@dataclass
class ReferenceConfig:
    """The frozen proximal reference pi_k of SPEC section 1 (logp_prox).

    - snapshot: a copy of the learner taken every `refresh_every` (L) optimizer updates
      (PKL Table 4: L = 16 for Proximal KL, 32 for GRPO's proximal reference).
    - per_batch: recomputed at the start of each global batch and frozen for its minibatches
      (PKL C.2, controlled staleness).
    - behavior: coupled, logp_prox = logp_behav (classic PPO/GRPO).
    `refresh_every` only applies to snapshot; the resolved config clears it for the other modes so
    objective presets (which set L) compose with protocol presets (which set the mode).
    `kl_init` keeps the initial model for the KL-to-init term; unset, it follows
    `objective.kl_init_coef > 0`.
    """

    mode: Literal["snapshot", "per_batch", "behavior"] = "snapshot"
    refresh_every: Optional[int] = field(default=16, metadata=rng(1))
    kl_init: Optional[bool] = None

    def check(self, err) -> None:
        if self.mode == "snapshot" and self.refresh_every is None:
            err("reference.mode snapshot needs refresh_every (L, optimizer updates between "
                "reference refreshes; PKL uses 16)", "refresh_every", "mode")


@dataclass
class SGLangConfig:
    """SGLang rollout servers (used when rollout.engine is 'sglang')."""

    tp: int = field(default=1, metadata=rng(1))  # tensor parallel size of one engine
    ep: int = field(default=1, metadata=rng(1))  # expert parallel size inside an engine (MoE)
    num_engines: int = field(default=1, metadata=rng(1))
    # Engines share the trainer's GPUs; false gives them num_engines x tp GPUs of their own.
    colocate: bool = True
    router_policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = "cache_aware"
    mem_fraction_static: float = field(default=0.8, metadata=rng(0.0, 1.0, lo_open=True))
    base_port: int = field(default=30000, metadata=rng(1024, 65535))
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to the server launcher

    def check(self, err) -> None:
        if self.tp % self.ep:
            err(f"SGLang places expert parallelism inside the tensor-parallel group: sglang.ep "
                f"({self.ep}) must divide sglang.tp ({self.tp})", "ep", "tp")

    @property
    def gpus(self) -> int:
        return self.num_engines * self.tp


Protocol = Literal["on_policy", "periodic_refresh", "controlled_staleness", "uniform_stale"]
# Protocol defaults for rollout.refresh_every (N): periodic refresh syncs every 64 updates (PKL B.1);
# on-policy and controlled staleness push weights after every update; uniform stale draws snapshots.
DEFAULT_REFRESH_EVERY = {"periodic_refresh": 64, "on_policy": 1, "controlled_staleness": 1,
                         "uniform_stale": None}


@dataclass
class RolloutConfig:
    """How responses are generated, and how stale they may be (SPEC section 10).

    - on_policy: fresh rollouts from the current weights (zero staleness).
    - periodic_refresh: engine weights synced every `refresh_every` (N) updates (PKL B.1: 64).
    - controlled_staleness: lag at most `max_staleness` (k, PKL C: 4 or 16) versions.
    - uniform_stale: each rollout's lag drawn from Uniform{1..k} out of `snapshot_pool` recent
      snapshots (TETPO App. B: k = 32, pool 256).
    A batch is `prompts_per_batch` x `responses_per_prompt` responses split into
    `minibatches_per_batch` optimizer updates (PKL C.2: 4 for controlled staleness).
    """

    engine: Literal["embedded", "sglang"] = "sglang"
    protocol: Protocol = "periodic_refresh"
    refresh_every: Optional[int] = field(default=None, metadata=rng(1))
    max_staleness: Optional[int] = field(default=None, metadata=rng(0))
    snapshot_pool: int = field(default=256, metadata=rng(1))
    minibatches_per_batch: int = field(default=1, metadata=rng(1))
    prompts_per_batch: int = field(default=32, metadata=rng(1))  # PKL Table 4: 32 x 8
    responses_per_prompt: int = field(default=8, metadata=rng(1))  # G
    temperature: float = field(default=1.0, metadata=rng(0.0, lo_open=True))
    top_p: float = field(default=1.0, metadata=rng(0.0, 1.0, lo_open=True))
    top_k: int = field(default=-1, metadata=rng(-1))  # -1 = off
    max_prompt_len: int = field(default=1024, metadata=rng(1))  # PKL Table 4
    max_response_len: int = field(default=16384, metadata=rng(1))  # PKL Table 4
    fp8: bool = False  # FP8 W/A rollouts (PKL B.2), SGLang only
    kv_cache_dtype: Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2"] = "auto"
    topk_logprobs: Optional[int] = field(default=None, metadata=rng(0))  # SIS; unset: sis.top_k
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def check(self, err) -> None:
        self._check_protocol(err)
        if self.top_k == 0:
            err("must be -1 (off) or >= 1, got 0", "top_k")
        if self.prompts_per_batch % self.minibatches_per_batch:
            err(f"must divide rollout.prompts_per_batch ({self.prompts_per_batch}) so that every "
                f"optimizer minibatch holds whole prompt groups", "minibatches_per_batch",
                "prompts_per_batch")
        if self.fp8 and self.engine != "sglang":
            err("FP8 rollouts need rollout.engine: sglang (the embedded engine runs the trainer's "
                "dtype)", "fp8", "engine")
        if self.kv_cache_dtype.startswith("fp8") and self.engine != "sglang":
            err(f"{self.kv_cache_dtype} KV cache needs rollout.engine: sglang", "kv_cache_dtype",
                "engine")

    def _check_protocol(self, err) -> None:
        p, n, k = self.protocol, self.refresh_every, self.max_staleness
        if p == "periodic_refresh" and k is not None:
            err("max_staleness applies to protocols controlled_staleness and uniform_stale; with "
                "periodic_refresh the lag is set by rollout.refresh_every (set max_staleness: null)",
                "max_staleness", "protocol")
        if p == "on_policy" and k not in (None, 0):
            err(f"protocol on_policy means zero staleness, got max_staleness={k}", "max_staleness",
                "protocol")
        if p in ("on_policy", "controlled_staleness") and n not in (None, 1):
            err(f"protocol {p} pushes weights after every update; refresh_every must be 1 or null, "
                f"got {n}", "refresh_every", "protocol")
        # Controlled staleness allows k = 0 (PKL C: the zero-staleness runs still reuse each batch
        # for 4 minibatches); uniform staleness draws lags from Uniform{1..k}, so k >= 1.
        least = 0 if p == "controlled_staleness" else 1
        if p in ("controlled_staleness", "uniform_stale") and (k is None or k < least):
            err(f"protocol {p} needs max_staleness >= {least} (k; PKL C: 0, 4 or 16, TETPO: 32), got "
                f"{'null' if k is None else k}",
                "max_staleness", "protocol")
        if p == "uniform_stale":
            if n is not None:
                err("protocol uniform_stale draws engine weights from the snapshot pool; "
                    f"refresh_every must be null, got {n}", "refresh_every", "protocol")
            if k is not None and self.snapshot_pool < k:
                err(f"uniform_stale draws lags from 1..max_staleness ({k}), so snapshot_pool must "
                    f"be >= {k}, got {self.snapshot_pool}", "snapshot_pool", "max_staleness")

    @property
    def responses_per_batch(self) -> int:
        return self.prompts_per_batch * self.responses_per_prompt

    @property
    def responses_per_minibatch(self) -> int:
        return self.responses_per_batch // self.minibatches_per_batch

    def effective_refresh_every(self) -> Optional[int]:
        """N after protocol defaults (None: engines take weights from the snapshot pool)."""
        if self.protocol == "periodic_refresh" and self.refresh_every is not None:
            return self.refresh_every
        return DEFAULT_REFRESH_EVERY[self.protocol]

    def effective_max_staleness(self) -> Optional[int]:
        return 0 if self.protocol == "on_policy" else self.max_staleness
