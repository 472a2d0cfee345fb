"""Build a megatron-core `GPTModel` for a `ModelSpec` (Qwen3, Qwen3-MoE, Llama 3.x).

Which kernels run is one decision, `kernel_plan(cuda=..., te=..., ...)` (pure, tested on CPU):
- CUDA + Transformer Engine: TE's layer spec (fused norm+linear, flash/fused attention, TE's own
  ring attention for context parallelism, grouped expert GEMMs), fused RoPE, fused bias+SwiGLU
  and bias+dropout, gradient-accumulation fusion when apex's wgrad kernel is installed.
- CUDA without TE: megatron-core's local spec with torch SDPA attention
  (`megapkl.models.attention.SDPAttention`: the causal flash/mem-efficient kernels) and the
  jit-fused bias+SwiGLU / bias+dropout; context parallelism needs TE there.
- CPU: the local spec with every fusion off, megatron's attention at CP=1 and the project's
  all-gather CP attention (`megapkl.parallel.cp_attention`) at CP>1.
The local spec's norms are replaced by `QwenRMSNorm` below: megatron's torch norm refuses
sequence parallelism, and ours also computes exactly like the Hugging Face Qwen3 and Llama
RMSNorm (fp32 statistics, cast back before the weight). What differs between the families is
data of the spec (`spec.FAMILY`): QK norm, tied embeddings (megatron shares them across the
first and last pipeline stages), and the RoPE frequencies, which `megapkl.models.rope` sets as
transformers computes them.

Precision: `dtype="bf16"` builds bf16 parameters; the optimizer keeps fp32 main weights and the
DDP buffers fp32 gradients (`megapkl.models.optimizer`); log-probs are computed in fp32 from the
bf16 logits (`megapkl.parallel.vocab`).

Parallel sizes come from megatron's `parallel_state` (initialised by
`megapkl.parallel.groups.init_parallel`) and are checked against the architecture first
(`spec.check_layout`), so a bad layout fails naming the key instead of deep in megatron.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, List, Optional

import torch

from megapkl.parallel.chunks import unwrap  # noqa: F401  (re-exported: provider.unwrap)

from megapkl.models.spec import ModelSpec, SpecError, check_layout

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How to build (not what to build): precision, parallel features, kernels."""

    dtype: str = "fp32"  # "fp32" | "bf16" parameters (fp32 main weights live in the optimizer)
    sequence_parallel: bool = False
    use_te: Optional[bool] = None  # None: Transformer Engine when it imports and CUDA is present
    routing_replay: bool = False  # MoE: enable megatron's RouterReplay (R3)
    recompute: str = "none"  # "none" | "selective" | "full"
    moe_dispatcher: Optional[str] = None  # None: allgather on CPU, alltoall on GPU
    virtual_pipeline: Optional[int] = None  # model chunks per pipeline stage
    parallel_output: bool = True  # logits stay vocab-sharded over TP (for a vocab-parallel loss)
    # megatron's per-token-loss semantics: the RL loss returns (N * loss, tokens) per micro-batch and
    # megatron divides by the summed token count (megapkl.parallel.megatron_loss explains why).
    per_token_loss: bool = False
    packed_sequences: bool = False  # THD micro-batches (parallel.packing: thd) reach the attention

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise SpecError(f"recompute: must be none|selective|full, got {self.recompute!r}")


def options_from_config(model_cfg: Any, parallel_cfg: Any) -> ModelOptions:
    """ModelOptions from the run config's `model` and `parallel` sections."""
    return ModelOptions(
        per_token_loss=True,  # the trainer's policy loss (megapkl.parallel.megatron_loss)
        dtype=model_cfg.dtype,
        sequence_parallel=parallel_cfg.sequence_parallel,
        routing_replay=model_cfg.routing_replay,
        recompute=model_cfg.recompute,
        packed_sequences=parallel_cfg.packing == "thd",
        virtual_pipeline=parallel_cfg.virtual_pipeline,
    )


@functools.lru_cache(maxsize=1)
def te_import_error() -> Optional[str]:
    """None when `transformer_engine.pytorch` imports, else why not (`Type: message`, one line).
    A broken install (an extension built for another torch, missing CUDA libraries) fails here
    with a message that names the cause; it is kept so that nothing reports it as merely absent."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure: the message is the diagnosis
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}" if first else type(e).__name__
    return None


@functools.lru_cache(maxsize=2)
def te_available(cuda: Optional[bool] = None) -> bool:
    """Transformer Engine importable and a GPU present (its kernels are CUDA-only). On a CUDA
    machine an import failure is logged once, one line naming the cause: the models then fall
    back to megatron-core's local spec, which is slower, and must not do so unnoticed."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return False
    error = te_import_error()
    if error is not None:
        log.warning("Transformer Engine does not import on this CUDA machine (%s): the model uses "
                    "megatron-core's local layer spec without TE's fused kernels, and "
                    "parallel.context > 1 is refused; docs/install.md installs it", error)
        return False
    return True


