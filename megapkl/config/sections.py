"""Run-config sections for the model, its parallel layout and the RL algorithm around the objective.

Each section is a dataclass read by `typed.build`: unknown keys, wrong types and out-of-range values
are errors naming the dotted key. `check(err)` holds the rules that involve only the section's own
fields; rules spanning sections live in `megapkl.config.run`. Defaults are the paper settings of
the Proximal KL paper's (Appendix B: periodic refresh) unless a comment says otherwise.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from megapkl.config.typed import rng

# Model names that denote a mixture-of-experts model: an explicit "moe" or Qwen's "<total>b-a<active>b".
_MOE_NAME = re.compile(r"moe|\d+(\.\d+)?b-a\d+(\.\d+)?b", re.IGNORECASE)


# GPUs without bf16 arithmetic (compute capability < 8.0), as Slurm constraints name them.
_NO_BF16_GPU = re.compile(r"(?<![a-z0-9])(v100|p100|p40|p4|t4|k80|k40|m60|titan-?v|rtx-?20\d0|"
                          r"gtx-?1\d\d0)(?![a-z0-9])", re.IGNORECASE)


def bf16_gpu_error(capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why model.dtype bf16 cannot run on a GPU of this compute capability (None: no GPU, where
    torch's CPU bf16 kernels run), or None when it can."""
    if capability is None or tuple(capability) >= (8, 0):
        return None
    major, minor = capability
    return (f"bf16 needs a GPU of compute capability >= 8.0 (A100, H100 or newer), this one has "
            f"{major}.{minor}; set model.dtype: fp32")


def bf16_constraint_error(constraint: Optional[str]) -> Optional[str]:
    """Why bf16 cannot run on the GPUs a Slurm constraint names (V100, T4, ...), or None."""
    found = _NO_BF16_GPU.search(constraint or "")
    if not found:
        return None
    return (f"bf16 needs Ampere or newer GPUs, but slurm.constraint '{constraint}' selects "
            f"{found.group(0)} (no bf16); set model.dtype: fp32 or choose other GPUs")


