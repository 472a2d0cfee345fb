"""R3 routing replay through megatron-core's RouterReplay, per model and per rank.

The "rollout engine" is the Hugging Face model: its routing (SGLang layout, rows = tokens,
[num_moe_layers, top_k]) is replayed in megatron after the router weights were perturbed until
most tokens would route differently. Checked at EP1, EP2 and TP2+SP:
- recording at the original weights reproduces the HF routing; replaying it gives the recording
  forward's logits exactly;
- replay at perturbed weights uses exactly the recorded experts, and its logits and router
  gradients equal HF's with the same perturbed router and the experts forced to the recorded ones
  (probabilities re-gathered at the replayed indices, so the router still learns).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from tiny_models import build_loaded, gather_vocab, positions

NOISE_STD = 0.5


def _hf_model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()


def _hf_routing(model, ids):
    """[b, s, L, k] experts chosen by the HF model (what the rollout engine reports)."""
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [torch.topk(lg, k, dim=-1).indices for lg in out.router_logits]  # [b*s, k]
    b, s = ids.shape
    return torch.stack(per_layer, dim=1).reshape(b, s, len(per_layer), k)


@contextlib.contextmanager
def _forced_topk(routed):
    """HF's MoE blocks call torch.topk once per layer, in order: hand them `routed` instead."""
    b, s, layers, k = routed.shape
    queue = [routed[:, :, layer].reshape(b * s, k) for layer in range(layers)]
    original = torch.topk

    def forced(x, k, dim=-1, **kwargs):
        idx = queue.pop(0)
        return x.gather(1, idx), idx

    torch.topk = forced
    try:
        yield
    finally:
        torch.topk = original
    assert not queue


def _noise(layers, experts, hidden):
    gen = torch.Generator().manual_seed(11)
    return torch.randn(layers, experts, hidden, generator=gen) * NOISE_STD


def _loss_weights(ids):
    return torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(3))


def _hf_reference(ckpt, routed):
    model = _hf_model(ckpt)
    noise = _noise(2, 4, 64)
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            block.mlp.gate.weight += noise[layer]
    with _forced_topk(routed):
        logits = model(ckpt.ids).logits
    (logits * _loss_weights(ckpt.ids)).sum().backward()
    grads = [block.mlp.gate.weight.grad.clone() for block in model.model.layers]
    return logits.detach(), grads


def _sorted(x):
    return x.sort(dim=-1).values


def _gather_seq(x, groups, sp):
    """[b, s_local, ...] -> [b, s, ...] across the TP ranks under sequence parallelism."""
    if not sp:
        return x
    parts = [torch.empty_like(x) for _ in range(groups.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=1)


def _r3_worker(rank, world_size, ckpt, layout, routed):
    from megapkl.parallel import replay

    groups, model = build_loaded(ckpt.path, ckpt.name, routing_replay=True, **layout)
    sp = bool(layout.get("sp"))
    ids, pos = ckpt.ids, positions(ckpt.ids)
    out = {}
    # 1. record at the original weights, then replay them
    with torch.no_grad():
        with replay.recording(model) as rec:
            out["logits_record"] = gather_vocab(model(ids, pos, None), groups.tp)
        out["recorded"] = _gather_seq(replay.to_token_layout(rec, ids.shape[0]), groups, sp)
        with replay.replaying(model, routed, groups=groups):
            out["logits_replay"] = gather_vocab(model(ids, pos, None), groups.tp)
    # 2. perturb the routers
    noise = _noise(2, 4, 64)
    with torch.no_grad():
        for layer, router in replay.moe_routers(model):
            router.weight += noise[layer]
        with replay.recording(model) as rec:
            model(ids, pos, None)
        out["free_routing"] = _gather_seq(replay.to_token_layout(rec, ids.shape[0]), groups, sp)
    # 3. replay at the perturbed weights, observing what the routers actually used
    used = []

    def observe(module, args, result):  # result = (probs, routing_map [tokens, experts])
        routing_map = result[1]
        used.append(routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1))

    hooks = [router.register_forward_hook(observe) for _, router in replay.moe_routers(model)]
    with replay.replaying(model, routed, groups=groups):
        logits = model(ids, pos, None)
    for hook in hooks:
        hook.remove()
    shard = logits.shape[-1]
    weights = _loss_weights(ids)[..., groups.tp_rank * shard:(groups.tp_rank + 1) * shard]
    (logits * weights).sum().backward()  # each TP rank's vocab shard; megatron sums the rest
    out["logits_perturbed"] = gather_vocab(logits.detach(), groups.tp)
    out["used"] = _gather_seq(replay.to_token_layout(used, ids.shape[0]), groups, sp)
    grads = []
    for _, router in replay.moe_routers(model):
        grad = router.weight.grad.clone()
        if sp:  # each TP rank routed its own part of the sequence
            dist.all_reduce(grad, group=groups.tp)
        grads.append(grad)
    out["router_grads"] = grads
    return out