@functools.lru_cache(maxsize=1)
def fused_wgrad_available() -> bool:
    """apex's `fused_weight_gradient_mlp_cuda`: megatron's own linear layers (the output layer
    even under the TE spec) refuse gradient-accumulation fusion without it."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Which layer spec, attention and fused kernels a model is built with."""

    layer_spec: str  # "te" | "local"
    attention: str  # "te" (flash/fused, ring CP) | "sdpa" (torch SDPA) | "megatron_or_allgather"
    bias_activation_fusion: bool = False  # fused (bias+)SwiGLU
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False  # TE's fused RoPE kernel
    gradient_accumulation_fusion: bool = False  # wgrad GEMM accumulates into fp32 main_grad
    moe_grouped_gemm: bool = False
    cp_comm_type: Optional[str] = None  # TE's CP attention: "p2p" = ring

    @property
    def use_te(self) -> bool:
        return self.layer_spec == "te"

    def config_flags(self) -> dict[str, Any]:
        """The TransformerConfig fields this plan sets."""
        return dict(
            bias_activation_fusion=self.bias_activation_fusion,
            bias_dropout_fusion=self.bias_dropout_fusion,
            apply_rope_fusion=self.apply_rope_fusion,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            masked_softmax_fusion=False,  # only megatron's unfused attention reads it (CPU path)
            persist_layer_norm=False,  # apex LayerNorm only; Qwen uses RMSNorm
            cp_comm_type=self.cp_comm_type,
        )


def kernel_plan(*, cuda: bool, te: bool, use_te: Optional[bool] = None, cp: int = 1,
                fused_wgrad: bool = False, te_error: Optional[str] = None) -> KernelPlan:
    """The kernels for a machine: `cuda` (a GPU is present), `te` (Transformer Engine imports),
    `use_te` (ModelOptions.use_te: None = TE when available), `cp` (context-parallel size),
    `fused_wgrad` (apex's wgrad-accumulation kernel imports), `te_error` (why TE does not
    import, `te_import_error()`: named in the refusals). Pure: tested without a GPU."""
    why = f": it does not import here ({te_error}); see docs/install.md" if te_error else ""
    if use_te and not (cuda and te):
        raise SpecError("use_te: Transformer Engine was requested but does not import (or no GPU)"
                        + why)
    if cuda and te and use_te is not False:
        return KernelPlan(layer_spec="te", attention="te", bias_activation_fusion=True,
                          bias_dropout_fusion=True, apply_rope_fusion=True,
                          gradient_accumulation_fusion=fused_wgrad, moe_grouped_gemm=True,
                          cp_comm_type="p2p" if cp > 1 else None)
    if cuda:
        if cp > 1:
            raise SpecError(f"parallel.context ({cp}) > 1 on GPU needs Transformer Engine (its ring "
                            "attention); the all-gather CP attention is the CPU path only" + why)
        # jit-fused SwiGLU / bias-dropout need no TE; RoPE and wgrad fusion do.
        return KernelPlan(layer_spec="local", attention="sdpa", bias_activation_fusion=True,
                          bias_dropout_fusion=True)
    return KernelPlan(layer_spec="local", attention="megatron_or_allgather")


def plan_for(opts: "ModelOptions", cp: int = 1) -> KernelPlan:
    """`kernel_plan` for this machine."""
    cuda = torch.cuda.is_available()
    te = te_available(cuda)
    return kernel_plan(cuda=cuda, te=te, use_te=opts.use_te, cp=cp,
                       fused_wgrad=cuda and fused_wgrad_available(),
                       te_error=None if te or not cuda else te_import_error())


