"""megapkl's weight sync against SGLang's own HTTP front end and weight-update code, on CPU.

megapkl's real `WeightSync.push` talks HTTP to SGLang's FastAPI app (reference_backend.py), so
every request body megapkl sends is validated into SGLang's io_struct class by SGLang's route
(`PauseGenerationReqInput`, `BeginWeightUpdateReqInput`, `UpdateWeightsFromTensorReqInput`,
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`,
`UpdateWeightFromDiskReqInput`, `UpdateWeightVersionReqInput`, `ContinueGenerationReqInput`, ...)
and handled by SGLang's scheduler-side `SchedulerWeightUpdaterManager` (sessions) and the model
runner's `WeightUpdater`:
- tensor: `TpModelWorker.deserialize_own_rank` (`monkey_patch_torch_reductions` +
  `MultiprocessingSerializer.deserialize`) and `WeightUpdater.update_weights_from_tensor`;
- distributed: `WeightUpdater.init_weights_update_group` (`init_custom_process_group`, here on
  gloo) and `WeightUpdater.receive_weights_from_distributed`, which allocates the receive buffers
  with the declared dtypes and broadcasts into them, FP8 included;
- disk: `get_model_loader` and the default-loader check of `WeightUpdater.update_weights_from_disk`.
What reaches the model's `load_weights` is recorded and compared bit for bit with what megapkl
sent. Not executed: the model's own `load_weights` (GPU layers) and the TokenizerManager (see
reference_backend.py).
"""
from __future__ import annotations

import pytest
import torch

from megapkl_side import launched

SEQUENCE = ["PauseGenerationReqInput", "BeginWeightUpdateReqInput", "*",
            "EndWeightUpdateReqInput", "UpdateWeightVersionReqInput",
            "ContinueGenerationReqInput"]


def _weights(hf_config: dict) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's weights as the trainer exports them (HF names, bf16)."""
    from megapkl.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    engine = EmbeddedEngine(hf_config, seed=0)
    return [(n, p.detach().to(torch.bfloat16).contiguous())
            for n, p in engine.model.named_parameters()]


def _sync(run, mode: str, tmp_path):
    from megapkl.rollout.sglang.build import sync_settings
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync, identity

    sg = run.cfg.rollout.sglang
    base = sync_settings(sg, ["http://127.0.0.1:1"])
    settings = SyncSettings(mode=mode, bucket_bytes=64 << 10, pause_mode=base.pause_mode,
                            colocate=base.colocate, timeout_s=15.0,
                            group_address=base.group_address)
    transform = identity
    if run.cfg.rollout.fp8:
        from megapkl.rollout.fp8 import sync_transform

        transform = sync_transform()
    return WeightSync(settings, export_dir=tmp_path / "export", transform=transform,
                      hf_config=run.hf_config), transform


def _push(sglang, run, mode: str, tmp_path, named=None):
    """megapkl pushes version 7 of `named` (default: the model's weights) to a fresh SGLang front
    end; (error or None, sent, log, received)."""
    from megapkl.rollout.engine import WeightUpdateError
    from megapkl.rollout.sglang.weights import Target, buckets

    url = sglang.call("start_front", run.sglang_argv())
    sync, transform = _sync(run, mode, tmp_path)
    named = _weights(run.hf_config) if named is None else named
    sent = [pair for b in buckets(named, sync.s.bucket_bytes) for pair in transform(b)]
    error = None
    try:
        sync.push([Target(url, 1)], named, version=7)
    except WeightUpdateError as exc:
        error = str(exc)
    finally:
        sync.close_group([Target(url, 1)])
    return error, sent, sglang.call("front_log"), sglang.call("front_received")


def _same(sent, received) -> None:
    """SGLang received every tensor megapkl sent, each once, bit for bit, under its name (the order
    is the sender's business: a flattened bucket goes by element size)."""
    from collections import Counter

    names = Counter(n for n, *_ in received)
    assert names == Counter(n for n, _ in sent), (
        f"missing {sorted(Counter(n for n, _ in sent) - names)}, unexpected or repeated "
        f"{sorted(names - Counter(n for n, _ in sent))}")
    assert all(c == 1 for c in names.values()), names.most_common(3)
    got = {name: rest for name, *rest in received}
    for name, t in sent:
        dtype, shape, data = got[name]
        assert dtype == str(t.dtype).replace("torch.", ""), name
        assert shape == list(t.shape), name
        assert data == t.contiguous().view(torch.uint8).numpy().tobytes(), name


