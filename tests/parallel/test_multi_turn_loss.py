"""Observation tokens in the loss path: packed but never labelled, never read, never trained on.

- packing labels exactly the action tokens, numbered 1..A, with the engine's per-action values;
- a value at any non-action position of a micro-batch (a placeholder, here NaN) never reaches a
  ratio, a clip, a count or a normalizer of any objective;
- the gradient of the loss with respect to the logits at every position whose label is an
  observation token is exactly zero, through megatron's schedule (CP = 2: an observation cut by
  the CP split), while action positions get gradient.
(The partition tests run every objective and layout with these multi-turn responses:
partition_harness.OBSERVATIONS.)
"""
import dataclasses

import pytest
import torch

from megapkl.objectives import PolicyLossConfig, policy_loss
from megapkl.parallel import batching as B

import partition_harness as H

CASES = [{"name": "pg"}, {"name": "grpo"}, {"name": "proximal_kl", "horizon": 5},
         {"name": "seq_is", "horizon": 3}, {"name": "gspo"}, {"name": "tetpo"}, {"name": "gepo"},
         {"name": "m2po", "m2_threshold": 0.05}, {"name": "cispo", "kl_init_coef": 0.1},
         {"name": "grpo", "sis": {"enabled": True, "top_k": H.TOPK}},
         {"name": "dapo", "aggregation": "seq_mean_token_mean", "entropy_coef": 0.01}]


def samples():
    """The partition minibatch's responses with random behaviour values (no model needed)."""
    from megapkl.rollout.sample import Sample

    g = torch.Generator().manual_seed(3)
    out = []
    for uid, (p, t) in enumerate(H.LENGTHS):
        a = int(H.action_mask(uid, t).sum())
        rnd = lambda *shape: -torch.rand(*shape, generator=g)  # noqa: E731
        out.append(Sample(uid=uid, group_id=uid // 4, version=0,
                          prompt_ids=torch.randint(0, H.VOCAB, (p,), generator=g),
                          response_ids=torch.randint(0, H.VOCAB, (t,), generator=g),
                          logp_behav=rnd(a), logp_prox=rnd(a), logp_init=rnd(a),
                          topk_ids=torch.randint(0, H.VOCAB, (a, H.TOPK), generator=g),
                          topk_logp=rnd(a, H.TOPK), advantage=float(torch.randn(1, generator=g)),
                          segments=H.segments_of(uid, t)))
    return out


def test_packing_labels_action_tokens_only():
    rs = samples()
    mb = B.pack(rs, 4)
    for i, s in enumerate(rs):
        p, mask = s.prompt_len, H.action_mask(s.uid, s.response_len)
        want = torch.zeros(mb.tokens.shape[1], dtype=torch.bool)
        want[p - 1 + torch.nonzero(mask).flatten()] = True  # the labels of action tokens
        assert torch.equal(mb.loss_mask[i], want), s.uid
        assert mb.action_pos[i][want].tolist() == list(range(1, s.num_actions + 1))
        assert torch.equal(mb.labels[i][want], s.response_ids[mask])
        assert torch.equal(mb.fields["logp_behav"][i][want], s.logp_behav)
        assert torch.equal(mb.fields["topk_ids"][i][want], s.topk_ids)
        assert int(mb.lengths[i]) == s.num_actions
        # every token is fed: observations are context for the next turn
        assert torch.equal(mb.tokens[i, :s.prompt_len + s.response_len], s.sequence)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_a_placeholder_never_reaches_the_loss(case):
    """Every per-token field poisoned with NaN wherever no action label is: the loss, its
    coefficients and metrics are those of the clean batch, bit for bit."""
    rs = samples()
    mb = B.pack(rs, 4)
    poisoned = dataclasses.replace(mb, fields={
        k: torch.where(_expand(mb.loss_mask, v), v, torch.full_like(v, float("nan"))
                       if v.is_floating_point() else torch.full_like(v, -7))
        for k, v in mb.fields.items()})
    cfg = PolicyLossConfig.from_dict(case)
    results = []
    for batch in (mb, poisoned):
        g = torch.Generator().manual_seed(11)
        n = int(batch.loss_mask.sum())
        logp = (-torch.rand(n, generator=g)).requires_grad_(True)
        tb = B.token_batch(batch, logp, topk_logp=-torch.rand(n, H.TOPK, generator=g),
                           entropy=torch.rand(n, generator=g), step=2)
        out = policy_loss(cfg, tb)
        out.loss.backward()
        results.append((out.loss.detach(), out.coef, logp.grad, out.metrics))
    (l0, c0, g0, m0), (l1, c1, g1, m1) = results
    assert torch.isfinite(l0) and torch.equal(l0, l1)
    assert torch.equal(c0, c1) and torch.equal(g0, g1)
    assert m0.keys() == m1.keys() and all(m0[k] == m1[k] or (m0[k] != m0[k] and m1[k] != m1[k])
                                          for k in m0)