LAYOUTS = {"ep1": (1, dict()), "ep2": (2, dict(ep=2)), "tp2sp": (2, dict(tp=2, sp=True)),
           "tp2sp_ep2": (2, dict(tp=2, sp=True, ep=2, etp=1))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_routing_replay(dist_run, moe_ckpt, layout):
    world, kw = LAYOUTS[layout]
    routed = _hf_routing(_hf_model(moe_ckpt), moe_ckpt.ids)
    ref_logits, ref_grads = _hf_reference(moe_ckpt, routed)
    for out in dist_run(_r3_worker, world, moe_ckpt, kw, routed):
        assert torch.equal(_sorted(out["recorded"]), _sorted(routed))
        assert torch.equal(out["logits_replay"], out["logits_record"])
        torch.testing.assert_close(out["logits_record"], moe_ckpt.logits, atol=1e-4, rtol=0)
        changed = (_sorted(out["free_routing"]) != _sorted(routed)).any(-1).float().mean()
        assert changed > 0.5, f"perturbation too small: {changed:.2f} of routings changed"
        assert torch.equal(_sorted(out["used"]), _sorted(routed))
        torch.testing.assert_close(out["logits_perturbed"], ref_logits, atol=1e-4, rtol=0)
        for got, ref in zip(out["router_grads"], ref_grads):
            assert ref.abs().max() > 0
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_local_replay_indices_layouts():
    from megapkl.parallel.replay import cp_slice, local_replay_indices, to_token_layout

    b, s, layers, k = 2, 8, 3, 2
    routed = torch.arange(b * s * layers * k).reshape(b, s, layers, k)
    full = local_replay_indices(routed, [0, 1, 2])
    assert full[1].shape == (s * b, k)
    assert torch.equal(full[1][3 * b + 1], routed[1, 3, 1])  # row = s * b + batch row
    assert torch.equal(to_token_layout(full, b), routed)
    # TP2 + SP: rank 1 holds the second half of the sequence; PP: only layer 2 here.
    (sp1,) = local_replay_indices(routed, [2], tp_rank=1, tp_size=2, sequence_parallel=True)
    assert torch.equal(to_token_layout([sp1], b)[:, :, 0], routed[:, 4:, 2])
    # CP2: rank 0 holds chunks 0 and 3 of 4.
    assert torch.equal(cp_slice(torch.arange(8)[None], 0, 2), torch.tensor([[0, 1, 6, 7]]))
    (cp0,) = local_replay_indices(routed, [0], cp_rank=0, cp_size=2)
    assert torch.equal(to_token_layout([cp0], b)[:, :, 0], routed[:, [0, 1, 6, 7], 0])
    with pytest.raises(ValueError, match="batch, seq, moe_layers, top_k"):
        local_replay_indices(routed[0], [0])


def _replay_off(rank, world_size, ckpt):
    from megapkl.parallel import replay

    _, model = build_loaded(ckpt.path, ckpt.name)
    try:
        replay.set_action(model, "replay")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_replay_needs_the_option(dist_run, moe_ckpt):
    (msg,) = dist_run(_replay_off, 1, moe_ckpt)
    assert "ModelOptions(routing_replay=True)" in msg
