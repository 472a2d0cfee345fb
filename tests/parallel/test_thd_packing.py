"""THD packing (several responses in one row with cu_seqlens, megatron PackedSeqParams).

Batching level (no model): `pack_thd` shifts labels within each sequence, positions restart per
sequence, `shard_for_cp` gives every CP rank chunks r and 2cp-1-r of EACH sequence, and the CP
shards list exactly the action tokens of the one-row-per-response layout, in response order.

Model level (tiny real megatron-core GPTModel, our CP attention, forked gloo ranks): a
THD-packed micro-batch gives the per-token log-probs of the one-row-per-response layout (and of
the single-process reference) at CP=1, CP=2, TP=2 x CP=2, and the policy loss value, per-token
coefficients and every parameter gradient equal the single-process reference for pg,
proximal_kl (H=5) and tetpo, with micro-batch splits and DP=2 (a TETPO group torn across DP ranks
and micro-batches). Without the packing metadata the packed row is one long sequence and the
log-probs differ (the comparison is sensitive to RoPE restarts and the block-diagonal mask).
"""
import dataclasses

import pytest
import torch

from megapkl.parallel import batching as B

import partition_harness as H
from test_batching import responses as small_responses
from test_partition_model import check_case, coef_table, reference_worker

CASES = [{"name": "pg"}, {"name": "proximal_kl", "horizon": 5}, {"name": "tetpo", "kappa": 0.9}]
STEP = 3

# name: (tp, pp, cp, dp, micro-batches per DP rank)
LAYOUTS = {
    "cp1_mb2": (1, 1, 1, 1, 2),
    "cp2_mb2": (1, 1, 2, 1, 2),
    "tp2cp2_mb3": (2, 1, 2, 1, 3),
    "cp2dp2_mb3": (1, 1, 2, 2, 3),
    "pp2cp2_mb3": (1, 2, 2, 1, 3),   # same_shape: rows padded to one length by a padding segment
}


# ----------------------------------------------------------------------------- batching

def test_pack_thd_layout_labels_positions_and_cu_seqlens():
    rs = small_responses()                                   # lengths 5, 10, 8, 15, 11
    mb = B.pack_thd(rs, multiple=4)
    padded = [8, 12, 8, 16, 12]
    assert mb.is_thd and mb.tokens.shape == (1, sum(padded)) and mb.seq_length == sum(padded)
    assert mb.cu_seqlens_padded.tolist() == [0, 8, 20, 28, 44, 56]
    assert mb.cu_seqlens.tolist() == [0, 5, 15, 23, 38, 49]
    assert mb.cu_seqlens.dtype == mb.cu_seqlens_padded.dtype == torch.int32
    ref = B.pack(rs, multiple=4)                             # one row per response
    for i, r in enumerate(rs):
        a, n = int(mb.cu_seqlens_padded[i]), padded[i]
        p, t = r.prompt_ids.numel(), r.response_len
        assert torch.equal(mb.position_ids[0, a:a + n], torch.arange(n))          # RoPE restarts
        assert torch.equal(mb.tokens[0, a:a + p + t], torch.cat([r.prompt_ids, r.response_ids]))
        assert bool((mb.segment[0, a:a + n] == i).all())
        for name in ("labels", "loss_mask", "action_pos"):
            assert torch.equal(getattr(mb, name)[0, a:a + p + t], getattr(ref, name)[i, :p + t]), name
        assert not bool(mb.loss_mask[0, a + p + t - 1:a + n].any())   # last token predicts nothing
    tb, tr = (B.token_batch(m, torch.zeros(m.num_action_tokens)) for m in (mb, ref))
    for f in ("response_index", "positions", "token_ids", "logp_behav", "advantages", "topk_ids",
              "group_index", "response_uid"):
        assert torch.equal(getattr(tb, f), getattr(tr, f)), f
    assert torch.equal(B.response_lengths(mb), B.response_lengths(ref))
    # a padding tail for a fixed row length (pipeline parallelism)
    tail = B.pack_thd(rs, multiple=4, total_length=64)
    assert tail.cu_seqlens_padded.tolist() == [0, 8, 20, 28, 44, 56, 64]
    assert tail.cu_seqlens.tolist() == [0, 5, 15, 23, 38, 49, 49]
    assert bool((tail.segment[0, 56:] == -1).all()) and not bool(tail.loss_mask[0, 56:].any())
    mbs = B.make_micro_batches(rs, 2, 4, layout="thd", same_shape=True)
    assert {m.tokens.shape for m in mbs} == {(1, 28)} and [m.num_responses for m in mbs] == [3, 2]