@dataclass
class ModelConfig:
    """Which policy model to train.

    `name` selects a provider (e.g. 'qwen3-1.7b', 'llama3.2-3b-instruct', 'tiny-qwen3'); the
    model room owns the list, so the config accepts any non-empty name. `arch` is a free mapping
    of architecture overrides handed to that provider unchanged; the few fields the config itself
    must reason about (layers for pipeline splits, experts for expert parallelism) are typed.
    """

    # configs/models/<name>.yaml (architecture); qwen3-{1.7b,4b,8b,32b,30b-a3b},
    # llama3.2-3b-instruct, tiny-qwen3(-moe), tiny-llama
    name: str = "qwen3-1.7b"
    # Hugging Face checkpoint directory to start from (null: random init). Never downloaded: a Hub
    # id is refused by config validate, plan, submit and train; `hf download` it first.
    hf_checkpoint: Optional[str] = None
    tokenizer: Optional[str] = None  # tokenizer directory; unset: hf_checkpoint's
    # PKL B.2: BF16 optimization (bf16 weights, fp32 main weights/grads in the optimizer, fp32
    # log-probs). The default for GPU runs; the CPU demo and tests use fp32 (exact comparisons,
    # and CPU bf16 matmuls are slower than fp32 ones). Needs Ampere+ on GPU (checked).
    dtype: Literal["bf16", "fp32"] = "bf16"
    num_layers: Optional[int] = field(default=None, metadata=rng(1))  # overrides the model YAML
    hidden_size: Optional[int] = field(default=None, metadata=rng(1))  # overrides the model YAML
    # MoE experts; overrides the model YAML
    num_experts: Optional[int] = field(default=None, metadata=rng(1))
    # any other key of the model YAML, overridden
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
    """Megatron-core parallel layout of the trainer. The loss is partition invariant
    (docs/parallelism.md): these change speed and memory, never the result.

    `data` may be 'auto': the data-parallel size is then the trainer world size divided by
    tensor x pipeline x context, resolved as soon as the world size is known (slurm nodes x GPUs).
    """

    tensor: int = field(default=1, metadata=rng(1))  # tensor parallel size (divides heads)
    pipeline: int = field(default=1, metadata=rng(1))  # pipeline stages (divides the layers)
    context: int = field(default=1, metadata=rng(1))  # context parallel size (splits sequences)
    # expert parallel size (MoE; divides data x context)
    expert: int = field(default=1, metadata=rng(1))
    # data-parallel size; data x tensor x pipeline x context = the trainer's world size
    data: Union[int, Literal["auto"]] = field(default="auto", metadata=rng(1))
    sequence_parallel: bool = False  # split activations over the tensor-parallel group
    virtual_pipeline: Optional[int] = field(default=None, metadata=rng(2))  # interleaved stages
    micro_batch_size: int = field(default=1, metadata=rng(1))  # responses per micro-batch per rank
    # Token-balanced micro-batches: when set, responses are packed by this budget of padded
    # tokens per micro-batch (first-fit decreasing; prompt + response, rounded to the CP/SP
    # multiple; one-row layout: rows x the longest) instead of micro_batch_size responses, and
    # every DP rank runs the same number of micro-batches.
    max_tokens_per_micro_batch: Optional[int] = field(default=None, metadata=rng(1))
    distributed_optimizer: bool = True  # shard the optimizer state over data-parallel ranks
    # How responses share micro-batch rows: "none" = one right-padded row per response (BSHD);
    # "thd" = all responses of a micro-batch packed into one row with cu_seqlens (no padding
    # between responses beyond 2*cp multiples; megapkl.parallel.batching.pack_thd).
    packing: Literal["none", "thd"] = "none"
    # torch's CPU threads per rank (intra-op, MKL included); null = the launcher's: the CPUs
    # divided by the ranks locally, SLURM_CPUS_PER_TASK under Slurm. A small model's operators
    # are too small to split: the CPU demo's updates take as long on one thread as on two, at
    # half the CPU time.
    cpu_threads: Optional[int] = field(default=None, metadata=rng(1))

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
    """Per-response advantages from rewards (docs/objectives.md)."""

    # group_mean: reward minus its prompt group's mean (PKL B.2 periodic refresh); group_std: also
    # divided by the group's std; raw: the reward itself
    mode: Literal["group_mean", "group_std", "raw"] = "group_mean"
    perturb_baseline: bool = False  # PKL C.1: add 1{max R > min R} after normalization
    filter_constant_groups: bool = False  # DAPO dynamic sampling: drop all-equal groups, refill
    std_eps: float = field(default=1e-5, metadata=rng(0.0, lo_open=True))  # PKL eq. A.2
    # Dynamic sampling draws at most this many rounds of prompts to fill a batch, then stops the
    # run with an error naming this key (the task is too easy or too hard for the policy).
    max_fill_rounds: int = field(default=64, metadata=rng(1, 64))


