"""The CPU compatibility layer lets the real megatron-core run on CPU with gloo.

Every megatron computation here runs in forked gloo ranks (tests/conftest.py `dist_run`),
where `compat.install()` is applied; the pytest process itself stays unpatched.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapkl.parallel.patches import speed_patches_on

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility layer")
# tests of a speed-only patch: nothing to test when MEGAPKL_SPEED_PATCHES=0 leaves it out
speed_patch = pytest.mark.skipif(not speed_patches_on(), reason="speed-only patches off")

VOCAB, SEQ, BATCH = 128, 16, 2


# ---------------------------------------------------------------- helpers run inside ranks


def tiny_gpt(tp=1, pp=1, seed=7, pre_process=True, post_process=True, num_layers=2):
    """Tiny Qwen-like GPTModel (local spec, RMSNorm, SwiGLU, RoPE, GQA), fusions off."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        # CPU init draws the full master weight and slices it: identical weights at any TP.
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope",
                    pre_process=pre_process, post_process=post_process)


def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    weights = torch.randn(BATCH, SEQ, VOCAB, generator=gen)  # a loss touching every logit
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), weights


def gather_tp(t, group, dim, stride=1):
    """Full tensor from TP shards; `stride` undoes megatron's interleaved (e.g. SwiGLU) split."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    pieces = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)


def full_grads(model, group):
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            out[name] = gather_tp(p.grad, group, p.partition_dim, p.partition_stride)
        else:
            out[name] = p.grad.clone()
    return out


def gpt_forward_backward(rank, world_size, tp, loss_kind="linear"):
    from megapkl.parallel.groups import init_parallel
    from megapkl.parallel.vocab import token_logprobs_entropy_topk

    groups = init_parallel(tp=tp, seed=1234)
    model = tiny_gpt(tp=tp)
    ids, pos, weights = batch()
    logits = model(ids, pos, attention_mask=None)  # [b, s, V/tp]
    if loss_kind == "linear":  # touches every logit; per-rank partial sums
        shard = weights.chunk(groups.tp_size, dim=-1)[groups.tp_rank]
        local_loss = (logits * shard).sum()
        total = local_loss.detach().clone()
        dist.all_reduce(total, group=groups.tp)
    else:  # the RL loss path: vocab-parallel log-prob, entropy and top-K, complete on every rank
        topk = weights.topk(4, dim=-1).indices  # any ids, shared by the TP ranks
        out = token_logprobs_entropy_topk(logits, torch.roll(ids, -1, dims=1), groups.tp, 0.8,
                                          topk_ids=topk, need_entropy=True, chunk_tokens=5)
        local_loss = out.logp.sum() - 0.1 * out.entropy.sum() + 0.5 * out.topk_logp.sum()
        total = local_loss.detach().clone()
    local_loss.backward()
    return dict(logits=gather_tp(logits.detach(), groups.tp, dim=2), loss=total,
                grads=full_grads(model, groups.tp))


# ---------------------------------------------------------------- tests


def test_install_is_noop_in_parent_and_idempotent_in_rank(dist_run):
    from megapkl.parallel import compat

    assert not compat.is_installed()  # the harness patches ranks, never the pytest process

    def worker(rank, world_size):
        import threading

        first = compat.is_installed()
        assert compat.install() and compat.install()
        zeros = torch.zeros  # installed once: a second install() does not wrap the wrapper
        assert compat.install() and torch.zeros is zeros
        placed = []  # process-wide: a thread started later places on the CPU too
        thread = threading.Thread(target=lambda: placed.append(torch.ones(1, device="cuda")))
        thread.start()
        thread.join()
        return first, compat.is_installed(), placed[0].device.type

    assert dist_run(worker, 1) == [(True, True, "cpu")]


def test_cuda_calls_map_to_cpu(dist_run):
    def worker(rank, world_size):
        x = torch.zeros(3, device="cuda", pin_memory=True)
        assert x.device.type == "cpu" and not x.is_pinned()
        assert x.cuda() is x and x.pin_memory() is x
        assert x.to("cuda").device.type == "cpu" and x.to(0).device.type == "cpu"
        assert x.to(torch.float64).dtype == torch.float64  # dtype conversions untouched
        for y in (x.to(device="cuda", dtype=torch.float64), x.to("cuda:0", torch.float64),
                  x.to(torch.device("cuda"), torch.float64, copy=True)):
            assert y.device.type == "cpu" and y.dtype == torch.float64
        assert torch.ones(2).to(torch.cuda.current_device()).device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"  # what megatron's optimizer checks
        assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
        assert next(torch.nn.Linear(2, 2).cuda().parameters()).device.type == "cpu"
        stream = torch.cuda.Stream()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.stream(stream):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        torch.cuda.synchronize()
        from megatron.core.transformer.utils import get_default_causal_mask

        return get_default_causal_mask(3)

    (mask,) = dist_run(worker, 1)
    assert torch.equal(mask, torch.ones(3, 3).triu(1).bool())


def test_rng_tracker_forks_cpu_generator(dist_run):
    def worker(rank, world_size):
        from megatron.core import tensor_parallel
        from megapkl.parallel.groups import init_parallel

        init_parallel(tp=2, seed=99)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        default_a = torch.rand(4)
        with tracker.fork():
            tp_a = torch.rand(4)
        with tracker.fork():
            tp_b = torch.rand(4)
        default_b = torch.rand(4)
        # The default stream must not notice the forks: replay it without them.
        torch.manual_seed(99)
        replay = torch.rand(8)
        return default_a, default_b, tp_a, tp_b, replay

    r0, r1 = dist_run(worker, 2)
    for r in (r0, r1):
        default_a, default_b, tp_a, tp_b, replay = r
        assert torch.equal(torch.cat([default_a, default_b]), replay)
        assert not torch.equal(tp_a, tp_b)  # the forked stream advances
    assert torch.equal(r0[0], r1[0])  # default stream shared across TP ranks
    assert not torch.equal(r0[2], r1[2])  # model-parallel stream differs per TP rank


def test_activation_checkpoint_replays_dropout(dist_run):
    def worker(rank, world_size):
        from megatron.core import tensor_parallel
        from megapkl.parallel.groups import init_parallel

        init_parallel(tp=1, seed=5)
        tracker = tensor_parallel.get_cuda_rng_tracker()

        def block(x):
            with tracker.fork():
                return F.dropout(x * 3.0, p=0.5, training=True)

        x = torch.randn(64, requires_grad=True)
        state = tracker.get_states()
        plain = block(x)
        plain.sum().backward()
        grad_plain, x.grad = x.grad, None
        tracker.set_states(state)
        ckpt = tensor_parallel.checkpoint(block, False, x)  # recompute restores RNG states
        ckpt.sum().backward()
        return torch.equal(plain, ckpt), torch.equal(grad_plain, x.grad)

    assert dist_run(worker, 1) == [(True, True)]


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@speed_patch
def test_rope_matches_megatron_bit_for_bit(dist_run):
    """Patch 8: cached tables and a roll give megatron's unfused RoPE exactly, forward and
    backward (signed zeros included); a layout it does not cover goes to megatron's own."""
    def worker(rank, world_size):
        from megatron.core.models.common.embeddings import rope_utils

        patched = rope_utils._apply_rotary_pos_emb_bshd
        megatron = patched.__wrapped__
        gen = torch.Generator().manual_seed(3)
        results = []
        for dtype, (s, b, h, d), mscale, rot, strided in [
                (torch.float32, (5, 3, 4, 16), 1.0, 16, False),
                (torch.bfloat16, (7, 2, 2, 32), 1.0, 32, False),
                (torch.float32, (4, 2, 2, 16), 0.7, 16, False),
                (torch.float32, (6, 3, 2, 16), 1.0, 16, True),  # a [b, s] buffer seen as [s, b]
                (torch.float32, (4, 2, 2, 16), 1.0, 8, False)]:  # partial: megatron's own path
            inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
            f = torch.outer(torch.arange(s).float(), inv)
            freqs = torch.cat((f, f), -1)[:, None, None, :]
            x = (torch.randn(b, s, h, d, generator=gen) * 3).to(dtype).transpose(0, 1)
            x = x if strided else x.contiguous()
            x[0, 0, 0, :3], x[0, 0, 0, 3:5] = 0.0, -0.0
            g = torch.randn(s, b, h, d, generator=gen).to(dtype)
            g[1, 0, 0, :3] = -0.0
            outs = []
            for fn in (megatron, patched, patched):  # the second patched call reads the cache
                xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
                y = fn(xi, freqs, mscale=mscale)
                y.backward(g)
                assert y.is_contiguous()  # callers `.view` it
                outs.append((y.detach(), xi.grad))
            (ref_y, ref_g), rest = outs[0], outs[1:]
            results.append(all(torch.equal(_bits(y), _bits(ref_y)) and
                               torch.equal(_bits(grad), _bits(ref_g)) for y, grad in rest))
        return results

    assert dist_run(worker, 1) == [[True] * 5]


