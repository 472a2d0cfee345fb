"""SGLang client, pure parts: /generate bodies, response decoding (log-probs, top-K, routed-expert
rows -> the trainer's replay rows), bucketing, the tensor payload, config errors."""
from __future__ import annotations

import base64
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sglang import protocol as P
from megapkl.rollout.sglang.weights import buckets, serialize_named_tensors


def _item(ids, logps, *, top=None, version="3", finish=None, experts=None):
    meta = {"output_token_logprobs": [[lp, i, None] for lp, i in zip(logps, ids)],
            "finish_reason": finish or {"type": "length", "length": len(ids)},
            "weight_version": version}
    if top is not None:
        meta["output_top_logprobs"] = top
    if experts is not None:
        meta["routed_experts"] = experts
    return {"output_ids": list(ids), "meta_info": meta}


def test_generate_payload_fields_and_values():
    s = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5, topk_logprobs=3,
                       stop_token_ids=(2, 9), return_routed_experts=True)
    common = {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
              "ignore_eos": False, "stop_token_ids": [2, 9]}
    body = P.generate_payload([5, 6], s, n=4)  # no seed: one request with n
    assert body["input_ids"] == [5, 6] and body["logprob_start_len"] == -1
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 3
    assert body["return_routed_experts"] is True and not P.is_batch(body)
    assert body["sampling_params"] == {**common, "n": 4}
    assert set(body) <= P.GENERATE_FIELDS and set(body["sampling_params"]) <= P.SAMPLING_FIELDS
    assert P.generate_payload([5, 6], s, n=4, seed=11)["sampling_params"] == \
        {**common, "n": 4, "sampling_seed": 11}
    # to servers that draw from the seed alone: n copies of the prompt, a seed each (SGLang
    # copies one request's seed to its n samples)
    seeded = P.generate_payload([5, 6], s, n=4, seed=11, seed_each=True)
    assert seeded["input_ids"] == [[5, 6]] * 4 and P.is_batch(seeded)
    assert seeded["sampling_params"] == [{**common, "n": 1, "sampling_seed": P.sample_seed(11, j)}
                                         for j in range(4)]
    assert {k: v for k, v in seeded.items() if k not in ("input_ids", "sampling_params")} == \
        {k: v for k, v in body.items() if k not in ("input_ids", "sampling_params")}
    single = P.generate_payload([5, 6], s, n=1, seed=11, seed_each=True)  # its seed as given
    assert single["input_ids"] == [5, 6] and single["sampling_params"]["sampling_seed"] == 11
    plain = P.generate_payload([1], SamplingParams(), n=1)
    assert "top_logprobs_num" not in plain and "return_routed_experts" not in plain
    with pytest.raises(AssertionError, match="undeclared"):
        P.check_fields("pause_generation", {"mode": "abort", "bogus": 1})


