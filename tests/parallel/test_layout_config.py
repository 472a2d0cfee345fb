"""Parallel layouts megatron-core or the data path cannot run are refused at config validation,
naming the key, before any process group starts."""
import pytest

from megapkl.config import ConfigError, load_config

DEMO = "configs/demo/cpu_demo.yaml"


@pytest.mark.parametrize("overrides, key, text", [
    (["parallel.max_tokens_per_micro_batch=40", "rollout.max_prompt_len=16", "parallel.data=auto",
      "rollout.max_response_len=32"], "parallel.max_tokens_per_micro_batch",
     "cannot hold the longest response"),
    # CP=2 pads every sequence to a multiple of 4: 48 + 1 -> 52 > 50
    (["parallel.max_tokens_per_micro_batch=50", "rollout.max_prompt_len=16",
      "rollout.max_response_len=33", "parallel.context=2", "parallel.data=1"],
     "parallel.max_tokens_per_micro_batch", "padded to 52"),
    (["model.name=tiny-qwen3-moe", "parallel.expert=2", "parallel.tensor=2", "parallel.data=2"],
     "parallel.sequence_parallel", "needs sequence parallelism"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "tensor > 1"),
])
def test_layout_refused(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert key in str(err.value) and text in str(err.value), str(err.value)


def test_token_budget_accepted_and_replaces_micro_batch_size():
    cfg = load_config(DEMO, ["parallel.max_tokens_per_micro_batch=64", "rollout.max_prompt_len=16",
                             "rollout.max_response_len=32", "parallel.micro_batch_size=7"])
    assert cfg.parallel.max_tokens_per_micro_batch == 64   # micro_batch_size 7 would not divide