@speed_patch
def test_tp_regions_are_identities_on_one_rank(dist_run):
    """Patch 9: a one-rank TP group skips the copy / all-reduce Function; larger groups keep
    megatron's (test_gpt_tp2_matches_tp1 runs them)."""
    def worker(rank, world_size):
        from megatron.core.tensor_parallel import layers
        from megapkl.parallel.groups import init_parallel

        groups = init_parallel(tp=world_size, seed=1)
        x = torch.randn(3, requires_grad=True)
        outs = [layers.copy_to_tensor_model_parallel_region(x, group=groups.tp),
                layers.reduce_from_tensor_model_parallel_region(x, group=groups.tp)]
        return [y is x for y in outs]

    assert dist_run(worker, 1) == [[True, True]]
    assert dist_run(worker, 2) == [[False, False], [False, False]]


@pytest.mark.parametrize("loss_kind", ["linear", "vocab_parallel"])
def test_gpt_tp2_matches_tp1(dist_run, loss_kind):
    (ref,) = dist_run(gpt_forward_backward, 1, 1, loss_kind)
    out = dist_run(gpt_forward_backward, 2, 2, loss_kind)
    for rank_out in out:
        torch.testing.assert_close(rank_out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank_out["loss"], ref["loss"], rtol=1e-5, atol=1e-4)
        assert rank_out["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(rank_out["grads"][name], grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")


