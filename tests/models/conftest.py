"""Fixtures: tiny random HF checkpoints, saved once per session (see tiny_models.py)."""

import pytest


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory):
    from tiny_models import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3")), moe=False)


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory):
    from tiny_models import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), moe=True)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    from tiny_models import make_llama_checkpoint

    return make_llama_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")))
