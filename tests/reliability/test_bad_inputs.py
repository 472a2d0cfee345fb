"""Bad inputs not covered elsewhere: data files (empty, undecodable bytes), non-finite reward
values, a response budget beyond the model's positions."""
import pytest

from megapkl.config import ConfigError, load_config
from megapkl.rollout.data import DataError, PromptDataset, read_prompt_file
from megapkl.rollout.synthetic import CharTokenizer

DEMO = "configs/demo/cpu_demo.yaml"


def test_empty_prompt_file_names_the_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=rf"^{path}: no usable prompts \(0 read"):
        PromptDataset.from_file(str(path), CharTokenizer(), template="raw")


def test_undecodable_bytes_name_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_prompt_file(str(path))
    records, skipped = read_prompt_file(str(path), on_error="skip")
    assert len(records) == 1 and len(skipped) == 1 and f"{path}:2" in skipped[0]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_reward_values_are_config_errors(value):
    with pytest.raises(ConfigError, match="reward.correct: must be a finite number"):
        load_config(DEMO, [f"reward.correct={value}"])


def test_response_budget_beyond_model_positions():
    with pytest.raises(ConfigError, match=r"rollout.max_response_len: max_prompt_len \+ "
                                          r"max_response_len = 16 \+ 600 exceeds the 512 positions"):
        load_config(DEMO, ["rollout.max_response_len=600"])
