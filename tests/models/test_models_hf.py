"""Hugging Face checkpoints into and out of the sharded megatron model.

A tiny random Qwen3 (tied embeddings, like 1.7B/4B) and Qwen3-MoE (untied, like 30B-A3B) are
imported at several TP/PP/EP layouts: logits equal the HF model's in fp32, and the streamed export
reproduces the HF state dict exactly on every rank.
"""

import pytest
import torch

from tiny_models import build_loaded, forward_logits, load_forward_export

ATOL = 1e-4


def _import_export(rank, world_size, ckpt, layout):
    _, logits, exported = load_forward_export(ckpt, layout)
    mismatched = sorted(n for n in ckpt.state_dict
                        if n not in exported or not torch.equal(exported[n], ckpt.state_dict[n]))
    return logits, sorted(exported), mismatched


def _check(results, ckpt):
    logits = [r[0] for r in results if r[0] is not None]
    assert logits
    for got in logits:
        torch.testing.assert_close(got, ckpt.logits, atol=ATOL, rtol=0)
    for _, names, mismatched in results:
        assert names == sorted(ckpt.state_dict)
        assert mismatched == []


DENSE_LAYOUTS = {  # id: (world size, layout)
    "tp1": (1, dict()),
    "tp2": (2, dict(tp=2)),
    "tp2sp": (2, dict(tp=2, sp=True)),
    "pp2": (2, dict(pp=2)),
    "tp2pp2": (4, dict(tp=2, pp=2)),
}
MOE_LAYOUTS = {
    "tp1": (1, dict()),
    "ep2": (2, dict(ep=2)),
    "tp2sp_etp2": (2, dict(tp=2, sp=True)),
    "tp2sp_ep2": (2, dict(tp=2, sp=True, ep=2, etp=1)),
    "tp2sp_ep2_dp2": (4, dict(tp=2, sp=True, ep=2, etp=1)),
    "pp2_ep2": (4, dict(pp=2, ep=2, etp=1)),
}


@pytest.mark.parametrize("layout", list(DENSE_LAYOUTS))
def test_dense_import_logits_and_export(dist_run, dense_ckpt, layout):
    world, kw = DENSE_LAYOUTS[layout]
    _check(dist_run(_import_export, world, dense_ckpt, kw), dense_ckpt)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_import_logits_and_export(dist_run, moe_ckpt, layout):
    world, kw = MOE_LAYOUTS[layout]
    _check(dist_run(_import_export, world, moe_ckpt, kw), moe_ckpt)


def _save_reload(rank, world_size, ckpt, out):
    from megapkl.models.hf import save_hf_checkpoint

    groups, model = build_loaded(ckpt.path, ckpt.name, tp=2, sp=True)
    save_hf_checkpoint(model, out, groups=groups, shard_bytes=64 << 10)
    return None


def test_save_hf_checkpoint_loads_in_transformers(dist_run, moe_ckpt, tmp_path):
    """save_hf_checkpoint writes sharded safetensors + index + config.json that HF loads."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "export")
    dist_run(_save_reload, 2, moe_ckpt, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reloaded(moe_ckpt.ids).logits
    torch.testing.assert_close(logits, moe_ckpt.logits, atol=ATOL, rtol=0)
    assert len(list(tmp_path.glob("export/*.safetensors"))) > 1  # really streamed in shards
    # ... and our reader follows the index of a sharded checkpoint.
    from megapkl.models.hf import HFCheckpoint, check_checkpoint
    from megapkl.models.hf_mapping import Piece
    from megapkl.models.spec import load_spec

    reader = HFCheckpoint(out)
    check_checkpoint(load_spec(moe_ckpt.name), reader)
    for name, tensor in moe_ckpt.state_dict.items():
        assert torch.equal(reader.read(Piece(name)), tensor)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(reader.read(Piece(q, 1, 8, 24)), moe_ckpt.state_dict[q][:, 8:24])


def test_bucketed_bounds_bucket_size():
    from megapkl.models.hf import bucketed

    items = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(bucketed(items, bucket_bytes=100))  # float32: 40, 40, 120, 20, 400, 4 bytes
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]


def _padded(rank, world_size, ckpt):
    from megapkl.models.hf import export_hf_weights

    groups, model = build_loaded(ckpt.path, ckpt.name, tp=2, spec_overrides=dict(
        vocab_size=126, make_vocab_size_divisible_by=4))
    with torch.no_grad():
        logits = forward_logits(model, groups, ckpt.ids)
    rows = model.embedding.word_embeddings.weight.shape[0]
    return logits, rows, dict(export_hf_weights(model, groups=groups))


def test_vocab_padding_round_trip(dist_run, tmp_path):
    """vocab 126 at TP2 with make_vocab_size_divisible_by=4: 128 rows, zero padding rows that
    the export strips again; the real logits are unchanged."""
    from tiny_models import make_checkpoint

    ckpt = make_checkpoint(str(tmp_path), moe=False, vocab_size=126)
    for logits, rows, exported in dist_run(_padded, 2, ckpt):
        assert rows == 64  # 128 padded rows over 2 ranks
        torch.testing.assert_close(logits[..., :126], ckpt.logits, atol=ATOL, rtol=0)
        assert torch.equal(logits[..., 126:], torch.zeros_like(logits[..., 126:]))
        assert all(torch.equal(exported[n], t) for n, t in ckpt.state_dict.items())
