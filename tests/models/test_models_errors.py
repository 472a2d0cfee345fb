"""Bad inputs fail early with errors that name what is wrong."""

import json

import pytest

from megapkl.models.hf import HFCheckpointError, HFCheckpoint, check_checkpoint
from megapkl.models.spec import SpecError, load_spec


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpoint(tmp_path / "nope")


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        HFCheckpoint(tmp_path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    from tiny_models import make_checkpoint

    make_checkpoint(str(tmp_path), moe=False, intermediate_size=96)
    with pytest.raises(HFCheckpointError) as err:
        check_checkpoint(load_spec("tiny-qwen3"), HFCheckpoint(tmp_path), check_config=False)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight has shape [96, 64]" in msg
    assert "expects [128, 64]" in msg


def test_config_mismatch_names_the_key(dense_ckpt, tmp_path):
    import shutil

    shutil.copytree(dense_ckpt.path, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 10000.0  # saved by transformers 5
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="config key rope_theta: checkpoint has 10000.0"):
        check_checkpoint(load_spec("tiny-qwen3"), HFCheckpoint(tmp_path / "ck"))


def test_dense_checkpoint_into_moe_config(dense_ckpt):
    with pytest.raises(HFCheckpointError, match="family"):
        check_checkpoint(load_spec("tiny-qwen3-moe"), HFCheckpoint(dense_ckpt.path))
    with pytest.raises(HFCheckpointError, match="mlp.gate.weight is missing"):
        check_checkpoint(load_spec("tiny-qwen3-moe"), HFCheckpoint(dense_ckpt.path),
                         check_config=False)


def test_extra_layers_are_reported(dense_ckpt):
    with pytest.raises(HFCheckpointError, match="does not have: model.layers.1"):
        check_checkpoint(load_spec("tiny-qwen3", {"num_layers": 1}),
                         HFCheckpoint(dense_ckpt.path), check_config=False)


def _load_wrong(rank, world_size, path):
    from tiny_models import build_loaded

    try:
        build_loaded(path, "tiny-qwen3", tp=2)
    except HFCheckpointError as exc:
        return str(exc)
    return "no error"


def test_load_into_model_raises(dist_run, moe_ckpt):
    msgs = dist_run(_load_wrong, 2, moe_ckpt.path)
    assert all("does not match model config 'tiny-qwen3'" in m for m in msgs)


def _moe_tp_without_sp(rank, world_size):
    from megapkl.models.provider import build_model
    from megapkl.parallel.groups import init_parallel

    init_parallel(tp=2)
    try:
        build_model(load_spec("tiny-qwen3-moe"))
    except SpecError as exc:
        return str(exc)
    return "no error"


def test_incompatible_layout_at_build(dist_run):
    msgs = dist_run(_moe_tp_without_sp, 2)
    assert all("parallel.sequence_parallel must be true" in m for m in msgs)