@dataclass
class ReferenceConfig:
    """The frozen proximal reference pi_k (logp_prox of docs/objectives.md).

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

    mode: Literal["snapshot", "per_batch", "behavior"] = "snapshot"  # see above
    refresh_every: Optional[int] = field(default=16, metadata=rng(1))  # L, snapshot mode only
    kl_init: Optional[bool] = None  # keep the initial model; unset: objective.kl_init_coef > 0

    def check(self, err) -> None:
        if self.mode == "snapshot" and self.refresh_every is None:
            err("reference.mode snapshot needs refresh_every (L, optimizer updates between "
                "reference refreshes; PKL uses 16)", "refresh_every", "mode")


@dataclass
class SGLangConfig:
    """SGLang rollout servers (used when rollout.engine is 'sglang')."""

    tp: int = field(default=1, metadata=rng(1))  # tensor parallel size of one engine
    ep: int = field(default=1, metadata=rng(1))  # expert parallel size inside an engine (MoE)
    # Servers per data-parallel replica of the trainer (colocated: spread evenly over the nodes
    # the replica trains on, each node's servers run and refreshed by that node's first rank).
    num_engines: int = field(default=1, metadata=rng(1))
    # Engines share their replica's GPUs; false gives each replica num_engines x tp GPUs of its own.
    colocate: bool = True
    # Colocated: a fleet on every node of a replica (false: all num_engines on its leader's node,
    # the other nodes' GPUs generate nothing).
    every_node: bool = True
    # sglang-router
    router_policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = "cache_aware"
    # GPU memory fraction SGLang reserves for weights and KV cache (its --mem-fraction-static)
    mem_fraction_static: float = field(default=0.8, metadata=rng(0.0, 1.0, lo_open=True))
    base_port: int = field(default=30000, metadata=rng(1024, 65535))  # first port tried for servers
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to the server launcher
    # Servers someone else started: their base URLs (and optionally their router); nothing is
    # launched then. Empty: megapkl launches num_engines servers (+ sglang-router if use_router).
    urls: list[str] = field(default_factory=list)
    router_url: Optional[str] = None  # with urls: their router
    use_router: bool = True  # launch sglang-router in front of the launched servers
    host: str = "127.0.0.1"  # address launched servers bind to (never beyond loopback unless set)
    # Testing / CPU option: the server command instead of `python -m sglang.launch_server ...`,
    # e.g. [megapkl, serve, --model, "{model_path}", --port, "{port}"] (placeholders: model_path,
    # host, port, tp, ep, python). router_command replaces `python -m sglang_router.launch_router`.
    server_command: list[str] = field(default_factory=list)
    router_command: list[str] = field(default_factory=list)  # see server_command
    # servers' --context-length
    context_length: Optional[int] = field(default=None, metadata=rng(1))
    # Weight sync trainer -> servers: tensor (same host), distributed (torch.distributed
    # broadcast: NCCL on GPUs, gloo on CPU), disk (safetensors export in the run directory).
    weight_sync: Literal["tensor", "distributed", "disk"] = "tensor"
    # weights per sync message
    bucket_mb: float = field(default=512.0, metadata=rng(0.0, lo_open=True))
    # what running requests do during a weight sync (SGLang's pause_generation mode)
    pause_mode: Literal["retract", "abort", "in_place"] = "retract"
    sync_timeout_s: float = field(default=600.0, metadata=rng(0.0, lo_open=True))  # one weight sync
    # Requests and fault tolerance.
    # requests in flight at once (client threads)
    max_concurrency: int = field(default=256, metadata=rng(1))
    # one /generate
    request_timeout_s: float = field(default=3600.0, metadata=rng(0.0, lo_open=True))
    max_retries: int = field(default=3, metadata=rng(0))  # of a failed prompt group
    health_first_wait_s: float = field(default=0.0, metadata=rng(0.0))  # before the first probe
    # between probes
    health_interval_s: float = field(default=10.0, metadata=rng(0.0, lo_open=True))
    health_timeout_s: float = field(default=30.0, metadata=rng(0.0, lo_open=True))  # one probe
    health_max_failures: int = field(default=2, metadata=rng(1))  # failed probes: a server is down
    # until healthy
    startup_timeout_s: float = field(default=900.0, metadata=rng(0.0, lo_open=True))
    # until healthy, the first start of FP8 servers whose DeepGEMM kernel cache is cold (SGLang
    # precompiles the block-FP8 GEMMs then: "typically 10-20 mins"; docs/engines.md)
    compile_timeout_s: float = field(default=3600.0, metadata=rng(0.0, lo_open=True))
    # a batch with no healthy server for this long stops the run (checkpointed, resumable)
    no_engine_timeout_s: float = field(default=600.0, metadata=rng(0.0, lo_open=True))
    max_restarts: int = field(default=3, metadata=rng(0))  # of a launched server that died

    def check(self, err) -> None:
        if self.tp % self.ep:
            err(f"SGLang places expert parallelism inside the tensor-parallel group: sglang.ep "
                f"({self.ep}) must divide sglang.tp ({self.tp})", "ep", "tp")
        for i, u in enumerate(self.urls + ([self.router_url] if self.router_url else [])):
            if not u.startswith(("http://", "https://")):
                err(f"'{u}' is not an http(s) URL", "router_url" if u == self.router_url
                    else f"urls[{i}]")
        if self.router_url and not self.urls:
            err("router_url needs the workers' urls too (weights go to every worker directly)",
                "router_url", "urls")

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
    """How responses are generated, and how stale they may be (the training protocols).

    - on_policy: fresh rollouts from the current weights (zero staleness).
    - periodic_refresh: engine weights synced every `refresh_every` (N) updates (PKL B.1: 64).
    - controlled_staleness: lag at most `max_staleness` (k, PKL C: 4 or 16) versions.
    - uniform_stale: each rollout's lag drawn from Uniform{1..k} out of `snapshot_pool` recent
      snapshots (TETPO App. B: k = 32, pool 256).
    A batch is `prompts_per_batch` x `responses_per_prompt` responses split into
    `minibatches_per_batch` optimizer updates (PKL C.2: 4 for controlled staleness).
    """

    engine: Literal["embedded", "sglang"] = "sglang"  # docs/engines.md
    protocol: Protocol = "periodic_refresh"  # see above
    # N: updates between weight pushes to the engines; unset: 64 (periodic_refresh), 1 (on_policy,
    # controlled_staleness), none (uniform_stale)
    refresh_every: Optional[int] = field(default=None, metadata=rng(1))
    # k: the most versions a rollout may lag (controlled_staleness, uniform_stale); on_policy: 0
    max_staleness: Optional[int] = field(default=None, metadata=rng(0))
    snapshot_pool: int = field(default=256, metadata=rng(1))  # policy versions kept at most
    minibatches_per_batch: int = field(default=1, metadata=rng(1))  # optimizer updates per batch
    prompts_per_batch: int = field(default=32, metadata=rng(1))  # PKL Table 4: 32 x 8
    responses_per_prompt: int = field(default=8, metadata=rng(1))  # G
    temperature: float = field(default=1.0, metadata=rng(0.0, lo_open=True))  # sampling
    top_p: float = field(default=1.0, metadata=rng(0.0, 1.0, lo_open=True))  # nucleus sampling
    top_k: int = field(default=-1, metadata=rng(-1))  # -1 = off
    # PKL Table 4; longer prompts are left out of the training data
    max_prompt_len: int = field(default=1024, metadata=rng(1))
    max_response_len: int = field(default=16384, metadata=rng(1))  # PKL Table 4
    fp8: bool = False  # block-FP8 weight rollouts (PKL B.2); embedded: dequantized FP8 weights
    kv_cache_dtype: Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2"] = "auto"  # auto: engine dtype
    topk_logprobs: Optional[int] = field(default=None, metadata=rng(0))  # SIS; unset: sis.top_k
    # Asynchronous rollouts: up to this many upcoming batches are generated (each with exactly the
    # policy version the schedule names, once it is published) while the trainer trains; 0 is
    # synchronous. The result is the synchronous run's. Needs servers off the trainer's GPUs.
    async_batches: int = field(default=0, metadata=rng(0))
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def check(self, err) -> None:
        self._check_protocol(err)
        if self.top_k == 0:
            err("must be -1 (off) or >= 1, got 0", "top_k")
        if self.prompts_per_batch % self.minibatches_per_batch:
            err(f"must divide rollout.prompts_per_batch ({self.prompts_per_batch}) so that every "
                f"optimizer minibatch holds whole prompt groups", "minibatches_per_batch",
                "prompts_per_batch")
        if self.async_batches and (self.engine != "sglang" or self.sglang.colocate):
            err("generating while the trainer trains needs an engine off the trainer's process and "
                "GPUs: rollout.engine: sglang with rollout.sglang.colocate: false (or set 0)",
                "async_batches", "engine", "sglang.colocate")
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