def recompute_flags(recompute: str, num_layers: int) -> dict[str, Any]:
    """megatron's activation-recompute fields for `model.recompute`.

    selective: the attention core only (megatron's default module list), the cheap-to-recompute,
    memory-heavy part. full: every layer's input is kept and the whole layer recomputed in
    backward (uniform method, one layer per checkpoint)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective")
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)
    raise SpecError(f"recompute: must be none|selective|full, got {recompute!r}")


def check_dtype_on_this_machine(model_cfg: Any) -> None:
    """Refuse `model.dtype: bf16` (a ConfigError naming the key) when this machine's GPU has no
    bf16; the trainer calls it before any process group starts."""
    from megapkl.config import ConfigError
    from megapkl.config.sections import bf16_gpu_error

    if model_cfg.dtype != "bf16":
        return
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    problem = bf16_gpu_error(capability)
    if problem:
        raise ConfigError(problem, "model.dtype")


def engine_placement(dtype: str) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the embedded rollout engine's weights for a `model.dtype`: this rank's
    GPU in the model's dtype (what SGLang would run), else the CPU in fp32 (CPU bf16 inference is
    slow, and bf16 weights upcast exactly, so rollouts still come from the trained weights)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), DTYPES[dtype]
    return torch.device("cpu"), torch.float32


# ------------------------------------------------------------------ parallel sizes


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    pp_rank: int = 0


def sizes_from_megatron(pg_collection: Any = None) -> ParallelSizes:
    """The layout of megatron's `ProcessGroupCollection` (`ParallelGroups.pg_collection`), or
    of its parallel_state when none is given."""
    if pg_collection is not None:
        import torch.distributed as dist

        pgc, n = pg_collection, dist.get_world_size
        return ParallelSizes(tp=n(pgc.tp), pp=n(pgc.pp), ep=n(pgc.ep), etp=n(pgc.expt_tp),
                             cp=n(pgc.cp), pp_rank=dist.get_rank(pgc.pp))
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron model parallel is not initialized: call "
                           "megapkl.parallel.groups.init_parallel(...) first")
    return ParallelSizes(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
    )


# ------------------------------------------------------------------ config


def transformer_config(spec: ModelSpec, opts: ModelOptions = ModelOptions(),
                       sizes: Optional[ParallelSizes] = None, plan: Optional[KernelPlan] = None):
    """The megatron `TransformerConfig` for `spec` under `sizes` (default: megatron's state)
    with the kernels of `plan` (default: this machine's `plan_for(opts)`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    sizes = sizes or sizes_from_megatron()
    check_layout(spec, tp=sizes.tp, pp=sizes.pp, ep=sizes.ep, etp=sizes.etp, cp=sizes.cp,
                 vpp=opts.virtual_pipeline, sequence_parallel=opts.sequence_parallel)
    plan = plan or plan_for(opts, sizes.cp)
    return TransformerConfig(**config_kwargs(spec, opts, sizes, plan,
                                             on_gpu=torch.cuda.is_available()))


def config_kwargs(spec: ModelSpec, opts: ModelOptions, sizes: ParallelSizes, plan: KernelPlan,
                  on_gpu: bool) -> dict[str, Any]:
    """The TransformerConfig arguments (pure: no megatron state, no device query)."""
    dtype = DTYPES[opts.dtype]
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=spec.qk_layernorm,
        gated_linear_unit=True,  # SwiGLU: fc1 = [gate; up]
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,  # RL post-training: deterministic forwards (logp must be reproducible)
        attention_dropout=0.0,
        init_method_std=spec.init_method_std,
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=opts.virtual_pipeline,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        sequence_parallel=opts.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Fused kernels where the machine has them (kernel_plan); the torch paths compute the
        # same thing on CPU.
        **plan.config_flags(),
        calculate_per_token_loss=opts.per_token_loss,
        # On gloo, batched p2p gives wrong results with interleaved pipelines (see notes).
        batch_p2p_comm=on_gpu,
    )
    kwargs.update(recompute_flags(opts.recompute, spec.num_layers))
    if spec.is_moe:
        kwargs.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            # HF norm_topk_prob=True: top-k of the logits, softmax over those k (= renormalised
            # softmax). False: softmax over all experts, then top-k without renormalising.
            moe_router_pre_softmax=not spec.moe_norm_topk_prob,
            moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
            moe_router_dtype="fp32",  # routing decisions must not flip with BF16 rounding
            moe_token_dispatcher_type=opts.moe_dispatcher or ("alltoall" if on_gpu
                                                              else "allgather"),
            moe_grouped_gemm=plan.moe_grouped_gemm,
            moe_enable_routing_replay=opts.routing_replay,
            moe_permute_fusion=False,
        )
    elif opts.routing_replay:
        raise SpecError(f"{spec.name}: routing_replay needs an MoE model, this one is dense")
    return kwargs


# ------------------------------------------------------------------ layer specs