def _expand(mask, v):
    return mask.view(*mask.shape, *([1] * (v.dim() - 2))).expand_as(v)


# ------------------------------------------------------------------ gradients through megatron


def grad_worker(rank, world_size, state, responses):
    from megapkl.parallel import megatron_loss as L
    from megapkl.parallel.groups import init_parallel
    from megapkl.parallel.microbatches import build_micro_batches

    groups = init_parallel(cp=world_size, seed=H.SEED)
    ddp, _ = H.distributed_model(groups, state)
    shards = build_micro_batches(responses, groups, B.pad_multiple(world_size), "bshd",
                                 micro_batch_size=4)
    seen = []
    original = L.policy_loss_func

    def spying(spec, mb, logits):  # the logits' gradient, kept per micro-batch
        logits.register_hook(lambda g: seen.append((mb, g.detach().clone())))
        return original(spec, mb, logits)
    L.policy_loss_func = spying
    cfg = PolicyLossConfig.from_dict({"name": "proximal_kl", "horizon": 5})
    stats = L.count_minibatch(shards, groups)
    spec = L.PolicyLossSpec(cfg=cfg, groups=groups, stats=stats, temperature=H.TEMPERATURE,
                            step=1)
    L.forward_backward(spec, [ddp], shards)
    out = []
    for mb, grad in seen:
        # independently of the loss mask: label positions whose next token is an observation
        obs_label = torch.zeros(mb.uid.shape[0], mb.seq_length, dtype=torch.bool)
        act_label = torch.zeros_like(obs_label)
        for i, uid in enumerate(mb.uid[:mb.num_responses].tolist()):
            p, t = H.LENGTHS[uid]
            mask = H.action_mask(uid, t)
            obs_label[i, p - 1 + torch.nonzero(~mask).flatten()] = True
            act_label[i, p - 1 + torch.nonzero(mask).flatten()] = True
        local = lambda m: B.cp_slice(m, groups.cp_rank, groups.cp_size)  # noqa: E731
        size = grad.abs().sum(-1)  # [b, s_local]
        obs, act = size[local(obs_label)], size[local(act_label)]
        out.append((float(obs.max()) if obs.numel() else 0.0,
                    float(act.min()) if act.numel() else float("inf"), int(obs.numel())))
    return out


def test_observation_positions_get_exactly_zero_gradient(dist_run):
    ((state, responses, _),) = dist_run(reference_state, 1)
    ranks = dist_run(grad_worker, 2, state, responses)
    checked = 0
    for rank in ranks:
        for obs_max, act_min, count in rank:
            assert obs_max == 0.0  # exactly: an observation position feeds no loss term
            assert act_min > 0.0   # every action position does
            checked += count
    assert checked == sum(b - a for spans in H.OBSERVATIONS.values() for a, b in spans)


def reference_state(rank, world_size):
    model = H.reference_model()
    with torch.no_grad():
        responses = H.make_responses(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, responses, None
