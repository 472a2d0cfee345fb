"""Context-parallel core attention (megapkl.parallel.cp_attention) and the CP batch layout.

A tiny GPTModel with our attention at CP=1/2/4 and TP=1/2 gives the logits and parameter
gradients of megatron's own local DotProductAttention on one process (fp32 round-off); the
load-balanced slicing of megapkl.parallel.batching equals megatron's get_batch_on_this_cp_rank.
"""
import pytest
import torch
import torch.distributed as dist

import partition_harness as H

B, S = 3, 24  # S divisible by 2 * cp for cp = 1, 2, 4 (and by 2 * cp * tp)


def inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, H.VOCAB, (B, S), generator=g)
    weights = torch.randn(B, S, H.VOCAB, generator=g)   # a loss that touches every logit
    return tokens, weights


def reference_worker(rank, world_size):
    model = H.reference_model()
    tokens, weights = inputs()
    logits = model(tokens, torch.arange(S).expand(B, S), attention_mask=None)
    (logits * weights).sum().backward()
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, logits.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters()})


def gather_cp(local, groups, dim=1):
    """Full sequence from CP shards (rank-major gather, then the global chunk order)."""
    from megapkl.parallel.cp_attention import cp_global_index

    if groups.cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(groups.cp_size)]
    dist.all_gather(parts, local.contiguous(), group=groups.cp)
    return torch.cat(parts, dim).index_select(dim, cp_global_index(local.shape[dim], groups.cp_size))


def layout_worker(rank, world_size, tp, cp, state):
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megapkl.parallel.batching import cp_slice
    from megapkl.parallel.cp_attention import gpt_layer_spec_with_cp_attention
    from megapkl.parallel.groups import init_parallel

    groups = init_parallel(tp=tp, cp=cp, seed=H.SEED)
    model = H.gpt(H.model_config(tp=tp, cp=cp), gpt_layer_spec_with_cp_attention(normalization="RMSNorm"))
    H.load_full_state(model, state, groups)
    tokens, weights = inputs()
    pos = torch.arange(S).expand(B, S)
    ours = {k: cp_slice(v, groups.cp_rank, cp) for k, v in dict(tokens=tokens, position_ids=pos).items()}
    theirs = get_batch_on_this_cp_rank(dict(tokens=tokens.clone(), position_ids=pos.clone()), groups.cp)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    logits = model(ours["tokens"], ours["position_ids"], attention_mask=None)
    w = cp_slice(weights, groups.cp_rank, cp).chunk(tp, dim=-1)[groups.tp_rank]
    (logits * w).sum().backward()
    full = gather_cp(gather_vocab(logits.detach(), groups), groups)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        if cp > 1:  # each CP rank holds its own tokens' share of the gradient
            dist.all_reduce(g, group=groups.cp)
        grads[n] = H.tp_gather(g, p, groups.tp)
    return full, grads


def gather_vocab(logits, groups):
    if groups.tp_size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


@pytest.fixture(scope="module")
def reference(megatron_loaded):
    from megapkl.parallel.forked import run_forked

    return run_forked(reference_worker, 1)[0]


@pytest.mark.parametrize("tp,cp", [(1, 1), (1, 2), (2, 2), (1, 4)])
def test_cp_attention_matches_megatron_local_attention(dist_run, reference, tp, cp):
    state, ref_logits, ref_grads = reference
    for logits, grads in dist_run(layout_worker, tp * cp, tp, cp, state):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        for n, g in ref_grads.items():
            rel = float((grads[n] - g).norm() / g.norm())
            assert rel < 1e-5, (n, rel)


