"""Tiny Qwen3 / Qwen3-MoE configs and a teacher-forced reference for the rollout tests."""
from __future__ import annotations

import torch

DENSE = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             tie_word_embeddings=True, max_position_embeddings=256, eos_token_id=2,
             pad_token_id=0, initializer_range=0.3)  # large init: peaky logits exercise top-p/top-k
MOE = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           tie_word_embeddings=False, max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.3)


def build_model(cfg: dict, seed: int = 0):
    """A randomly initialized transformers model (the 'trainer' side of the tests)."""
    from transformers import AutoModelForCausalLM

    from megapkl.rollout.embedded import load_hf_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(load_hf_config(cfg)).eval()


def teacher_forced(model, sample, temperature: float):
    """(log-probs [R, V] at `temperature`, router top-k per fed token or None) from one unpadded
    forward of prompt + response[:-1], the trainer's recomputation."""
    seq = sample.sequence[:-1][None]
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    routed, hooks = [], []
    for g in gates:
        hooks.append(g.register_forward_hook(
            lambda mod, inp, out: routed.append(out[2])))  # (logits, scores, top-k indices)
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    for h in hooks:
        h.remove()
    p = sample.prompt_len
    logp = torch.log_softmax(logits[p - 1:] / temperature, dim=-1)
    experts = torch.stack(routed, dim=1).to(torch.int32) if routed else None
    return logp, experts


def check_behaviour(model, sample, temperature: float = 1.0, k: int = 3):
    """Assert that a sample's behaviour log-probs and top-k are the teacher-forced recomputation's
    at its action tokens; return that recomputation (log-probs, router top-k)."""
    logp, experts = teacher_forced(model, sample, temperature)
    mask = sample.action_mask
    ref = logp[torch.arange(sample.response_len), sample.response_ids][mask]
    torch.testing.assert_close(sample.logp_behav, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(sample.topk_logp, logp[mask].topk(k).values, atol=2e-5, rtol=0)
    return logp, experts