@pytest.mark.parametrize("cp", [2, 3])
def test_thd_cp_shards_hold_two_chunks_of_every_sequence(cp):
    rs = small_responses()
    mb = B.pack_thd(rs, multiple=B.pad_multiple(cp))
    full = B.token_batch(B.pack(rs, B.pad_multiple(cp)), torch.zeros(mb.num_action_tokens))
    seen, held = {}, []
    for rank in range(cp):
        sh = B.shard_for_cp(mb, rank, cp)
        idx = B.thd_cp_index(mb.cu_seqlens_padded, rank, cp)
        held.append(idx)
        assert sh.tokens.shape == (1, mb.seq_length // cp)
        assert torch.equal(sh.cu_seqlens_padded, mb.cu_seqlens_padded)       # stay global
        bounds = mb.cu_seqlens_padded.tolist()
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):             # per sequence
            seq = torch.arange(a, b)[None]
            want = B.cp_slice(seq, rank, cp)[0]
            assert torch.equal(idx[(idx >= a) & (idx < b)], want)
            assert torch.equal(sh.position_ids[0][sh.segment[0] == i], want - a)
        tb = B.token_batch(sh, torch.zeros(sh.num_action_tokens))
        tb.validate(need_sis=False, full_lengths=B.response_lengths(sh))      # response order
        for j in range(tb.num_tokens):
            key = (int(tb.response_uid[tb.response_index[j]]), int(tb.positions[j]))
            assert key not in seen
            seen[key] = (int(tb.token_ids[j]), float(tb.logp_behav[j]))
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(mb.seq_length))
    want = {(int(full.response_uid[full.response_index[j]]), int(full.positions[j])):
            (int(full.token_ids[j]), float(full.logp_behav[j])) for j in range(full.num_tokens)}
    assert seen == want


def test_thd_shift_after_sharding_would_pair_wrong_tokens():
    mb = B.pack_thd(small_responses(), multiple=4)
    sh = B.shard_for_cp(mb, 0, 2)
    local = torch.zeros_like(sh.tokens)
    local[:, :-1] = sh.tokens[:, 1:]
    assert not torch.equal(local[sh.loss_mask], sh.labels[sh.loss_mask])


def test_thd_routed_experts_reach_replay_in_thd_order():
    """megapkl.parallel.replay slices `routed` like a BSHD row; the THD shard stores it reordered so
    that this slicing yields the rank's THD tokens."""
    from megapkl.parallel.replay import cp_slice as replay_cp_slice

    rs = small_responses()
    rs = [dataclasses.replace(r, routed_experts=torch.randint(0, 8, (r.prompt_ids.numel() + r.response_len - 1, 2, 2)))
          for r in rs]
    mb = B.pack_thd(rs, multiple=4)
    for rank in range(2):
        sh = B.shard_for_cp(mb, rank, 2)
        idx = B.thd_cp_index(mb.cu_seqlens_padded, rank, 2)
        assert torch.equal(replay_cp_slice(sh.routed, rank, 2), mb.routed[:, idx])


def test_thd_errors():
    rs = small_responses()
    with pytest.raises(ValueError, match="total_length"):
        B.pack_thd(rs, 4, total_length=50)
    with pytest.raises(ValueError, match="layout"):
        B.make_micro_batches(rs, 1, 4, layout="sbhd")
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp"):
        B.thd_cp_index(torch.tensor([0, 6], dtype=torch.int32), 0, 2)


# ----------------------------------------------------------------------------- attention

def test_thd_attention_is_per_sequence_causal_at_cp2(dist_run):
    """cp_thd_causal_attention at CP=2 equals causal attention run on each sequence alone
    (real tokens; GQA 4 heads / 2 groups), values and q/k/v gradients, including a pure padding
    segment (no real token: its queries still see themselves, nothing is NaN)."""
    def worker(rank, world_size):
        import torch.distributed as dist
        import torch.nn.functional as F
        from megapkl.parallel.cp_attention import cp_thd_causal_attention

        g = torch.Generator().manual_seed(11)
        hn, real = 8, [5, 12, 1, 0]
        padded = torch.tensor([0, 8, 20, 24, 32], dtype=torch.int32)
        cu = torch.tensor([0, 5, 17, 18, 18], dtype=torch.int32)
        s = int(padded[-1])
        q = torch.randn(s, 4, hn, generator=g, requires_grad=True)
        k = torch.randn(s, 2, hn, generator=g, requires_grad=True)
        v = torch.randn(s, 2, hn, generator=g, requires_grad=True)
        up = torch.randn(s, 4 * hn, generator=g)
        valid = torch.zeros(s, dtype=torch.bool)
        ref = torch.zeros(s, 4 * hn)
        for a, n in zip(padded[:-1].tolist(), real):
            if n:
                valid[a:a + n] = True
                qs, ks, vs = (x[a:a + n].permute(1, 0, 2) for x in (q, k.repeat_interleave(2, 1),
                                                                     v.repeat_interleave(2, 1)))
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True,
                                                   scale=hn ** -0.5)
                ref[a:a + n] = o[0].permute(1, 0, 2).reshape(n, -1)
        (ref[valid] * up[valid]).sum().backward()
        want_g = [x.grad.clone() for x in (q, k, v)]
        idx = B.thd_cp_index(padded, rank, 2)
        ql, kl, vl = (x.detach()[idx].requires_grad_() for x in (q, k, v))
        out = cp_thd_causal_attention(ql, kl, vl, dist.group.WORLD, hn ** -0.5, padded, cu)
        assert bool(torch.isfinite(out).all())
        m = valid[idx]
        (out[m] * up[idx][m]).sum().backward()
        return out.detach()[m], ref.detach()[idx][m], [x.grad for x in (ql, kl, vl)], [w[idx] for w in want_g]

    for got, want, got_g, want_g in dist_run(worker, 2):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- model

