"""Helpers for the model-level partition-invariance tests (run inside forked gloo ranks).

A tiny fp32 megatron-core GPTModel (local spec, RMSNorm, SwiGLU, RoPE, GQA 4 heads / 2 groups;
`llama=True`: Llama's tied embedding / output layer, shared across pipeline stages, and llama3
RoPE scaling with every band in use, `megapkl.models.rope`),
a fixed minibatch of 12 responses in 3 groups of 4 with very different prompt and response
lengths, six of them multi-turn (observation tokens fed but not trained on, `OBSERVATIONS`), the single-process reference (megatron's own DotProductAttention, plain log_softmax,
`policy_loss` on the whole minibatch, plain autograd) and the distributed run (our CP attention,
megatron DDP + schedules + finalize_model_grads, `megapkl.parallel.megatron_loss`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, EXPERTS = 64, 32, 4, 2, 64, 2, 4
TEMPERATURE, TOPK, SEED = 0.8, 4, 1234
# (prompt length, response length) per uid; group = uid // 4. uid 3 has a 1-token prompt and the
# longest response, uid 5 a 1-token response; uids 0 and 4 together leave one CP=2 rank without
# any action token (labels only in chunks 0 and 3).
LENGTHS = [(3, 2), (5, 30), (12, 17), (1, 45), (30, 4), (8, 1), (20, 25), (2, 9), (15, 33), (6, 12),
           (25, 20), (9, 6)]
# Data-parallel placement: interleaved so every prompt group is torn across DP ranks and
# micro-batches (DP rank d takes ORDER[d * 12/dp : ...], micro-batches are contiguous in that).
ORDER = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
# Multi-turn responses: observation spans [start, end) in response positions (tokens the model is
# fed but never trained on). uid 8's 15-token observation is cut by the CP=2 split (part on each
# rank, one-row layout); uid 3
# has three; uid 10 one of a single token; uid 11 keeps 2 action tokens around one of 4.
OBSERVATIONS = {1: [(6, 14)], 3: [(4, 12), (20, 23), (30, 41)], 6: [(1, 3)], 8: [(10, 25)],
                10: [(10, 11)], 11: [(1, 5)]}


def segments_of(uid, length):
    """The Sample segments of response `uid` (None: single-turn)."""
    from megapkl.rollout.sample import ACTION, OBSERVATION, Segment

    spans = OBSERVATIONS.get(uid)
    if not spans:
        return None
    out, at = [], 0
    for a, b in spans:
        out += [Segment(ACTION, a - at), Segment(OBSERVATION, b - a, source="tool")]
        at = b
    return tuple(out + [Segment(ACTION, length - at)])


def action_mask(uid, length):
    mask = torch.ones(length, dtype=torch.bool)
    for a, b in OBSERVATIONS.get(uid, ()):
        mask[a:b] = False
    return mask


def llama_spec():
    """The harness model as a Llama ModelSpec (megapkl.models.spec): its RoPE frequencies."""
    from megapkl.models.spec import ModelSpec, validate

    return validate(ModelSpec(
        name="partition-llama", family="llama", vocab_size=VOCAB, hidden_size=HIDDEN,
        num_layers=LAYERS, num_attention_heads=HEADS, num_query_groups=GROUPS,
        head_dim=HIDDEN // HEADS, ffn_hidden_size=FFN, qk_layernorm=False, rope_theta=100.0,
        rope_type="llama3", rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_position_embeddings=32,
        tie_word_embeddings=True, max_position_embeddings=128))


def model_config(tp=1, pp=1, cp=1, sp=False, ep=0):
    """ep=0: dense; ep >= 1: MoE with EXPERTS experts (top-2, no auxiliary loss, dropless)
    over `ep` expert-parallel ranks with megatron's all-gather token dispatcher."""
    from megatron.core.transformer import TransformerConfig

    moe = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN // 2,
               moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
               moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
               moe_grouped_gemm=False) if ep else {}
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        sequence_parallel=sp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True, **moe)


