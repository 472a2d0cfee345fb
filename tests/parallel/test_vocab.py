"""Vocab-parallel log-prob / entropy / top-K against torch.log_softmax on the full logits.

Values and gradients w.r.t. the logits, temperature != 1, chunks smaller than the token count
(uneven last chunk), fp32 and bf16 inputs, TP = 1 in process and TP = 2 on forked gloo ranks.
"""

import pytest
import torch

from megapkl.parallel.vocab import (
    default_chunk_tokens,
    token_logprobs_entropy_topk,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_topk_logprobs,
)

TOKENS, VOCAB, K, TEMP, CHUNK = 11, 24, 4, 0.7, 4  # 11 = 4 + 4 + 3


def problem(dtype, seed=0):
    """Full logits, targets (some inside the top-K, one repeated id), top-K ids, upstream grads."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(TOKENS, VOCAB, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    topk = torch.randint(0, VOCAB, (TOKENS, K), generator=gen)
    topk[:, 0] = targets  # the sampled token is usually among the top-K
    topk[0, 1] = topk[0, 2]  # duplicates must accumulate in the gradient
    upstream = [torch.randn(TOKENS, generator=gen), torch.randn(TOKENS, generator=gen),
                torch.randn(TOKENS, K, generator=gen)]
    return logits, targets, topk, upstream


def reference(logits, targets, topk, upstream):
    """float64 log_softmax reference; returns (logp, entropy, topk_logp, grad wrt logits)."""
    x = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(x / TEMP, dim=-1)
    logp = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    topk_logp = logp_all.gather(1, topk)
    loss(logp, entropy, topk_logp, upstream).backward()
    return logp.detach(), entropy.detach(), topk_logp.detach(), x.grad


def loss(logp, entropy, topk_logp, upstream):
    g_logp, g_ent, g_topk = (u.to(logp.dtype) for u in upstream)
    return (logp * g_logp).sum() + (entropy * g_ent).sum() + (topk_logp * g_topk).sum()


def ours(logits_shard, targets, topk, upstream, group, chunk=CHUNK):
    x = logits_shard.detach().clone().requires_grad_()
    out = token_logprobs_entropy_topk(x, targets, group, TEMP, topk_ids=topk, need_entropy=True,
                                      chunk_tokens=chunk)
    loss(out.logp, out.entropy, out.topk_logp, upstream).backward()
    return out.logp.detach(), out.entropy.detach(), out.topk_logp.detach(), x.grad


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def check(got, logits, targets, topk, upstream, dtype):
    want = reference(logits, targets, topk, upstream)
    for name, g, w in zip(("logp", "entropy", "topk_logp"), got[:3], want[:3]):
        assert g.dtype == torch.float32, name
        # values are computed in fp32 from the (exactly representable) inputs: tight always
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=name)
    assert got[3].dtype == dtype
    torch.testing.assert_close(got[3].double(), want[3], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [CHUNK, 1, 100])
def test_tp1_matches_log_softmax(dtype, chunk):
    logits, targets, topk, upstream = problem(dtype)
    check(ours(logits, targets, topk, upstream, None, chunk), logits, targets, topk, upstream,
          dtype)


def tp2_worker(rank, world_size, dtype):
    import torch.distributed as dist

    logits, targets, topk, upstream = problem(dtype)
    group = dist.new_group([0, 1])
    shard = logits.chunk(world_size, dim=-1)[rank]
    return ours(shard, targets, topk, upstream, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp2_matches_log_softmax(dist_run, dtype):
    logits, targets, topk, upstream = problem(dtype)
    per_rank = dist_run(tp2_worker, 2, dtype, install_compat=False)
    for got in per_rank:  # every TP rank holds the same full-vocabulary results
        torch.testing.assert_close(got[0], per_rank[0][0], rtol=0, atol=0)
    grad = torch.cat([got[3] for got in per_rank], dim=-1)
    check((*per_rank[0][:3], grad), logits, targets, topk, upstream, dtype)
    # partition invariance: TP=2 equals TP=1 to fp32 round-off
    single = ours(logits, targets, topk, upstream, None)
    for a, b in zip((*per_rank[0][:3], grad), single):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_single_outputs_and_shapes():
    logits, targets, topk, _ = problem(torch.float32)
    x3 = logits.view(1, TOKENS, VOCAB).requires_grad_()
    logp = vocab_parallel_logprobs(x3, targets.view(1, TOKENS), temperature=TEMP, chunk_tokens=3)
    ent = vocab_parallel_entropy(x3, temperature=TEMP, chunk_tokens=3)
    top = vocab_parallel_topk_logprobs(x3, topk.view(1, TOKENS, K), temperature=TEMP)
    assert logp.shape == ent.shape == (1, TOKENS) and top.shape == (1, TOKENS, K)
    zeros = [torch.zeros(TOKENS), torch.zeros(TOKENS), torch.zeros(TOKENS, K)]
    for got, want in zip((logp, ent, top), reference(logits, targets, topk, zeros)):
        torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-6)
    out = token_logprobs_entropy_topk(x3, targets.view(1, TOKENS))
    assert out.entropy is None and out.topk_logp is None
    # gradient of the log-prob alone: (onehot - softmax) / T
    x = logits.clone().requires_grad_()
    vocab_parallel_logprobs(x, targets, temperature=TEMP, chunk_tokens=5).sum().backward()
    onehot = torch.nn.functional.one_hot(targets, VOCAB)
    expected = (onehot - torch.softmax(logits / TEMP, -1)) / TEMP
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)


def test_extreme_logits_stay_finite():
    # one rank's shard far below the other's: rescaling must underflow to zero, not NaN
    x = torch.full((3, 8), -1e4)
    x[:, 5] = 50.0
    out = token_logprobs_entropy_topk(x.requires_grad_(), torch.tensor([5, 0, 5]),
                                      need_entropy=True, chunk_tokens=2)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert torch.isfinite(out.logp).all() and torch.isfinite(x.grad).all()
    assert out.logp[0].item() == pytest.approx(0.0, abs=1e-6)


def test_bad_inputs():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(x, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_logprobs(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="topk_ids"):
        vocab_parallel_topk_logprobs(x, torch.zeros(4, dtype=torch.long))
    assert default_chunk_tokens(151936) >= 1 and default_chunk_tokens(128) > 1000
    # at least MIN_CHUNKS chunks of a large vocabulary, but no chunk below MIN_CHUNK_BYTES
    assert default_chunk_tokens(151936, tokens=64) == 2
    assert default_chunk_tokens(128, tokens=64) >= 64  # one chunk: 32 KiB of logits
    assert default_chunk_tokens(128, tokens=10**5) == -(-10**5 // 32)


def test_no_grad_forward_skips_saving():
    logits, targets, *_ = problem(torch.float32)
    with torch.no_grad():
        logp = vocab_parallel_logprobs(logits, targets)
    assert not logp.requires_grad