def thd_worker(rank, world_size, layout, state, responses, cases):
    from megapkl.objectives import PolicyLossConfig
    from megapkl.parallel import megatron_loss as L
    from megapkl.parallel.groups import init_parallel

    tp, pp, cp, dp, micro = layout
    groups = init_parallel(tp=tp, pp=pp, cp=cp, seed=H.SEED)
    ddp, module = H.distributed_model(groups, state, packed=True)
    mine = H.dp_share(responses, groups.dp_rank, groups.dp_size)
    mult = B.pad_multiple(cp)
    thd = [B.shard_for_cp(mb, groups.cp_rank, cp)
           for mb in B.make_micro_batches(mine, micro, mult, layout="thd", same_shape=pp > 1)]
    bshd = [B.shard_for_cp(mb, groups.cp_rank, cp)
            for mb in B.make_micro_batches(mine, micro, mult, same_shape=pp > 1)]
    assert all(mb.is_thd and mb.tokens.shape[0] == 1 for mb in thd)
    out = []
    for case in cases:
        cfg = PolicyLossConfig.from_dict(case)
        ddp.zero_grad_buffer()
        stats = L.count_minibatch(thd, groups)
        if L.prepass_required(cfg, groups, len(thd)):
            stats = L.run_prepass(cfg, groups, [ddp], thd, stats, H.TEMPERATURE, STEP)
        spec = L.PolicyLossSpec(cfg=cfg, groups=groups, stats=stats, temperature=H.TEMPERATURE, step=STEP)
        reports = L.forward_backward(spec, [ddp], thd)
        rec = dict(metrics=None, coef=None, grads=None)
        if groups.is_last_pp_stage:
            rec["metrics"] = L.reduce_reports(reports, groups)
            L.verify_token_count(reports, stats, groups)
            if groups.tp_rank == 0:
                rec["coef"] = {k: v for r in reports for k, v in coef_table(r.uid, r.positions, r.coef).items()}
        grads = H.full_grads(module, groups)
        if groups.tp_rank == 0:
            rec["grads"] = grads
        out.append(rec)
    logp_thd = L.forward_logprobs(groups, [ddp], thd, H.TEMPERATURE)
    logp_bshd = L.forward_logprobs(groups, [ddp], bshd, H.TEMPERATURE)
    unpacked = None
    if cp == 1 and tp == 1:  # the packed row WITHOUT PackedSeqParams: one long causal sequence
        with torch.no_grad():
            unpacked = {}
            for mb in thd:
                logits = ddp(mb.tokens, torch.arange(mb.seq_length)[None], attention_mask=None)
                lp = L.action_logprobs(mb, logits, groups, H.TEMPERATURE).logp
                uids = mb.uid.index_select(0, B.action_rows(mb))
                for u in uids.unique().tolist():
                    unpacked[int(u)] = lp[uids == u]
    keep = groups.tp_rank == 0
    return out, (logp_thd if keep else {}), (logp_bshd if keep else {}), unpacked


@pytest.fixture(scope="module")
def reference(megatron_loaded):
    from megapkl.parallel.forked import run_forked

    ((state, responses, results),) = run_forked(reference_worker, 1, CASES, timeout=120)
    return state, responses, results


def merge_logp(per_rank):
    merged = {}
    for logp in per_rank:
        for uid, lp in logp.items():
            assert uid not in merged or torch.equal(merged[uid], lp)   # CP / DP replicas agree
            merged[uid] = lp
    return merged


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_thd_packing_matches_one_row_per_response_and_single_process(dist_run, reference, name):
    state, responses, (ref, ref_logp) = reference
    layout = LAYOUTS[name]
    tp, pp, cp, dp, _ = layout
    out = dist_run(thd_worker, tp * pp * cp * dp, layout, state, responses, CASES, timeout=240)
    thd, bshd = merge_logp([o[1] for o in out]), merge_logp([o[2] for o in out])
    assert thd.keys() == bshd.keys() == ref_logp.keys()
    for uid, lp in ref_logp.items():
        torch.testing.assert_close(thd[uid], bshd[uid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(thd[uid], lp, rtol=1e-5, atol=1e-5)
    ranks = [o[0] for o in out]
    for i, case in enumerate(CASES):
        check_case(ranks, i, ref[i], case)
    if cp == 1 and tp == 1:
        unpacked = merge_logp([o[3] for o in out])
        worst = max(float((unpacked[u] - ref_logp[u]).abs().max()) for u in ref_logp)
        assert worst > 1e-2  # packed row read as one sequence: later responses see earlier ones