def pipeline_losses(rank, world_size, pp, state):
    """1F1B at `pp` stages (or no pipelining at pp=1) over 2 micro-batches; loss and grads."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megapkl.parallel.groups import init_parallel

    groups = init_parallel(pp=pp, seed=1234)
    model = tiny_gpt(pp=pp, pre_process=groups.is_first_pp_stage,
                     post_process=groups.is_last_pp_stage, num_layers=2)
    if state is None:
        state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    else:
        sliced = stage_state(state, groups.pp_rank, 2 // pp)
        own = {k for k, v in model.state_dict().items() if torch.is_tensor(v)}
        assert own <= sliced.keys(), own - sliced.keys()
        model.load_state_dict({k: sliced[k] for k in own}, strict=False)
    ids, pos, weights = batch()
    micro = [(ids[i:i + 1], pos[i:i + 1], weights[i:i + 1]) for i in range(BATCH)]

    def loss_func(w, logits):
        loss = (logits * w).sum()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        i, p, w = next(data_iterator)
        return model(i, p, attention_mask=None), functools.partial(loss_func, w)

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
        num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=1, forward_only=False)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return state, [d["loss"] for d in losses], grads


def stage_state(state, pp_rank, layers_per_stage):
    """Slice a single-stage state dict for one pipeline stage (local layer numbering)."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if key.startswith("decoder.layers."):
            layer = int(parts[2]) - pp_rank * layers_per_stage
            if not 0 <= layer < layers_per_stage:
                continue
            parts[2] = str(layer)
        out[".".join(parts)] = value
    return out