def block_spec(config, cp=1, packed=False, moe=False, megatron_attention=False):
    """megatron's local spec with the core attention the provider picks for this layout
    (`local_spec_attention`; with `megatron_attention` megatron's own DotProductAttention) and
    the provider's Qwen RMSNorm (sequence-parallel aware)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megapkl.models.provider import QwenRMSNorm, _replace_norms
    from megapkl.parallel.cp_attention import local_spec_attention

    layer = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None, normalization="RMSNorm")
    if not megatron_attention:
        layer = local_spec_attention(layer, cp_size=cp, packed=packed)
    layer = _replace_norms(layer, WrappedTorchNorm, QwenRMSNorm)
    count = LAYERS // config.pipeline_model_parallel_size
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=QwenRMSNorm)


def gpt(config, spec, pre=True, post=True, llama=False):
    from megatron.core.models.gpt import GPTModel

    if not llama:
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=128,
                        position_embedding_type="rope", pre_process=pre, post_process=post)
    from megapkl.models.rope import megatron_rope_args, set_rotary

    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=128, pre_process=pre,
                     post_process=post, share_embeddings_and_output_weights=True,
                     **megatron_rope_args(llama_spec()))
    set_rotary(model, llama_spec())
    return model


def reference_model(moe=False, llama=False):
    """Single process, megatron's own local attention (the CP module is checked against it)."""
    from megapkl.parallel.groups import init_parallel

    init_parallel(seed=SEED)
    config = model_config(ep=1 if moe else 0)
    return gpt(config, block_spec(config, moe=moe, megatron_attention=True), llama=llama)


# ----------------------------------------------------------------------------- weights

def tp_slice(full, p, tp_rank, tp_size):
    """This TP rank's shard of a full tensor (inverse of gathering with megatron's stride)."""
    if not getattr(p, "tensor_model_parallel", False) or tp_size == 1:
        return full
    stride = getattr(p, "partition_stride", 1)
    pieces = full.chunk(stride * tp_size, dim=p.partition_dim)
    return torch.cat([pieces[s * tp_size + tp_rank] for s in range(stride)], dim=p.partition_dim)


def tp_gather(t, p, group):
    if not getattr(p, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    stride = getattr(p, "partition_stride", 1)
    pieces = [q.chunk(stride, dim=p.partition_dim) for q in parts]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(parts))],
                     dim=p.partition_dim)


def global_name(name, groups, tied=False):
    """Local layer numbering of a pipeline stage, local expert numbering of an expert-parallel
    rank -> the single-process name. A tied output layer (the last stage's copy of the
    embedding, a parameter of its own only under pipeline parallelism) is the embedding."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + groups.pp_rank * (LAYERS // groups.pp_size))
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(int(parts[i]) + groups.ep_rank * (EXPERTS // groups.ep_size))
    return ".".join(parts)


def load_full_state(module, state, groups):
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = state[global_name(name, groups, _tied(module))]
            p.copy_(tp_slice(full, p, groups.tp_rank, groups.tp_size))


def _tied(module) -> bool:
    return bool(getattr(module, "share_embeddings_and_output_weights", False))


def full_grads(module, groups, attr="main_grad"):
    return {global_name(n, groups, _tied(module)): tp_gather(getattr(p, attr), p, groups.tp)
            for n, p in module.named_parameters()}


def distributed_model(groups, state, sp=False, packed=False, moe=False, llama=False):
    """The provider's spec choice for this layout, weights from `state`, wrapped in megatron
    DDP with per-token loss."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    config = model_config(groups.tp_size, groups.pp_size, groups.cp_size, sp,
                          ep=groups.ep_size if moe else 0)
    spec = block_spec(config, groups.cp_size, packed, moe)
    module = gpt(config, spec, groups.is_first_pp_stage, groups.is_last_pp_stage, llama=llama)
    load_full_state(module, state, groups)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module)
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, module


# ----------------------------------------------------------------------------- data

def make_responses(model):
    """The minibatch; behavior/proximal/init log-probs and top-K are the model's own values
    (temperature-scaled) plus noise, so ratios are near 1 but not equal."""
    from megapkl.rollout.sample import Sample

    g = torch.Generator().manual_seed(7)
    raw = []
    for uid, (p, t) in enumerate(LENGTHS):
        raw.append((torch.randint(0, VOCAB, (p,), generator=g), torch.randint(0, VOCAB, (t,), generator=g)))
    logps = reference_logprobs(model, raw)
    rewards = torch.randn(len(raw), generator=g)
    out = []
    for uid, ((prompt, resp), (lp_all, _)) in enumerate(zip(raw, logps)):
        keep = action_mask(uid, resp.numel())   # the behaviour records exist for actions only
        acts, lp_all = resp[keep], lp_all[keep]
        t = acts.numel()
        lp = lp_all.gather(1, acts[:, None])[:, 0]
        noise = lambda s: s * torch.randn(t, generator=g)  # noqa: E731
        behav = lp + noise(0.3)
        topk = torch.stack([torch.randperm(VOCAB, generator=g)[:TOPK] for _ in range(t)])
        hit = torch.rand(t, generator=g) < 0.8          # the sampled token is usually in the top-K
        topk[hit, 0] = acts[hit]
        topk_behav = lp_all.gather(1, topk) + 0.3 * torch.randn(t, TOPK, generator=g)
        topk_behav[hit, 0] = behav[hit]                 # mu's top-K value at a_t is logp_behav
        group = uid // 4
        out.append(Sample(version=0, prompt_ids=prompt, response_ids=resp, logp_behav=behav,
                            advantage=float(rewards[uid] - rewards[group * 4:group * 4 + 4].mean()),
                            group_id=group, uid=uid, logp_prox=lp + noise(0.15), logp_init=lp + noise(0.2),
                            topk_ids=topk, topk_logp=topk_behav,
                            segments=segments_of(uid, resp.numel())))
    return out


