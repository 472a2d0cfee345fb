"""Prompt data: JSONL/Parquet reading, errors with file and line, templates, iterator resume,
and the synthetic task."""
from __future__ import annotations

import json

import pytest
import torch

from megapkl.rollout.data import (QWEN_MATH_SYSTEM, DataError, PromptDataset, PromptIterator,
                                  build_prompt_dataset, read_prompt_file, render_prompt)
from megapkl.rollout.synthetic import BOS_ID, EOS_ID, CharTokenizer, make_synthetic_task

TOK = CharTokenizer()


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


GOOD = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": 4},
        {"prompt": "nested?", "answer": "x", "meta": 1}]


def test_jsonl_reads_records(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", GOOD + [""])
    records, skipped = read_prompt_file(path)
    assert [r.prompt for r in records] == ["1+1?", "2+2?", "nested?"]
    assert [r.answer for r in records] == ["2", "4", "x"]  # numbers become strings
    assert [r.line for r in records] == [1, 2, 3] and skipped == []


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "x", "answer": ', "invalid JSON"),
    ({"question": "x", "answer": "1"}, "missing prompt key 'prompt'"),
    ({"prompt": "x"}, "missing answer key 'answer'"),
    ({"prompt": 3, "answer": "1"}, "prompt 'prompt' must be a non-empty string"),
    ({"prompt": "x", "answer": ["1"]}, "answer 'answer' must be a string or a number"),
    ('[1, 2]', "expected a JSON object"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", GOOD[:2] + [bad] + GOOD[2:])
    with pytest.raises(DataError, match=rf"^{path}:3: {message}".replace("?", r"\?")):
        read_prompt_file(path)


def test_skip_mode_counts_bad_rows(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], "{oops", {"prompt": "y"}, GOOD[1]])
    ds = PromptDataset.from_file(path, TOK, template="raw", on_error="skip")
    assert len(ds) == 2 and ds.num_skipped == 2
    assert ds.skipped[0].startswith(f"{path}:2:") and ds.skipped[1].startswith(f"{path}:3:")


def test_dotted_keys(tmp_path):
    rows = [{"problem": "q", "reward_model": {"ground_truth": "7"}}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    records, _ = read_prompt_file(path, prompt_key="problem", answer_key="reward_model.ground_truth")
    assert records[0].answer == "7"


def test_parquet_reads_and_names_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", "3"]}), path)
    with pytest.raises(DataError, match=rf"^{path}:row 2: prompt 'prompt' must be"):
        read_prompt_file(path)
    records, skipped = read_prompt_file(path, on_error="skip")
    assert [r.prompt for r in records] == ["a", "c"] and [r.line for r in records] == [1, 3]
    assert len(skipped) == 1
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), path)
    with pytest.raises(DataError, match=r"missing column\(s\) \['prompt'\]"):
        read_prompt_file(path)


def test_qwen_math_template_fallback_and_chat_template():
    text, specials = render_prompt("What is 1+1?", "qwen_math", TOK)
    assert specials and text == (f"<|im_start|>system\n{QWEN_MATH_SYSTEM}<|im_end|>\n"
                                 "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert QWEN_MATH_SYSTEM.endswith("within \\boxed{}.")

    class HFLike:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, date_string):
            assert not tokenize and add_generation_prompt
            assert date_string == "26 Jul 2024"  # a date-stamping template gets data.chat_date
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    text, _ = render_prompt("Q", "qwen_math", HFLike())
    assert text == f"system:{QWEN_MATH_SYSTEM}|user:Q|assistant:"
    assert render_prompt("Q", "raw", TOK) == ("Q", False)
    with pytest.raises(ValueError, match="unknown prompt template 'alpaca'"):
        render_prompt("Q", "alpaca", TOK)


def test_dataset_tokenizes_and_filters_long_prompts(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "answer": "1"},
                                             {"prompt": "x" * 50, "answer": "2"}])
    ds = PromptDataset.from_file(path, TOK, template="raw", max_prompt_len=10)
    assert len(ds) == 1 and ds.num_too_long == 1
    item = ds[0]
    assert item.prompt_ids.tolist() == [BOS_ID, ord("a"), ord("b")]  # raw: tokenizer adds BOS
    assert item.answer == "1" and item.metadata["line"] == 1 and item.metadata["source"] == path
    chat = PromptDataset.from_file(path, TOK, template="qwen_math")
    assert chat[0].prompt_ids[0] != BOS_ID  # the chat text carries its own markers


def test_iterator_is_deterministic_and_resumes_exactly():
    full = PromptIterator(10, seed=3)
    reference = [full.next_indices(4) for _ in range(8)]  # 32 draws: crosses three epochs
    flat = [x for b in reference for x in b]
    for e in range(3):
        assert sorted(flat[10 * e:10 * (e + 1)]) == list(range(10))  # each epoch once
    assert flat[:10] != flat[10:20]  # reshuffled per epoch
    it = PromptIterator(10, seed=3)
    head = [it.next_indices(4) for _ in range(3)]
    state = json.loads(json.dumps(it.state_dict()))  # survives a JSON checkpoint
    resumed = PromptIterator(10, seed=3)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices(4) for _ in range(5)] == reference
    assert PromptIterator(10, seed=4).next_indices(10) != reference[0] + reference[1][:6]
    assert PromptIterator(5, shuffle=False).next_indices(7) == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="seed 3"):
        PromptIterator(10, seed=5).load_state_dict(state)


def test_add_mod10_task_and_dataset():
    task = make_synthetic_task("add_mod10")
    problems = task.problems()
    assert len(problems) == 100 and problems[37].prompt == "3+7=" and problems[37].answer == "0"
    ds = PromptDataset.from_synthetic(task)
    assert ds[37].prompt_ids.tolist() == [BOS_ID] + [ord(c) for c in "3+7="]
    assert all(int(i) < 128 for item in ds.items for i in item.prompt_ids)
    digit = ord("0")
    assert task.extract([digit + 4, digit + 5]) == "4"  # token_class: the first token answers
    assert task.extract([ord("A")]) == "7" and task.extract([digit + 10]) == "0"  # 'A' = 65
    assert task.extract([EOS_ID, digit]) is None and task.extract([]) is None
    spellings = [sum(task.extract([v]) == str(d) for v in range(128)) for d in range(10)]
    assert spellings == [12] * 5 + [13] * 5
    assert task.chance_accuracy(8) == pytest.approx(12.5 / 128)
    lenient = make_synthetic_task("add_mod10", answer_mode="first_digit")
    assert lenient.extract([ord("a"), digit + 4, digit + 5]) == "4"
    assert lenient.extract([ord("a"), EOS_ID, digit + 4]) is None  # after EOS nothing counts
    assert 0.04 < lenient.chance_accuracy(8) < 0.05
    strict = make_synthetic_task("add_mod10", answer_mode="strict")
    assert strict.extract([digit + 4, EOS_ID]) == "4" and strict.extract([digit + 4]) is None
    assert TOK.decode(TOK.encode("3+4=") + [ord("7"), EOS_ID, ord("9")]) == "3+4=7"
    with pytest.raises(ValueError, match="unknown synthetic task 'mul'"):
        make_synthetic_task("mul")


def test_build_from_config_sections():
    from megapkl.config.sections_train import DataConfig

    ds = build_prompt_dataset(DataConfig(synthetic="add_mod10", prompt_template="raw",
                                         max_prompts=20))
    assert len(ds) == 20 and isinstance(ds[0].prompt_ids, torch.Tensor)