class QwenRMSNorm(torch.nn.Module):
    """Qwen3's RMSNorm (statistics in fp32, normalised value cast back, then the weight).

    Accepts megatron's `build_module(config=..., hidden_size=..., eps=...)` call. Under
    sequence parallelism each rank sees a slice of the sequence, so the weight is tagged
    `sequence_parallel` and megatron's finalize_model_grads sums its gradient over TP.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_param_device()))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 input: no casts (each is a no-op call, 9 norms per micro-batch on the tiny model)
        if x.dtype == torch.float32:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _param_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _replace_norms(spec: Any, old: type, new: type) -> Any:
    """Copy of a ModuleSpec tree with every `old` module class swapped for `new`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            return dataclasses.replace(spec, module=new)
        if spec.submodules is None:
            return spec
        return dataclasses.replace(spec, submodules=_replace_norms(spec.submodules, old, new))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace_norms(getattr(spec, f.name), old, new)
                   for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def layer_spec(spec: ModelSpec, config: Any, use_te: bool, attention: Optional[str] = None,
               packed: bool = False):
    """The transformer-layer ModuleSpec (TE or local) for one decoder layer; `attention` is
    `KernelPlan.attention` ("sdpa": torch SDPA core attention in the local spec); `packed`: THD
    rows (the local path then needs the project's block-diagonal attention)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    num_experts = spec.num_experts if spec.is_moe else None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=spec.qk_layernorm)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    local = specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_layernorm,
        normalization="RMSNorm")
    if attention == "sdpa":  # GPU without TE: torch's flash / memory-efficient kernels
        from megapkl.models.attention import SDPAttention
        from megapkl.parallel.cp_attention import replace_core_attention

        local = replace_core_attention(local, SDPAttention)
        return _replace_norms(local, WrappedTorchNorm, QwenRMSNorm)
    # megatron's local attention refuses CP and packed (THD) sequences; ours all-gathers K/V
    # over the CP group and is block-diagonal causal on packed rows (CPU path).
    from megapkl.parallel.cp_attention import local_spec_attention

    local = local_spec_attention(local, cp_size=config.context_parallel_size, packed=packed)
    return _replace_norms(local, WrappedTorchNorm, QwenRMSNorm)


def block_spec(spec: ModelSpec, config: Any, use_te: bool, vp_stage: Optional[int],
               pp_rank: int, attention: Optional[str] = None, packed: bool = False):
    """Decoder block spec: the layer spec repeated for this stage, plus the final norm."""
    if use_te:
        return layer_spec(spec, config, use_te)  # the block picks TE's norm for the final layer
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules, get_num_layers_to_build)

    layer = layer_spec(spec, config, use_te, attention, packed)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=QwenRMSNorm)


# ------------------------------------------------------------------ models


def build_model(spec: ModelSpec, opts: ModelOptions = ModelOptions(), *,
                vp_stage: Optional[int] = None, config: Any = None,
                plan: Optional[KernelPlan] = None, pg_collection: Any = None):
    """One megatron `GPTModel` chunk for this rank's pipeline stage (and virtual stage).

    Weights are megatron's random init (seeded by `init_parallel(seed=...)`); load a
    Hugging Face checkpoint with `megapkl.models.hf.load_hf_weights`. `plan` (default: this
    machine's) must be the one `config` was made with.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    sizes = sizes_from_megatron(pg_collection)
    plan = plan or plan_for(opts, sizes.cp)
    config = config or transformer_config(spec, opts, sizes, plan)
    vpp = opts.virtual_pipeline
    first = sizes.pp_rank == 0 and (vpp is None or is_vp_first_stage(vp_stage, vpp))
    last = sizes.pp_rank == sizes.pp - 1 and (vpp is None or is_vp_last_stage(vp_stage, vpp))
    from megapkl.models.rope import megatron_rope_args, set_rotary

    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(spec, config, plan.use_te, vp_stage, sizes.pp_rank,
                                          plan.attention, opts.packed_sequences),
        vocab_size=spec.padded_vocab_size(sizes.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=first,
        post_process=last,
        parallel_output=opts.parallel_output,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        **megatron_rope_args(spec),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    set_rotary(model, spec)  # every llama3 parameter, not only the ones megatron takes
    model.megapkl_spec = spec  # the HF mapping and exporters read it back from the model
    return model


def build_model_chunks(spec: ModelSpec, opts: ModelOptions = ModelOptions(),
                       pg_collection: Any = None) -> List[Any]:
    """All model chunks of this rank: one, or `virtual_pipeline` for an interleaved pipeline.
    `pg_collection` (`ParallelGroups.pg_collection`): megatron's explicit process groups."""
    sizes = sizes_from_megatron(pg_collection)
    config = transformer_config(spec, opts, sizes)
    if opts.virtual_pipeline is None:
        return [build_model(spec, opts, config=config, pg_collection=pg_collection)]
    return [build_model(spec, opts, vp_stage=i, config=config, pg_collection=pg_collection)
            for i in range(opts.virtual_pipeline)]