def test_pipeline_pp2_matches_pp1(dist_run):
    ((state, ref_losses, ref_grads),) = dist_run(pipeline_losses, 1, 1, None)
    (_, losses0, grads0), (_, losses1, grads1) = dist_run(pipeline_losses, 2, 2, state)
    assert losses0 == [] and len(losses1) == BATCH  # only the last stage sees losses
    torch.testing.assert_close(torch.stack(losses1), torch.stack(ref_losses), rtol=1e-5, atol=1e-4)
    merged = {**grads0, **{k.replace("layers.0.", "layers.1."): v for k, v in grads1.items()}}
    for name, grad in merged.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5)


def ddp_adam_steps(rank, world_size, tp, steps=2):
    """megatron DDP + distributed Adam (torch fallback) with clipping; logits after `steps`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megapkl.parallel.groups import init_parallel

    groups = init_parallel(tp=tp, seed=1234)
    module = tiny_gpt(tp=tp)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            grad_reduce_in_fp32=True)
    model = DistributedDataParallel(module.config, ddp_cfg, module)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.5, use_distributed_optimizer=True),
        [model])
    ids, pos, weights = batch()
    # this DP rank's half of the batch; DDP averages over DP, so use per-sample means
    per_rank = BATCH // groups.dp_size
    rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    shard = weights.chunk(groups.tp_size, dim=-1)[groups.tp_rank]
    for _ in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        logits = model(ids[rows], pos[rows], attention_mask=None)
        ((logits * shard[rows]).sum() / logits.shape[0]).backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=None)
    return gather_tp(logits, groups.tp, dim=2), grad_norm


def test_ddp_distributed_optimizer_dp2_matches_dp1(dist_run):
    ((ref_logits, ref_norm),) = dist_run(ddp_adam_steps, 1, 1)
    for logits, norm in dist_run(ddp_adam_steps, 2, 1):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def buffer_collectives(rank, world_size, patched):
    """ddp_adam_steps with patch 10 on or off: logits, grad norm and the collectives that ran
    (the profiler's record of the c10d ops dispatched)."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    names = ("dist_reduce_scatter_func", "dist_all_gather_func")
    kept = {n: getattr(buffers, n) for n in names}
    if not patched:
        for n in names:
            setattr(buffers, n, kept[n].__wrapped__)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits, norm = ddp_adam_steps(rank, world_size, 1)
    finally:
        for n in names:
            setattr(buffers, n, kept[n])
    # megatron coalesces each bucket group's collectives (other all-gathers, of group tables and
    # the test's TP logits, are not the buffers')
    ran = sorted({e.name for e in prof.events() if "coalesced" in e.name})
    return logits, norm, ran


@speed_patch
def test_buffer_collectives_skipped_on_one_rank(dist_run):
    """Patch 10: on one rank megatron's bucket reduce-scatter and all-gather (gloo copies a bucket
    onto itself in its own thread) are skipped, with bit-identical parameters; two ranks run them."""
    ((logits, norm, ran),) = dist_run(buffer_collectives, 1, True)
    ((ref_logits, ref_norm, ref_ran),) = dist_run(buffer_collectives, 1, False)
    assert ran == [] and ref_ran, (ran, ref_ran)  # megatron's own path does run them
    assert torch.equal(_bits(logits), _bits(ref_logits)) and norm == ref_norm
    for _, _, two in dist_run(buffer_collectives, 2, True):
        assert two == ref_ran


def gathers(rank, world_size):
    """Patch 10: torch.distributed.all_gather on a one-rank group (megatron's checkpoint gathers
    of the optimizer state) is a copy in this thread; two ranks run gloo's."""
    import torch.distributed as dist

    x = torch.arange(100_000, dtype=torch.float32) + rank
    out = [torch.empty_like(x) for _ in range(world_size)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_gather(out, x)
    ran = sorted({e.name for e in prof.events() if "gather" in e.name and "::" in e.name})
    return [bool(torch.equal(o, torch.arange(100_000, dtype=torch.float32) + r))
            for r, o in enumerate(out)], ran


@speed_patch
def test_all_gather_is_a_copy_on_one_rank(dist_run):
    ((same, ran),) = dist_run(gathers, 1)
    assert same == [True] and ran == [], ran
    for same, ran in dist_run(gathers, 2):
        assert same == [True, True] and ran, ran


def reductions(rank, world_size):
    """Patch 10: a synchronous all_reduce (sum, max, min) or broadcast over a one-rank group
    changes nothing and runs nothing; two ranks run gloo's; an op that would change the value
    (product of one rank: unchanged too, but not taken), an asynchronous call and a wrong
    source go to torch as before."""
    import torch.distributed as dist

    x = torch.arange(10, dtype=torch.float32) + rank
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        s, m = x.clone(), x.clone()
        dist.all_reduce(s)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        b = x.clone()
        dist.broadcast(b, src=0)
    ran = sorted({e.name for e in prof.events() if e.name.startswith("c10d::")})
    base = torch.arange(10, dtype=torch.float32)
    values = [torch.equal(s, base * world_size + sum(range(world_size))),
              torch.equal(m, base + world_size - 1), torch.equal(b, base)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(x.clone(), op=dist.ReduceOp.PRODUCT)
        dist.all_reduce(x.clone(), async_op=True).wait()
    taken = sorted({e.name for e in prof.events() if e.name.startswith("c10d::")})
    try:
        dist.broadcast(x.clone(), src=world_size)
        wrong_src = "accepted"
    except (ValueError, RuntimeError):
        wrong_src = "refused"
    return values, ran, taken, wrong_src


@speed_patch
def test_all_reduce_and_broadcast_run_nothing_on_one_rank(dist_run):
    ((values, ran, taken, wrong_src),) = dist_run(reductions, 1)
    assert values == [True] * 3 and ran == [] and taken and wrong_src == "refused", (ran, taken)
    for values, ran, taken, wrong_src in dist_run(reductions, 2):
        assert values == [True] * 3 and ran and wrong_src == "refused", ran


def moe_gpt(ep, dispatcher):
    """Tiny MoE GPT (SequentialMLP, 4 experts, top-2): needs the te_general_gemm fix on CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        expert_model_parallel_size=ep, moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=0.0)
    spec = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def expert_source_key(key, ep_rank, experts_per_rank):
    """Local expert i of EP rank r is global expert r * experts_per_rank + i."""
    if ".local_experts." not in key:
        return key
    head, tail = key.split(".local_experts.")
    index, rest = tail.split(".", 1)
    return f"{head}.local_experts.{int(index) + ep_rank * experts_per_rank}.{rest}"


def moe_forward(rank, world_size, ep, dispatcher, state):
    from megapkl.parallel.groups import init_parallel

    groups = init_parallel(ep=ep, seed=1)
    model = moe_gpt(ep, dispatcher)
    if state is None:
        state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    else:
        own = [k for k, v in model.state_dict().items() if torch.is_tensor(v)]
        model.load_state_dict(
            {k: state[expert_source_key(k, groups.ep_rank, 4 // ep)] for k in own}, strict=False)
    ids, pos, weights = batch()
    rows = slice(rank, rank + 1) if ep > 1 else slice(0, BATCH)  # EP ranks split the batch
    logits = model(ids[rows], pos[rows], attention_mask=None)
    (logits * weights[rows]).sum().backward()
    router_grad = model.decoder.layers[0].mlp.router.weight.grad
    return state, logits.detach(), bool(router_grad.abs().sum() > 0)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_ep2_matches_ep1(dist_run, dispatcher):
    ((state, ref, _),) = dist_run(moe_forward, 1, 1, "allgather", None)
    for rank, (_, logits, router_has_grad) in enumerate(dist_run(moe_forward, 2, 2, dispatcher,
                                                                 state)):
        torch.testing.assert_close(logits, ref[rank:rank + 1], rtol=1e-5, atol=1e-5)
        assert router_has_grad
