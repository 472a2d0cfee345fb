"""`megapkl data prepare` for the search agent: FlashRAG-layout QA rows and a wiki-18-layout
corpus, written by the test (no downloads)."""
import gzip
import json

import pytest

from megapkl.cli import main
from megapkl.data.prepare import PrepareError, prepare, prepare_corpus
from megapkl.data.registry import QA_EVAL_SETS, SOURCES
from megapkl.rollout.data import read_prompt_file, render_prompt


def flashrag(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


NQ = [{"id": "test_0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare",
                                                                        "William Shakespeare"],
       "metadata": {}},
      {"id": "test_1", "question": "capital of France?", "golden_answers": ["Paris"]},
      {"id": "test_2", "question": "capital of France?", "golden_answers": ["Paris"]}]


def test_qa_set_keeps_every_answer_and_repeats(tmp_path):
    m = prepare("nq", str(tmp_path), from_file=flashrag(tmp_path / "nq.src.jsonl", NQ))
    recs = [json.loads(x) for x in (tmp_path / "nq.jsonl").read_text().splitlines()]
    assert m["rows"] == 3 and m["duplicates_dropped"] == 0  # Search-R1 keeps repeats
    assert recs[0] == {"id": "test_0", "prompt": "who wrote hamlet?", "answer": "Shakespeare",
                       "golden_answers": ["Shakespeare", "William Shakespeare"], "source": "nq"}
    assert recs[1]["prompt"] == "capital of France?"  # a question mark once
    records, _ = read_prompt_file(str(tmp_path / "nq.jsonl"))
    assert records[0].extra["golden_answers"] == ["Shakespeare", "William Shakespeare"]


def test_merged_training_set(tmp_path):
    hp = [{"id": "h0", "question": "Which is older, A or B", "golden_answers": ["A"]}]
    m = prepare("nq_hotpotqa_train", str(tmp_path),
                from_file=[flashrag(tmp_path / "a.jsonl", NQ), flashrag(tmp_path / "b.jsonl", hp)])
    recs = [json.loads(x) for x in (tmp_path / "nq_hotpotqa_train.jsonl").read_text().splitlines()]
    assert m["rows"] == 4 and [r["source"] for r in recs] == ["nq"] * 3 + ["hotpotqa"]
    with pytest.raises(PrepareError, match="one --from-file per part"):
        prepare("nq_hotpotqa_train", str(tmp_path), from_file=[str(tmp_path / "a.jsonl")])


def test_qa_rows_without_answers_name_the_row(tmp_path):
    bad = flashrag(tmp_path / "bad.jsonl", [{"id": "x", "question": "q", "golden_answers": []}])
    with pytest.raises(PrepareError, match=r"bad.jsonl:row 1: answer column 'golden_answers'"):
        prepare("popqa", str(tmp_path), from_file=bad)


def test_agent_prompt_is_the_papers():
    text, specials = render_prompt("who wrote hamlet?", "sis_agent")
    assert specials and text.startswith("<|im_start|>user\nAnswer the given question. You must "
                                        "conduct reasoning inside <think> and </think>")
    assert "For example, <answer> x </answer>. Question: who wrote hamlet?<|im_end|>\n" \
           "<|im_start|>assistant\n" in text and "system" not in text


def test_corpus_from_a_gzipped_copy(tmp_path):
    rows = [{"id": "1", "contents": '"Aaron"\nAaron is a prophet.'},
            {"id": "2", "contents": '"Paris"\nParis is a city.'}]
    gz = tmp_path / "wiki-18.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare_corpus("wiki18", str(tmp_path / "out"), from_file=str(gz))
    assert m["rows"] == 2 and (tmp_path / "out" / "wiki18.jsonl").read_text().count("\n") == 2
    with gzip.open(gz, "wt") as f:
        f.write('{"id": "1", "text": "no contents"}\n')
    with pytest.raises(PrepareError, match=r"wiki18.jsonl:1: expected"):
        prepare_corpus("wiki18", str(tmp_path / "out2"), from_file=str(gz))
    assert not list((tmp_path / "out2").iterdir())  # nothing half-written left


def test_data_list_states_sizes_and_licences(capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "nq_hotpotqa_train" in out and "169,615 questions" in out
    assert "wiki18" in out and "21,015,324 passages" in out and "CC BY-SA" in out
    assert set(QA_EVAL_SETS) == {"nq", "triviaqa", "popqa", "hotpotqa", "musique", "bamboogle"}
    assert {SOURCES[n].split for n in QA_EVAL_SETS} == {"test", "dev"}