def test_padding_mask_and_gqa_at_cp2(dist_run):
    """cp_causal_attention with a key-padding mask equals plain masked attention on the full
    sequence, values and gradients (the function level, GQA 4 heads / 2 groups)."""
    def worker(rank, world_size):
        from megapkl.parallel.batching import cp_slice
        from megapkl.parallel.cp_attention import cp_causal_attention

        g = torch.Generator().manual_seed(5)
        s, b, hn = 16, 2, 8
        q = torch.randn(s, b, 4, hn, generator=g, requires_grad=True)
        k = torch.randn(s, b, 2, hn, generator=g, requires_grad=True)
        v = torch.randn(s, b, 2, hn, generator=g, requires_grad=True)
        pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
        pad[1, ..., 11:] = True                          # row 1: keys from 11 on are padding
        upstream = torch.randn(s, b, 4 * hn, generator=g)
        full = cp_causal_attention(q, k, v, None, hn ** -0.5, pad)
        (full * upstream).sum().backward()
        ref = [t.grad.clone() for t in (q, k, v)]
        sl = lambda t, d=0: cp_slice(t.detach(), rank, 2, dim=d).requires_grad_()  # noqa: E731
        ql, kl, vl = sl(q), sl(k), sl(v)
        local = cp_causal_attention(ql, kl, vl, dist.group.WORLD, hn ** -0.5, cp_slice(pad, rank, 2, dim=2))
        (local * cp_slice(upstream, rank, 2, dim=0)).sum().backward()
        return (cp_slice(full.detach(), rank, 2, dim=0), local.detach(),
                [cp_slice(r, rank, 2, dim=0) for r in ref], [t.grad for t in (ql, kl, vl)])

    for want, got, want_g, got_g in dist_run(worker, 2):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lean_attention_is_megatrons_bit_for_bit(dist_run):
    """LeanDotProductAttention (the CPU spec's core attention at CP=1) gives megatron's
    DotProductAttention's output and q/k/v gradients bit for bit (GQA and not, one query, a
    bf16 config, training with and without dropout), and leaves the RNG streams as megatron's
    leaves them; the cases it does not take (dropout, bf16, a mask) are megatron's own forward."""
    def worker(rank, world_size):
        import dataclasses

        from megatron.core import tensor_parallel
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megapkl.parallel import cp_attention as CA
        from megapkl.parallel.groups import init_parallel

        init_parallel(seed=H.SEED)
        taken = []
        lean_math = CA.unfused_causal_attention
        CA.unfused_causal_attention = lambda *a: taken.append(True) or lean_math(*a)
        g = torch.Generator().manual_seed(11)
        results = []
        for groups, (sq, b), dropout, bf16, mask in [
                (2, (6, 3), 0.0, False, False), (4, (5, 2), 0.0, False, False),
                (2, (1, 4), 0.0, False, False), (2, (6, 3), 0.3, False, False),
                (2, (6, 3), 0.0, True, False), (2, (6, 3), 0.0, False, True)]:
            cfg = dataclasses.replace(H.model_config(), num_query_groups=groups,
                                      attention_dropout=dropout, bf16=bf16)
            dtype = torch.bfloat16 if bf16 else torch.float32
            hn = cfg.kv_channels
            q0 = torch.randn(sq, b, H.HEADS, hn, generator=g).to(dtype)
            k0, v0 = (torch.randn(sq, b, groups, hn, generator=g).to(dtype) for _ in range(2))
            up = torch.randn(sq, b, H.HEADS * hn, generator=g).to(dtype)
            m = torch.rand(b, 1, sq, sq, generator=g) < 0.3 if mask else None
            outs, taken[:] = [], []
            for cls in (DotProductAttention, CA.LeanDotProductAttention):
                torch.manual_seed(5)
                tensor_parallel.model_parallel_cuda_manual_seed(5)
                attn = cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                           attention_type="self").train()
                q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
                out = attn(q, k, v, m)
                out.backward(up)
                outs.append((out.detach(), q.grad, k.grad, v.grad, torch.get_rng_state(),
                             tensor_parallel.get_cuda_rng_tracker().get_states()))
            (ref, mine) = outs
            same = all(torch.equal(x, y) for x, y in zip(ref[:5], mine[:5]))
            same = same and all(torch.equal(ref[5][n], mine[5][n]) for n in ref[5])
            results.append((same, bool(taken)))
        return results

    plain, fallback = (True, True), (True, False)
    assert dist_run(worker, 1) == [[plain, plain, plain, fallback, fallback, fallback]]
