"""Samples -> micro-batches -> CP shards -> TokenBatch (megapkl.parallel.batching), no model."""
import dataclasses

import pytest
import torch

from megapkl.parallel import batching as B
from megapkl.parallel import microbatches as MB
from megapkl.rollout.sample import Sample


def responses(lengths=((3, 2), (1, 9), (7, 1), (2, 13), (5, 6)), k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for uid, (p, t) in enumerate(lengths):
        out.append(Sample(version=0, 
            prompt_ids=torch.randint(1, 50, (p,), generator=g), response_ids=torch.randint(1, 50, (t,), generator=g),
            logp_behav=-torch.rand(t, generator=g), advantage=float(uid) - 2.0, group_id=uid // 2, uid=100 + uid,
            logp_prox=-torch.rand(t, generator=g), topk_ids=torch.randint(0, 50, (t, k), generator=g),
            topk_logp=-torch.rand(t, k, generator=g)))
    return out


def test_pack_shifts_labels_on_the_full_sequence_and_aligns_fields():
    rs = responses()
    mb = B.pack(rs, multiple=4)
    assert mb.tokens.shape == (5, 16) and mb.seq_length == 16        # longest 15 -> 16
    for i, r in enumerate(rs):
        p, t = r.prompt_ids.numel(), r.response_len
        assert torch.equal(mb.tokens[i, :p + t], torch.cat([r.prompt_ids, r.response_ids]))
        m = mb.loss_mask[i]
        assert int(m.sum()) == t and bool(m[p - 1:p - 1 + t].all())
        assert torch.equal(mb.labels[i][m], r.response_ids)            # next token of the logits
        assert torch.equal(mb.action_pos[i][m], torch.arange(1, t + 1))
        assert torch.equal(mb.fields["logp_behav"][i][m], r.logp_behav)
        assert torch.equal(mb.fields["topk_ids"][i][m], r.topk_ids)
    assert torch.equal(B.response_lengths(mb), torch.tensor([2, 9, 1, 13, 6]))


def test_packing_groups_from_one_fill_gives_each_group_s_own_pack():
    """`pack_groups` (one fill of every sample, then each micro-batch's rows cut to its length)
    gives the tensors `pack` gives each group alone: values, dtypes, shapes, contiguous."""
    import random

    rng = random.Random(0)
    for case in range(60):
        g = torch.Generator().manual_seed(case)
        k, routed, n = rng.choice([0, 3]), rng.random() < 0.3, rng.randint(1, 12)
        samples = []
        for uid in range(n):
            p, t = rng.randint(1, 9), rng.randint(1, 12)
            samples.append(Sample(
                version=0, prompt_ids=torch.randint(1, 50, (p,), generator=g),
                response_ids=torch.randint(1, 50, (t,), generator=g),
                logp_behav=-torch.rand(t, generator=g), advantage=uid - 2.0, group_id=uid // 2,
                uid=100 + uid, logp_prox=-torch.rand(t, generator=g),
                topk_ids=torch.randint(0, 50, (t, k), generator=g) if k else None,
                topk_logp=-torch.rand(t, k, generator=g) if k else None,
                routed_experts=torch.randint(0, 8, (p + t - 1, 2, 2), generator=g) if routed
                else None))
        groups = B.split_responses(samples, rng.randint(1, n))
        multiple, pad = rng.choice([1, 4, 6]), 3
        for one, alone in zip(B.pack_groups(groups, multiple, pad_id=pad),
                              [B.pack(x, multiple, pad_id=pad) for x in groups], strict=True):
            for f in dataclasses.fields(alone):
                a, b = getattr(alone, f.name), getattr(one, f.name)
                if not isinstance(a, dict):
                    pairs = [(f.name, a, b)]
                else:
                    assert a.keys() == b.keys(), f.name
                    pairs = [(key, a[key], b[key]) for key in a]
                for name, x, y in pairs:
                    if isinstance(x, torch.Tensor):
                        assert x.dtype == y.dtype and torch.equal(x, y) and y.is_contiguous(), name
                    else:
                        assert x == y, name
    with pytest.raises(ValueError, match="no samples"):
        B.pack_groups([samples, []], 4)


def test_a_shard_with_a_broken_layout_is_refused_naming_the_field():
    """The shard check (one host read) and the whole-response check name what is wrong."""
    mb = B.pack(responses(), multiple=4)
    tb = B.token_batch(mb, torch.zeros(mb.num_action_tokens))
    full = B.response_lengths(mb)
    tb.validate(full_lengths=full)
    tb.validate()
    ridx, pos = tb.response_index.clone(), tb.positions.clone()
    cases = [  # (field, value, what the shard check names, what the whole check names)
        ("response_index", ridx.flip(0), "response_index", "response_index"),
        ("response_index", ridx + 1, "response_index", "response_index"),
        ("response_index", ridx - 1, "response_index", "response_index"),
        ("response_index", ridx.clamp(max=3), "positions", "response_index"),  # 4 joins 3
        ("positions", pos.flip(0), "positions", "positions"),
        ("positions", pos.clamp(max=1), "positions", "positions"),
        ("positions", pos + 1, "positions", "positions"),
        ("positions", pos - 1, "positions", "positions"),
        # far outside the ranges: a shard check keyed on (response, position) must not wrap
        ("response_index", torch.where(ridx == 0, 2**32, ridx), "response_index", "response_index"),
        ("positions", torch.where(ridx == 2, pos + 2**33, pos), "positions", "positions"),
    ]
    for field, value, shard, whole in cases:
        bad = dataclasses.replace(tb, **{field: value})
        with pytest.raises(ValueError, match=f"TokenBatch.{shard}"):
            bad.validate(full_lengths=full)
        with pytest.raises(ValueError, match=f"TokenBatch.{whole}"):
            bad.validate()
    with pytest.raises(ValueError, match="LossContext.response_lengths"):
        tb.validate(full_lengths=full[:-1])


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_shards_partition_the_action_tokens_in_response_order(cp):
    rs = responses()
    mb = B.pack(rs, multiple=B.pad_multiple(cp))
    full = B.token_batch(mb, torch.zeros(mb.num_action_tokens))
    seen = {}
    for rank in range(cp):
        sh = B.shard_for_cp(mb, rank, cp)
        assert sh.tokens.shape[1] == mb.seq_length // cp
        tb = B.token_batch(sh, torch.zeros(sh.num_action_tokens))
        tb.validate(need_sis=False, full_lengths=B.response_lengths(sh))  # order and positions
        assert torch.equal(tb.group_index, full.group_index) and torch.equal(tb.response_uid, full.response_uid)
        for j in range(tb.num_tokens):
            key = (int(tb.response_index[j]), int(tb.positions[j]))
            assert key not in seen
            seen[key] = (int(tb.token_ids[j]), float(tb.logp_behav[j]), float(tb.advantages[j]))
    assert len(seen) == full.num_tokens
    for j in range(full.num_tokens):
        key = (int(full.response_index[j]), int(full.positions[j]))
        assert seen[key] == (int(full.token_ids[j]), float(full.logp_behav[j]), float(full.advantages[j]))


def test_shifting_after_sharding_would_pair_wrong_tokens():
    """The classic CP bug changes some action labels (those at a chunk's last position)."""
    mb = B.pack(responses(), multiple=4)
    sh = B.shard_for_cp(mb, 0, 2)
    local = torch.zeros_like(sh.tokens)
    local[:, :-1] = sh.tokens[:, 1:]
    assert not torch.equal(local[sh.loss_mask], sh.labels[sh.loss_mask])


def test_same_shape_micro_batches_pad_rows_and_length():
    rs = responses()
    mbs = B.make_micro_batches(rs, 2, multiple=4, same_shape=True)
    assert [mb.num_responses for mb in mbs] == [3, 2]
    assert {tuple(mb.tokens.shape) for mb in mbs} == {(3, 16)}
    tb = B.token_batch(mbs[1], torch.zeros(mbs[1].num_action_tokens))
    assert tb.num_responses == 2 and tb.response_uid.tolist() == [103, 104]
    assert not bool(mbs[1].loss_mask[2].any())


def test_split_and_errors():
    assert [len(p) for p in B.split_responses(list(range(7)), 3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="cannot split"):
        B.split_responses([1, 2], 3)
    r = responses()[0]
    bad = dataclasses.replace(r, prompt_ids=torch.zeros(0, dtype=torch.int64), uid=1)
    short = dataclasses.replace(r, uid=2)
    short.logp_prox = r.logp_prox[:1]
    no_adv = dataclasses.replace(r, uid=3, advantage=None)
    no_prox = dataclasses.replace(r, uid=4, logp_prox=None)
    for packer in (B.pack, B.pack_thd):   # one shared validation
        with pytest.raises(ValueError, match="uid=1 has an empty prompt"):
            packer([bad], 2)
        with pytest.raises(ValueError, match="uid=2: logp_prox must have 2 rows"):
            packer([short], 2)
        with pytest.raises(ValueError, match="uid=3 has no advantage"):
            packer([no_adv], 2)
        with pytest.raises(ValueError, match="uid=4: logp_prox must have 2 rows .* got None"):
            packer([r, no_prox], 2)
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        B.cp_slice(torch.zeros(1, 6), 0, 2)
    assert B.pad_multiple(2, 2, sequence_parallel=True) == 8 and B.pad_multiple(2, 2) == 4


def test_token_budget_plan_is_first_fit_decreasing_and_equalized():
    lengths = [10, 80, 12, 30, 9, 41, 70, 8]
    plan = MB.plan_by_tokens(lengths, 96, 4, "thd")
    assert sorted(i for p in plan for i in p) == list(range(8))
    for part in plan:
        assert MB.padded_cost([lengths[i] for i in part], 4, "thd") <= 96
    # FFD: 80 (+12 -> 92), 70 (+10 +9 -> 92), 41 (+30 +8 -> 84): three micro-batches
    assert plan == [[0, 4, 6], [1, 2], [3, 5, 7]]
    # one row per response costs rows x the longest
    assert MB.padded_cost([10, 30], 4, "bshd") == 64 and MB.padded_cost([10, 30], 4, "thd") == 44
    # another DP rank needs more micro-batches: split the fullest until the counts agree
    five = MB.plan_by_tokens(lengths, 96, 4, "thd", num_micro=5)
    assert len(five) == 5 and sorted(i for p in five for i in p) == list(range(8))
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch = 64 is smaller than one "
                                         "response .* 80 tokens"):
        MB.plan_by_tokens(lengths, 64, 4, "thd")
    with pytest.raises(ValueError, match="cannot make 9 micro-batches of 8"):
        MB.plan_by_tokens(lengths, 96, 4, "thd", num_micro=9)
    # the plan feeds make_micro_batches; every sample lands once, in index order per micro-batch
    rs = responses(lengths=[(1, n - 1) for n in lengths])
    mbs = B.make_micro_batches(rs, plan, 4, layout="thd")
    assert [mb.uid[:mb.num_responses].tolist() for mb in mbs] == [[100 + i for i in p] for p in plan]
    assert max(mb.seq_length for mb in mbs) <= 96


def test_loss_view_is_fp32_from_bf16_logprobs():
    mb = B.pack(responses(), multiple=4)
    n = mb.num_action_tokens
    tb = B.token_batch(mb, torch.zeros(n, dtype=torch.bfloat16, requires_grad=True),
                       topk_logp=torch.zeros(n, 3, dtype=torch.bfloat16),
                       entropy=torch.zeros(n, dtype=torch.bfloat16))
    for name in ("logp", "logp_behav", "logp_prox", "advantages", "topk_logp", "topk_logp_behav", "entropy"):
        assert getattr(tb, name).dtype == torch.float32, name
    assert tb.logp.requires_grad


def test_micro_batch_moves_every_tensor_to_the_device():
    """`MicroBatch.to` (the one place batches reach the device) leaves no tensor behind: the
    per-position tensors, per-response tensors, token fields, THD bounds and R3 routing."""
    rs = [dataclasses.replace(r, routed_experts=torch.zeros(r.prompt_ids.numel() + r.response_len - 1, 2, 2,
                                                            dtype=torch.int32)) for r in responses()]
    for mb in (B.pack(rs, 4), B.pack_thd(rs, 4)):
        moved = mb.to("meta")
        tensors = [v for v in vars(moved).values() if isinstance(v, torch.Tensor)] + list(moved.fields.values())
        assert len(tensors) >= (15 if mb.is_thd else 12)
        assert all(t.device.type == "meta" for t in tensors)
        assert mb.tokens.device.type == "cpu"          # a new MicroBatch; the CPU one is unchanged