def reference_logprobs(model, raw):
    """Per response: ([T, V] log-softmax at the action label positions, [T] entropy), one padded
    batch, computed independently of megapkl.parallel.batching."""
    s = max(p.numel() + r.numel() for p, r in raw)
    tokens = torch.zeros(len(raw), s, dtype=torch.int64)
    for i, (p, r) in enumerate(raw):
        tokens[i, :p.numel() + r.numel()] = torch.cat([p, r])
    logits = model(tokens, torch.arange(s).expand(len(raw), s), attention_mask=None)
    out = []
    for i, (p, r) in enumerate(raw):
        rows = logits[i, p.numel() - 1:p.numel() - 1 + r.numel()].float() / TEMPERATURE
        lp = torch.log_softmax(rows, dim=-1)
        out.append((lp, -(lp.exp() * lp).sum(-1)))
    return out


def reference_batch(model, responses, entropy=False):
    """The whole minibatch as one `TokenBatch` from the reference model (differentiable): the
    action tokens of every response (observation rows dropped here, independently of packing),
    positions 1..A."""
    from megapkl.objectives import TokenBatch

    lps = reference_logprobs(model, [(r.prompt_ids, r.response_ids) for r in responses])
    lps = [(lp[action_mask(r.uid, r.response_len)], h[action_mask(r.uid, r.response_len)])
           for r, (lp, h) in zip(responses, lps)]
    acts = {r.uid: r.response_ids[action_mask(r.uid, r.response_len)] for r in responses}
    cat = lambda f: torch.cat([f(r, lp, h) for r, (lp, h) in zip(responses, lps)])  # noqa: E731
    lengths = torch.tensor([acts[r.uid].numel() for r in responses])
    return TokenBatch(
        logp=cat(lambda r, lp, h: lp.gather(1, acts[r.uid][:, None])[:, 0]),
        logp_behav=cat(lambda r, lp, h: r.logp_behav), logp_prox=cat(lambda r, lp, h: r.logp_prox),
        logp_init=cat(lambda r, lp, h: r.logp_init),
        advantages=cat(lambda r, lp, h: torch.full((acts[r.uid].numel(),), r.advantage)),
        response_index=torch.repeat_interleave(torch.arange(len(responses)), lengths),
        group_index=torch.tensor([r.group_id for r in responses]),
        positions=cat(lambda r, lp, h: torch.arange(1, acts[r.uid].numel() + 1)),
        token_ids=cat(lambda r, lp, h: acts[r.uid]), topk_ids=cat(lambda r, lp, h: r.topk_ids),
        topk_logp_behav=cat(lambda r, lp, h: r.topk_logp),
        topk_logp=cat(lambda r, lp, h: lp.gather(1, r.topk_ids)),
        response_uid=torch.tensor([r.uid for r in responses]), step=3,
        entropy=cat(lambda r, lp, h: h) if entropy else None)


def dp_share(responses, dp_rank, dp_size):
    by_uid = {r.uid: r for r in responses}
    n = len(ORDER) // dp_size
    return [by_uid[u] for u in ORDER[dp_rank * n:(dp_rank + 1) * n]]


def shift_after_sharding(mb):
    """The classic CP bug, for the test that must catch it: labels from the LOCAL token order."""
    labels = torch.zeros_like(mb.tokens)
    labels[:, :-1] = mb.tokens[:, 1:]
    return dataclasses.replace(mb, labels=torch.where(mb.loss_mask, labels, torch.zeros_like(labels)))