def _check_sequence(log: list[dict], middle: str) -> None:
    classes = [e["class"] for e in log]
    start, end = classes.index("BeginWeightUpdateReqInput"), classes.index("EndWeightUpdateReqInput")
    assert classes[0] == "PauseGenerationReqInput" and classes[-1] == "ContinueGenerationReqInput"
    assert classes[end:] == SEQUENCE[3:]
    assert set(classes[start + 1:end]) == {middle}, classes


@pytest.mark.parametrize("name", ["bf16_separate_gpus", "default_fp8_colocated",
                                  "llama_fp8_colocated"])
def test_tensor_sync_is_loaded_bit_for_bit(sglang, name, tmp_path, monkeypatch):
    run = launched(name, tmp_path, monkeypatch)
    error, sent, log, received = _push(sglang, run, "tensor", tmp_path)
    assert error is None, error
    _check_sequence(log, "UpdateWeightsFromTensorReqInput")
    _same(sent, received)
    version = [e for e in log if e["class"] == "UpdateWeightVersionReqInput"][0]["fields"]
    assert version["new_version"] == "7"
    assert sglang.call("front_state")["weight_version"] == "7"


def test_distributed_sync_is_received_bit_for_bit(sglang, tmp_path, monkeypatch):
    run = launched("bf16_separate_gpus", tmp_path, monkeypatch)
    error, sent, log, received = _push(sglang, run, "distributed", tmp_path)
    assert error is None, error
    init = [e for e in log if e["class"] == "InitWeightsUpdateGroupReqInput"]
    assert len(init) == 1 and init[0]["fields"]["rank_offset"] == 1
    group = {"InitWeightsUpdateGroupReqInput", "DestroyWeightsUpdateGroupReqInput"}
    _check_sequence([e for e in log if e["class"] not in group],
                    "UpdateWeightsFromDistributedReqInput")
    _same(sent, received)


def test_fp8_distributed_sync_is_received_or_refused_up_front(sglang, tmp_path, monkeypatch):
    """FP8 weights over a gloo group (CPU tensors): SGLang allocates float8_e4m3fn receive
    buffers and broadcasts into them. Either SGLang ends up holding exactly the e4m3 weights and
    scales megapkl sent, or megapkl refuses the sync before any weight is sent, with an error
    that names the settings (a server must never be left half-updated or get the bytes as
    another dtype)."""
    from megapkl.rollout.engine import WeightUpdateError

    run = launched("default_fp8_colocated", tmp_path, monkeypatch)
    try:
        error, sent, log, received = _push(sglang, run, "distributed", tmp_path)
    except RuntimeError as exc:  # a collective that timed out: neither delivered nor refused
        pytest.fail(f"the FP8 broadcast failed: {exc}")
    assert any(t.dtype == torch.float8_e4m3fn for _, t in sent)
    updates = [e for e in log if e["class"] == "UpdateWeightsFromDistributedReqInput"]
    if error is None:
        _same(sent, received)
    else:
        assert not updates and not received, (error, [e["class"] for e in log])
        assert "fp8" in error.lower() and "distributed" in error.lower(), error


def test_fp8_distributed_buckets_of_any_shape_are_received(sglang, tmp_path, monkeypatch):
    """SGLang's flattened-bucket receive (`FlattenedTensorBucket.empty`) refuses a tensor that
    does not start at a multiple of its element size. The model's own shapes never misalign; here
    an FP8 weight of an odd byte count (33 x 129) shares a bucket with float32 scales and a bf16
    weight of an odd element count, and every tensor must still arrive bit for bit."""
    run = launched("default_fp8_colocated", tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(3)
    named = [("model.layers.0.mlp.down_proj.weight", torch.randn(33, 129, generator=g)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(130, 70, generator=g)),
             ("model.norm.weight", torch.randn(67, generator=g))]
    named = [(n, t.to(torch.bfloat16)) for n, t in named]
    error, sent, log, received = _push(sglang, run, "distributed", tmp_path, named)
    assert {t.dtype for _, t in sent} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    assert error is None, error
    _same(sent, received)


def test_disk_sync_is_accepted_by_a_dummy_started_server(sglang, tmp_path, monkeypatch):
    run = launched("bf16_separate_gpus", tmp_path, monkeypatch)
    error, sent, log, _ = _push(sglang, run, "disk", tmp_path)
    disk = [e["fields"] for e in log if e["class"] == "UpdateWeightFromDiskReqInput"]
    assert len(disk) == 1, [e["class"] for e in log]
    body = {k: disk[0][k] for k in ("model_path", "load_format", "flush_cache")}
    got = sglang.call("disk_loader", run.sglang_argv(), body)
    assert got["accepted"], got
    assert error is None, error
