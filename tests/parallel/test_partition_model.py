"""Partition invariance with a real megatron-core GPTModel (docs/spec.md section 7).

For every objective of the library, the loss value, every per-token coefficient and every
parameter gradient of a distributed run (megatron DDP + forward-backward schedules +
finalize_model_grads, `megapkl.parallel.megatron_loss`, our CP attention) equal the
single-process reference: megatron's own local attention on one process, `policy_loss` on the
whole minibatch, plain autograd. Layouts cover TP1/TP2 x CP1/CP2 x DP1/DP2, PP=2, and
micro-batch splits 1, 2, 3 (one gloo worker set per layout, every objective inside it).

Tolerance: fp32 model, relative 1e-5 (gradients: per tensor, in norm).
"""
import pytest
import torch

from megapkl.objectives import PolicyLossConfig, policy_loss
from megapkl.rollout.sample import Sample

import partition_harness as H

SIS = {"enabled": True, "top_k": H.TOPK}
CASES = [
    {"name": "pg"}, {"name": "grpo"}, {"name": "dapo"}, {"name": "cispo"},
    {"name": "proximal_kl", "horizon": "full"}, {"name": "proximal_kl", "horizon": 1},
    {"name": "proximal_kl", "horizon": 5},
    {"name": "proximal_kl", "horizon": 5, "tail": "linear", "cost_clip": None},
    {"name": "seq_is", "horizon": 5}, {"name": "is_free"}, {"name": "gspo"},
    {"name": "tetpo", "kappa": 0.9}, {"name": "tetpo", "aggregation": "seq_mean_token_mean"},
    {"name": "gepo"}, {"name": "m2po", "m2_threshold": 0.05},
    {"name": "grpo", "sis": SIS}, {"name": "proximal_kl", "horizon": 5, "sis": SIS},
    {"name": "gspo", "sis": SIS},
    {"name": "pg", "kl_init_coef": 0.1}, {"name": "grpo", "entropy_coef": 0.05},
    {"name": "cispo", "kl_init_coef": 0.05, "entropy_coef": -0.02, "aggregation": "seq_mean_token_mean"},
    {"name": "dppo_tv", "tv_delta": 0.3}, {"name": "clip_cov", "cov_omega": 0.2},
]
STEP = 3

# name: (tp, pp, cp, dp, micro-batches per DP rank[, options])
# options: sp (sequence parallel), packing ("thd"), tokens (parallel.max_tokens_per_micro_batch
# instead of a micro-batch count), ep (MoE model over that many expert-parallel ranks, compared
# with the single-process MoE model), llama (the Llama model: tied embeddings, llama3 RoPE,
# compared with the single-process Llama model).
LAYOUTS = {
    "tp1cp1dp1_mb2": (1, 1, 1, 1, 2),
    "tp1cp1dp2_mb3": (1, 1, 1, 2, 3),
    "tp1cp2dp1_mb2": (1, 1, 2, 1, 2),
    "tp1cp2dp2_mb3": (1, 1, 2, 2, 3),
    "tp2cp1dp1_mb1": (2, 1, 1, 1, 1),
    "tp2cp1dp2_mb2": (2, 1, 1, 2, 2),
    "tp2cp2dp1_mb3": (2, 1, 2, 1, 3),
    "pp2cp2_mb3": (1, 2, 2, 1, 3),   # PP x CP: num_tokens broadcast over PP, summed over DP x CP
    # token-balanced micro-batches: first-fit decreasing, both DP ranks run the same count
    "tp1cp1dp2_tokens": (1, 1, 1, 2, 0, {"tokens": 96}),
    "tp1cp2dp1_thd_tokens": (1, 1, 2, 1, 0, {"tokens": 64, "packing": "thd"}),
    "thd_cp1dp2_mb2": (1, 1, 1, 2, 2, {"packing": "thd"}),    # packed rows without CP
    "tp2sp_mb2": (2, 1, 1, 1, 2, {"sp": True}),
    "tp2sp_cp2_mb2": (2, 1, 2, 1, 2, {"sp": True}),
    "moe_ep2dp2_mb2": (1, 1, 1, 2, 2, {"ep": 2}),               # all-gather dispatcher across DP
    # Llama: the output layer tied to the embedding across the two pipeline stages (their
    # gradients summed over the embedding group), vocab-sharded over TP, llama3 RoPE scaling
    "llama_tp2pp2_mb2": (2, 2, 1, 1, 2, {"llama": True}),
}
# The new layouts run a subset of the objectives that covers every kind of cross-shard
# statistic (token counts, CP credit, response table, global M2 mask, SIS, entropy/KL terms).
SUBSET = [0, 6, 11, 14, 16, 20]
MOE_CASES = [{"name": "pg"}, {"name": "proximal_kl", "horizon": 5}, {"name": "gspo"}]