def test_sample_seeds_distinct_and_deterministic():
    seeds = [P.sample_seed(123, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and seeds == [P.sample_seed(123, i) for i in range(1000)]
    assert all(0 <= s < 2 ** 31 for s in seeds)


def test_decode_logprobs_topk_finish_version():
    s = SamplingParams(topk_logprobs=2)
    top = [[[-0.1, 4, None], [-2.0, 7, None]], [[-0.3, 2, None], [-1.5, 4, None]]]
    d = P.decode_response(_item([4, 2], [-0.1, -0.3], top=top, version="12",
                                finish={"type": "stop", "matched": 2}), prompt_len=3, sampling=s)
    assert d.response_ids.tolist() == [4, 2] and d.finish_reason == "stop" and d.version == 12
    assert torch.allclose(d.logp, torch.tensor([-0.1, -0.3]))
    assert d.topk_ids.tolist() == [[4, 7], [2, 4]]
    assert torch.allclose(d.topk_logp, torch.tensor([[-0.1, -2.0], [-0.3, -1.5]]))
    with pytest.raises(ValueError, match="rollout.topk_logprobs"):  # server gave fewer than K
        P.decode_response(_item([4, 2], [-0.1, -0.3], top=[t[:1] for t in top]), prompt_len=3,
                          sampling=s)
    with pytest.raises(P.ProtocolError, match="weight_version"):
        P.decode_response(_item([4], [-0.1], version="default"), prompt_len=1,
                          sampling=SamplingParams())
    bad = _item([4, 2], [-0.1, -0.3])
    bad["output_ids"] = [4, 3]
    with pytest.raises(P.ProtocolError, match="disagree"):
        P.decode_response(bad, prompt_len=1, sampling=SamplingParams())
    with pytest.raises(P.ProtocolError, match="2 response"):
        P.as_response_list(bad, 2)


def _sglang_experts(moe_rows: torch.Tensor, layers: int, moe_layers: list[int]) -> str:
    """Encode [rows, moe_layers, k] the way SGLang sends it: all hidden layers, dense ones 0."""
    full = torch.zeros(moe_rows.shape[0], layers, moe_rows.shape[2], dtype=torch.int32)
    full[:, moe_layers] = moe_rows
    return base64.b64encode(full.numpy().astype(np.int32).tobytes()).decode()


@pytest.mark.parametrize("cfg,expect", [
    (dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2), [0, 1, 2, 3]),
    (dict(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
          mlp_only_layers=[3]), [1, 5]),
])
def test_routed_experts_rows_map_to_replay_positions(cfg, expect):
    assert P.moe_layer_indices(cfg) == expect
    prompt_len, resp = 5, 3
    rows = prompt_len + resp - 1  # one row per token whose successor was predicted
    g = torch.Generator().manual_seed(0)
    moe = torch.randint(0, 8, (rows, len(expect), 2), generator=g, dtype=torch.int32)
    item = _item([4, 5, 2], [-1.0, -1.0, -1.0],
                 experts=_sglang_experts(moe, cfg["num_hidden_layers"], expect))
    d = P.decode_response(item, prompt_len=prompt_len, hf_config=cfg,
                          sampling=SamplingParams(return_routed_experts=True))
    assert d.routed_experts.dtype == torch.int32 and torch.equal(d.routed_experts, moe)
    short = _item([4, 5], [-1.0, -1.0], experts=item["meta_info"]["routed_experts"])
    with pytest.raises(P.ProtocolError, match="routed_experts"):  # rows do not fit P + R - 1
        P.decode_response(short, prompt_len=prompt_len, hf_config=cfg,
                          sampling=SamplingParams(return_routed_experts=True))
    with pytest.raises(ValueError, match="model.routing_replay"):  # key absent: dense server
        P.decode_response(_item([4], [-1.0]), prompt_len=1, hf_config=cfg,
                          sampling=SamplingParams(return_routed_experts=True))
    with pytest.raises(ValueError, match="model.routing_replay"):  # trainer model dense
        P.decode_response(item, prompt_len=prompt_len, hf_config={"num_hidden_layers": 4},
                          sampling=SamplingParams(return_routed_experts=True))


def test_buckets_respect_size_and_order():
    ts = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 100, 1])]
    groups = list(buckets(ts, bucket_bytes=25 * 4))
    assert [[n for n, _ in g] for g in groups] == [["w0", "w1"], ["w2"], ["w3", "w4"], ["w5"],
                                                   ["w6"]]
    assert [n for g in groups for n, _ in g] == [n for n, _ in ts]
    for g in groups:
        size = sum(t.numel() * 4 for _, t in g)
        assert size <= 100 or len(g) == 1
    with pytest.raises(ValueError):
        list(buckets(ts, 0))


def test_tensor_payload_round_trips_bit_exact():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16))]
    payload, alive = serialize_named_tensors(named)
    again, _ = serialize_named_tensors(named)  # every push gets segments of its own
    assert not any(x.is_shared() for _, x in named) and payload != again
    back = pickle.loads(base64.b64decode(payload))  # ForkingPickler's loads is pickle.loads
    assert [n for n, _ in back] == ["a", "b"]
    for (_, x), (_, y) in zip(named, back):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _shm_name(t):
    return t.untyped_storage()._share_filename_cpu_()[1].decode()


def _in_shm(name):
    import os

    return os.path.exists("/dev/shm/" + name.lstrip("/"))


def test_a_payload_lays_its_tensors_out_in_one_segment_freed_with_its_last_holder():
    import gc

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("c", torch.randn(2, 3).t())]  # not contiguous: copied into place all the same
    payload, alive = serialize_named_tensors(named)
    names = {_shm_name(t) for t in alive}
    assert len(names) == 1 and all(t.is_shared() and t.is_contiguous() for t in alive)
    assert all(t.storage_offset() * t.element_size() % 64 == 0 for t in alive)  # aligned
    back = pickle.loads(base64.b64decode(payload))  # what a server does with a payload
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(named, back))
    del alive, back
    gc.collect()
    assert not any(_in_shm(n) for n in names)


def _stored(tmp, tensors):
    from megapkl.rollout.version_store import VersionStore

    store = VersionStore(Path(tmp))
    store.save(1, tensors)
    return store.get(1)


