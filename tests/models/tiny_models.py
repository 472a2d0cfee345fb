"""Tiny random Hugging Face Qwen3 / Qwen3-MoE / Llama checkpoints and helpers run inside forked
ranks.

The HF models are built from transformers' config classes with the numbers of
configs/models/tiny-qwen3*.yaml and tiny-llama.yaml (no hub downloads) and saved with
`save_pretrained`. Norm weights are randomised too, so a swapped or missing norm cannot go
unnoticed.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

SEQ, BATCH = 12, 2


@dataclasses.dataclass
class TinyCheckpoint:
    path: str
    name: str  # megapkl model name (configs/models/<name>.yaml)
    ids: torch.Tensor  # [BATCH, SEQ] token ids
    logits: torch.Tensor  # HF fp32 logits for `ids`
    state_dict: dict  # what the checkpoint holds


def hf_config(moe: bool, **changes):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=512)
    if moe:
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, tie_word_embeddings=False, router_aux_loss_coef=0.0)
        common.update(changes)
        return Qwen3MoeConfig(**common)
    common.update(tie_word_embeddings=True)
    common.update(changes)
    return Qwen3Config(**common)


# tiny-llama.yaml as transformers' LlamaConfig: tied, llama3 scaling, a small theta and
# original context so that the scaled frequencies act within a few positions
LLAMA_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama_hf_config(**changes):
    from transformers import LlamaConfig

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  rope_parameters=dict(LLAMA_ROPE), rms_norm_eps=1e-5,
                  max_position_embeddings=512, tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=[1, 4, 5])  # the tiny-llama twin's ids
    common.update(changes)
    return LlamaConfig(**common)


def make_checkpoint(path: str, moe: bool, seed: int = 0, **changes) -> TinyCheckpoint:
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cls = Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM
    return save_checkpoint(path, cls, hf_config(moe, **changes),
                           "tiny-qwen3-moe" if moe else "tiny-qwen3", seed)


def make_llama_checkpoint(path: str, seed: int = 0, **changes) -> TinyCheckpoint:
    """transformers' own LlamaForCausalLM at tiny-llama's numbers, saved by save_pretrained."""
    from transformers import LlamaForCausalLM

    return save_checkpoint(path, LlamaForCausalLM, llama_hf_config(**changes), "tiny-llama", seed)


def save_checkpoint(path: str, cls, config, name: str, seed: int) -> TinyCheckpoint:
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits
    state = load_file(os.path.join(path, "model.safetensors"))
    return TinyCheckpoint(path, name, ids, logits, state)


# ---------------------------------------------------------------- inside forked ranks


def positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


def gather_vocab(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Full-vocabulary logits from the TP shards."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def build_loaded(ckpt_path: str, name: str, *, tp=1, pp=1, ep=1, etp=None, sp=False,
                 seed=1, spec_overrides=None, **opts):
    """init_parallel + build the megapkl model + load the HF checkpoint; returns (groups, model)."""
    from megapkl.models.hf import load_hf_weights
    from megapkl.models.provider import ModelOptions, build_model
    from megapkl.models.spec import load_spec
    from megapkl.parallel.groups import init_parallel

    groups = init_parallel(tp=tp, pp=pp, ep=ep, etp=etp, seed=seed)
    model = build_model(load_spec(name, spec_overrides), ModelOptions(sequence_parallel=sp, **opts))
    load_hf_weights(model, ckpt_path, groups=groups)
    return groups, model


def forward_logits(model, groups, ids: torch.Tensor, hidden_size: int = 64):
    """Full logits of a 1- or 2-stage pipeline (stage 0 sends its hidden states by p2p);
    None on ranks that are not the last stage."""
    sp_split = groups.tp_size if model.config.sequence_parallel else 1
    pos = positions(ids)
    if groups.pp_size == 1:
        return gather_vocab(model(ids, pos, None), groups.tp)
    peer = dist.get_global_rank(groups.pp, 1 - groups.pp_rank)
    if groups.pp_rank == 0:
        dist.send(model(ids, pos, None).contiguous(), peer)
        return None
    hidden = torch.empty(ids.shape[1] // sp_split, ids.shape[0], hidden_size)
    dist.recv(hidden, peer)
    model.set_input_tensor(hidden)
    return gather_vocab(model(ids, pos, None), groups.tp)


def train_setup(ckpt, layout, seed, **settings):
    """Loaded model + DDP + distributed Adam + scheduler (lr 1e-3, 3 warmup steps by default)."""
    from megapkl.models.optimizer import (OptimSettings, build_optimizer, build_scheduler,
                                          wrap_ddp)

    groups, model = build_loaded(ckpt.path, ckpt.name, seed=seed, **layout)
    settings = OptimSettings(**{"lr": 1e-3, "warmup_steps": 3, **settings})
    ddp = wrap_ddp([model], settings)
    opt = build_optimizer(ddp, settings)
    return groups, model, ddp, opt, build_scheduler(opt, settings)


def train_step(ddp, opt, sched, seed):
    """One optimizer step on a random cross-entropy batch drawn from `seed`."""
    from megapkl.models.optimizer import finalize_grads, optimizer_step, zero_grads

    zero_grads(ddp, opt)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, SEQ), generator=gen)
    labels = torch.randint(0, 128, ids.shape, generator=gen)
    ddp[0](ids, positions(ids), None, labels=labels).mean().backward()
    finalize_grads(ddp)
    return optimizer_step(opt, sched)


def load_forward_export(ckpt, layout: dict):
    """(model, logits or None off the last stage, {HF name: tensor}) of the tiny checkpoint
    `ckpt` imported at `layout` (build_loaded's keywords), run forward on `ckpt.ids` and exported
    back to Hugging Face names (each name once)."""
    from megapkl.models.hf import export_hf_weights

    groups, model = build_loaded(ckpt.path, ckpt.name, **layout)
    model.eval()
    with torch.no_grad():
        logits = forward_logits(model, groups, ckpt.ids)
    exported = {}
    for name, tensor in export_hf_weights(model, groups=groups):
        assert name not in exported, f"{name} exported twice"
        exported[name] = tensor.clone()
    return model, logits, exported