def layout_of(name):
    tp, pp, cp, dp, micro, *rest = LAYOUTS[name]
    return tp, pp, cp, dp, micro, (rest[0] if rest else {})


# ----------------------------------------------------------------------------- workers

def reference_worker(rank, world_size, cases, moe=False, llama=False):
    model = H.reference_model(moe, llama)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        responses = H.make_responses(model)
    with torch.no_grad():
        b = H.reference_batch(model, responses)
        logp = {r.uid: b.logp[b.response_index == i] for i, r in enumerate(responses)}
    results = []
    for case in cases:
        model.zero_grad(set_to_none=True)
        cfg = PolicyLossConfig.from_dict(case)
        batch = H.reference_batch(model, responses, entropy=cfg.entropy_coef != 0)
        out = policy_loss(cfg, batch)
        out.loss.backward()
        uid = batch.response_uid[batch.response_index]
        results.append(dict(loss=out.loss.item(), metrics=out.metrics,
                            coef=coef_table(uid, batch.positions, out.coef),
                            grads={n: p.grad.clone() for n, p in model.named_parameters()}))
    return state, responses, (results, logp)


def coef_table(uid, positions, coef):
    return {(int(u), int(p)): float(c) for u, p, c in zip(uid, positions, coef)}


def layout_worker(rank, world_size, layout, state, responses, cases, variants=()):
    from megapkl.parallel import batching as B
    from megapkl.parallel import megatron_loss as L
    from megapkl.parallel.groups import init_parallel
    from megapkl.parallel.microbatches import build_micro_batches

    tp, pp, cp, dp, micro, opts = layout
    sp, packing, ep = opts.get("sp", False), opts.get("packing", "bshd"), opts.get("ep", 1)
    groups = init_parallel(tp=tp, pp=pp, cp=cp, ep=ep, etp=1 if ep > 1 else None, seed=H.SEED)
    ddp, module = H.distributed_model(groups, state, sp=sp, packed=packing == "thd", moe=ep > 1,
                                      llama=opts.get("llama", False))
    mine = H.dp_share(responses, groups.dp_rank, groups.dp_size)
    # the trainer's own packing: plan (count or token budget), shared shape, CP shards, device
    shards = build_micro_batches(mine, groups, B.pad_multiple(cp, tp, sp), packing,
                                 micro_batch_size=-(-len(mine) // max(micro, 1)),
                                 max_tokens=opts.get("tokens"))
    runs = [(case, None) for case in cases] + [(case, v) for v, case in variants]
    out = []
    for case, variant in runs:
        cfg = PolicyLossConfig.from_dict(case)
        mbs = [H.shift_after_sharding(s) for s in shards] if variant == "labels_after_cp" else shards
        ddp.zero_grad_buffer()
        stats = L.count_minibatch(mbs, groups)
        if variant == "per_rank_normalizer":  # the bug: Z from this rank's tokens only
            stats = L.MinibatchStats(num_tokens=float(sum(m.num_action_tokens for m in mbs)),
                                     num_responses=float(sum(m.num_responses for m in mbs)))
        if L.prepass_required(cfg, groups, len(mbs)):
            stats = L.run_prepass(cfg, groups, [ddp], mbs, stats, H.TEMPERATURE, STEP)
        spec = L.PolicyLossSpec(cfg=cfg, groups=groups, stats=stats, temperature=H.TEMPERATURE,
                                step=STEP)
        reports = L.forward_backward(spec, [ddp], mbs)
        rec = dict(variant=variant, metrics=None, coef=None, grads=None, empty_shards=0)
        if groups.is_last_pp_stage:
            rec["metrics"] = L.reduce_reports(reports, groups)
            if variant is None:
                L.verify_token_count(reports, stats, groups)
            rec["empty_shards"] = sum(r.num_tokens == 0 for r in reports)
            if groups.tp_rank == 0:
                rec["coef"] = {k: v for r in reports for k, v in coef_table(r.uid, r.positions, r.coef).items()}
        grads = H.full_grads(module, groups)  # collective over TP
        if groups.tp_rank == 0:
            rec["grads"] = grads
        out.append(rec)
    # the logp-only forward (proximal / behavior recomputation): complete responses, last stage
    logp = L.forward_logprobs(groups, [ddp], shards, H.TEMPERATURE)
    return out, (logp if groups.tp_rank == 0 else {}), [mb.num_responses for mb in shards]


# ----------------------------------------------------------------------------- checks

def test_layouts_tear_groups_apart_and_straddle_cp_chunks():
    """What the layouts exercise: a prompt group split across DP ranks and micro-batches,
    responses whose action tokens sit on both CP ranks, and an observation the CP split cuts."""
    from megapkl.parallel import batching as B

    lengths = [p + t for p, t in H.LENGTHS]
    rs = [Sample(version=0, prompt_ids=torch.zeros(p, dtype=torch.int64),
                 response_ids=torch.arange(t, dtype=torch.int64),
                 logp_behav=torch.zeros(int(H.action_mask(u, t).sum())), advantage=0.0,
                 group_id=u // 4, uid=u, segments=H.segments_of(u, t))
          for u, (p, t) in enumerate(H.LENGTHS)]
    assert max(lengths) > 40
    place = {}
    for dp in range(2):
        for mb, part in enumerate(B.split_responses(H.dp_share(rs, dp, 2), 3)):
            for r in part:
                place[r.uid] = (dp, mb)
    group0 = {place[u] for u in range(4)}
    assert len({d for d, _ in group0}) == 2 and len(group0) >= 3
    mb = B.pack(rs, B.pad_multiple(2))
    both = [i for i in range(len(rs))
            if all(bool(B.shard_for_cp(mb, c, 2).loss_mask[i].any()) for c in range(2))]
    assert len(both) >= 6
    # an observation whose tokens sit on both CP ranks (tokens are their response positions)
    i, (p, t) = 8, H.LENGTHS[8]
    a, b = H.OBSERVATIONS[8][0]
    held = [set(B.shard_for_cp(mb, c, 2).tokens[i].tolist()) for c in range(2)]
    assert all(h & set(range(a, b)) for h in held)
    assert sum(len(H.OBSERVATIONS.get(u, ())) for u in range(len(rs))) >= 8


@pytest.fixture(scope="module")
def reference(megatron_loaded):
    from megapkl.parallel.forked import run_forked

    ((state, responses, results),) = run_forked(reference_worker, 1, CASES, timeout=120)
    return state, responses, results


@pytest.fixture(scope="module")
def llama_reference(megatron_loaded):
    from megapkl.parallel.forked import run_forked

    cases = [CASES[i] for i in SUBSET]
    ((state, responses, (results, logp)),) = run_forked(reference_worker, 1, cases, False, True,
                                                        timeout=120)
    # indexed like CASES, as the other references are
    return state, responses, (dict(zip(SUBSET, results)), logp)


@pytest.fixture(scope="module")
def moe_reference(megatron_loaded):
    from megapkl.parallel.forked import run_forked

    ((state, responses, results),) = run_forked(reference_worker, 1, MOE_CASES, True, timeout=120)
    return state, responses, results


def grad_rel_errors(got, ref):
    assert got.keys() == ref.keys(), set(got) ^ set(ref)
    return {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}


def merged_grads(ranks, i):
    """Union over pipeline stages; every DP/CP replica must hold the same reduced gradient."""
    merged = {}
    for r in ranks:
        for n, g in (r[i]["grads"] or {}).items():
            if n in merged:
                torch.testing.assert_close(g, merged[n], rtol=1e-6, atol=1e-9)
            merged[n] = g
    return merged


def check_case(ranks, i, ref, case, tol=1e-5):
    last = [r[i] for r in ranks if r[i]["metrics"] is not None]
    coef = {}
    for rec in last:
        for key, c in (rec["coef"] or {}).items():
            assert coef.setdefault(key, c) == c, (case, key)  # DP/CP shards hold disjoint tokens
    assert coef.keys() == ref["coef"].keys(), case
    scale = max(abs(c) for c in ref["coef"].values())
    for key, c in ref["coef"].items():
        assert coef[key] == pytest.approx(c, rel=tol, abs=tol * scale), (case, key)
    for rec in last:
        # the surrogates cancel (advantages sum to 0 per group): absolute part on the term scale
        assert rec["metrics"]["loss"] == pytest.approx(ref["loss"], rel=tol, abs=tol * scale), case
        assert rec["metrics"].keys() == ref["metrics"].keys(), case
        for k, v in ref["metrics"].items():
            assert rec["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (case, k, rec["metrics"][k], v)
    errs = grad_rel_errors(merged_grads(ranks, i), ref["grads"])
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, (case, worst, errs[worst])
    coef_err = max(abs(coef[k] - c) for k, c in ref["coef"].items()) / scale
    loss_err = max(abs(rec["metrics"]["loss"] - ref["loss"]) for rec in last) / scale
    return coef_err, loss_err, errs[worst]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_objective_matches_single_process(dist_run, request, name):
    tp, pp, cp, dp, micro, opts = layout = layout_of(name)
    moe = opts.get("ep", 1) > 1
    fixture = "moe_reference" if moe else "llama_reference" if opts.get("llama") else "reference"
    state, responses, (ref, ref_logp) = request.getfixturevalue(fixture)
    if moe:
        cases, idx = MOE_CASES, range(len(MOE_CASES))
    elif len(LAYOUTS[name]) > 5:
        cases, idx = [CASES[i] for i in SUBSET], SUBSET
    else:
        cases, idx = CASES, range(len(CASES))
    out = dist_run(layout_worker, tp * pp * cp * dp, layout, state, responses, cases, timeout=240)
    ranks = [records for records, _, _ in out]
    worst = [0.0, 0.0, 0.0]
    for j, (i, case) in enumerate(zip(idx, cases)):
        worst = [max(a, b) for a, b in zip(worst, check_case(ranks, j, ref[i], case))]
    if name == "tp1cp2dp2_mb3":  # the stand-in path for a CP rank without action tokens ran
        assert sum(r[0]["empty_shards"] for r in ranks) > 0
    if "tokens" in opts:  # several micro-batches, the same number on every DP rank
        counts = {len(sizes) for _, _, sizes in out}
        assert len(counts) == 1 and counts.pop() > 1, [sizes for _, _, sizes in out]
    logp = {}
    for _, rank_logp, _ in out:
        for uid, lp in rank_logp.items():
            assert uid not in logp or torch.equal(logp[uid], lp)  # CP ranks agree
            logp[uid] = lp
    assert logp.keys() == ref_logp.keys()
    lp_err = max(float((logp[u] - lp).abs().max()) for u, lp in ref_logp.items())
    for uid, lp in ref_logp.items():
        torch.testing.assert_close(logp[uid], lp, rtol=1e-5, atol=1e-5)
    print(f"\n[partition] {name}: worst coef {worst[0]:.2e} (rel. to max |coef|), loss "
          f"{worst[1]:.2e}, grad {worst[2]:.2e} (rel. norm), logp {lp_err:.2e} (abs)")


def differs(ranks, i, ref):
    rec = next(r[i] for r in ranks if r[i]["metrics"] is not None)
    loss_off = abs(rec["metrics"]["loss"] - ref["loss"]) > 1e-3 * abs(ref["loss"])
    grad_off = max(grad_rel_errors(merged_grads(ranks, i), ref["grads"]).values()) > 1e-3
    return loss_off, grad_off


def test_labels_shifted_after_cp_sharding_is_caught(dist_run, reference):
    """Shifting labels on the local CP shard pairs each chunk's last logits with the first token
    of the rank's other chunk: loss and gradients move, while the correct shift matches."""
    state, responses, (ref, _) = reference
    layout = (1, 1, 2, 1, 2, {})
    pg = CASES.index({"name": "pg"})
    ranks = [records for records, _, _ in dist_run(layout_worker, 2, layout, state, responses, [CASES[pg]],
                     [("labels_after_cp", CASES[pg])], timeout=120)]
    check_case(ranks, 0, ref[pg], CASES[pg])
    assert differs(ranks, 1, ref[pg]) == (True, True)


def test_per_rank_token_normalizer_is_caught(dist_run, reference):
    """A per-rank normalizer changes the loss (token_mean) and, for sequence-normalized
    objectives, the gradients; the global one matches. Token counts differ between the DP ranks."""
    state, responses, (ref, _) = reference
    layout = (1, 1, 1, 2, 2, {})
    pg, gspo = CASES.index({"name": "pg"}), CASES.index({"name": "gspo"})
    ranks = [records for records, _, _ in dist_run(layout_worker, 2, layout, state, responses, [CASES[pg], CASES[gspo]],
                     [("per_rank_normalizer", CASES[pg]), ("per_rank_normalizer", CASES[gspo])],
                     timeout=120)]
    check_case(ranks, 0, ref[pg], CASES[pg])
    check_case(ranks, 1, ref[gspo], CASES[gspo])
    assert differs(ranks, 2, ref[pg])[0]
    assert differs(ranks, 3, ref[gspo]) == (True, True)