def test_the_tensor_sync_reads_a_stored_version_into_two_kept_segments(tmp_path):
    """Bucket k is read from the version's file straight into slot k % 2; the next push reuses
    both segments (same names, no fresh pages); a segment whose name left /dev/shm (a server's
    manager unlinks what it opened when it dies) is replaced; the sync's end frees them."""
    import gc
    import os

    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync

    g = torch.Generator().manual_seed(0)
    tensors = [(f"w{i}", torch.randn(40, 8, generator=g).to(torch.bfloat16)) for i in range(5)]
    tensors.append(("odd", torch.randn(3, generator=g)))  # 12 bytes: the next one stays aligned
    source = _stored(tmp_path, tensors)
    sync = WeightSync(SyncSettings(mode="tensor", bucket_bytes=2 * 40 * 8 * 2))

    def one_push():
        got, slots = [], []
        for bucket in sync._tensor_buckets(source, sync._buffers):  # checked before it is reused
            got += [(n, t.clone()) for n, t in bucket]
            slots.append({_shm_name(t) for _, t in bucket})
        assert [n for n, _ in got] == [n for n, _ in tensors]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, tensors))
        return slots

    first = one_push()
    assert len(first) == 3 and all(len(s) == 1 for s in first)
    assert first[0] == first[2] != first[1]  # two segments, taken in turn
    assert one_push() == first  # kept: the next push writes into the same pages
    gone = next(iter(first[0]))
    os.unlink("/dev/shm/" + gone.lstrip("/"))
    again = one_push()
    assert again[1] == first[1] and gone not in again[0] and again[0] == again[2]
    names = set().union(*again)
    del sync
    gc.collect()
    assert not any(_in_shm(n) for n in names)


def test_a_stored_bucket_is_read_in_one_call_aligned_as_in_its_file(tmp_path, monkeypatch):
    """Each bucket of a stored version is one read into its slot, every tensor placed at its
    file offset modulo 64 (the kernel copies a read aligned so at ~1.7x the speed); a file whose
    tensors are not at multiples of their element size is read tensor by tensor instead."""
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync
    from megapkl.rollout.version_store import VersionReader

    calls = {"span": 0, "one": 0}
    for name, key in (("read_span", "span"), ("read_into", "one")):
        def counted(self, *args, _f=getattr(VersionReader, name), _k=key):
            calls[_k] += 1
            return _f(self, *args)
        monkeypatch.setattr(VersionReader, name, counted)
    g = torch.Generator().manual_seed(0)
    aligned = [("a", torch.randn(40, 8, generator=g).to(torch.bfloat16)),
               ("odd", torch.randn(3, generator=g)),  # 12 bytes: what follows is off by 12
               ("b", torch.randn(40, 8, generator=g).to(torch.bfloat16))]
    unaligned = aligned + [("c", torch.arange(5, dtype=torch.uint8)),  # 5 bytes: ...
                           ("d", torch.randn(4, generator=g).to(torch.bfloat16))]  # odd offset
    for k, tensors in enumerate((aligned, unaligned)):
        source = _stored(tmp_path / str(k), tensors)
        with source.open() as reader:
            offsets = {n: reader.offsets(i, 1)[0] for i, (n, _, _) in enumerate(reader.layout)}
        sync = WeightSync(SyncSettings(mode="tensor", bucket_bytes=1 << 20))
        calls.update(span=0, one=0)
        got = [(n, t) for bucket in sync._tensor_buckets(source, sync._buffers)
               for n, t in bucket]
        assert [n for n, _ in got] == [n for n, _ in tensors]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, tensors))
        if tensors is aligned:
            assert calls == {"span": 1, "one": 0}
            assert all(t.data_ptr() % 64 == offsets[n] % 64 for n, t in got)
            assert offsets["b"] % 64 != 0  # not trivially aligned
        else:
            assert calls == {"span": 0, "one": len(tensors)}
        sync.close()


def test_a_truncated_stored_version_fails_the_tensor_sync_naming_its_file(tmp_path):
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync
    from megapkl.rollout.version_store import VersionStoreError

    source = _stored(tmp_path, [("a", torch.randn(64)), ("b", torch.randn(64))])
    with source.open() as reader, pytest.raises(ValueError, match="tensor 'a'"):
        reader.read_into(0, torch.empty(64, dtype=torch.bfloat16))  # not the stored dtype
    data = source.path.read_bytes()
    source.path.write_bytes(data[:-8])
    sync = WeightSync(SyncSettings(mode="tensor"))
    with pytest.raises(VersionStoreError, match=str(source.path)):
        list(sync._tensor_buckets(source, sync._buffers))


def test_config_fields_and_errors():
    from megapkl.config.sections import SGLangConfig
    from megapkl.config.typed import ConfigError, build

    sg = build(SGLangConfig, {"weight_sync": "distributed", "bucket_mb": 64, "pause_mode": "abort",
                              "urls": ["http://127.0.0.1:1"]}, key="rollout.sglang")
    assert sg.weight_sync == "distributed" and sg.bucket_mb == 64
    with pytest.raises(ConfigError, match="rollout.sglang.weight_sync"):
        build(SGLangConfig, {"weight_sync": "nccl"}, key="rollout.sglang")
    with pytest.raises(ConfigError, match=r"urls\[0\]"):
        build(SGLangConfig, {"urls": ["localhost:3000"]}, key="rollout.sglang")
    with pytest.raises(ConfigError, match="router_url"):
        build(SGLangConfig, {"router_url": "http://127.0.0.1:2"}, key="rollout.sglang")
