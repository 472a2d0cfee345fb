"""`megapkl data prepare` on fixture files in each source's layout (invented problems)."""
import hashlib
import json
from pathlib import Path

import pytest

from megapkl.cli import main
from megapkl.data.prepare import PrepareError, prepare
from megapkl.data.registry import SOURCES, UNAVAILABLE, plain_answer, strip_dapo_wrapper
from megapkl.rollout.data import read_prompt_file

FIX = Path(__file__).parent / "fixtures"


def fixture(name):
    hits = sorted(FIX.glob(f"{name}.*"))
    assert len(hits) == 1, name
    return str(hits[0])


# (name, problems after dedup, duplicates, {id or prompt start: answer})
EXPECTED = {
    "dapo_math_17k": (3, 6, {"fixture-2-0": "\\frac{7}{8}", "fixture-0-0": "12"}),
    "simplelr_qwen_level3to5": (2, 1, {"simplelr_qwen_level3to5-2": "3"}),
    "math500": (2, 1, {"test/algebra/9002.json": "5\\sqrt{2}"}),
    "aime24": (2, 0, {"61": "006"}),
    "aime25": (2, 0, {"0": "49"}),
    "amc23": (2, 0, {"0": "21", "1": "540"}),
    "amc24": (2, 0, {"1": "30"}),
    "olympiadbench": (2, 0, {"3001": "-1", "3002": "4"}),
    "minerva_math": (2, 0, {"minerva_math-1": "75"}),
    "gaokao2023en": (2, 0, {"gaokao2023en-2": "7"}),
}


def test_every_source_has_a_fixture_and_a_case():
    # the search agent's QA sets: tests/data/test_prepare_qa.py (fixtures made by the test)
    assert set(EXPECTED) == {n for n, s in SOURCES.items() if s.group != "qa"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_prepare_fixture(tmp_path, name):
    rows, dups, answers = EXPECTED[name]
    m = prepare(name, str(tmp_path), from_file=fixture(name))
    out = tmp_path / f"{name}.jsonl"
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == rows == m["rows"] and m["duplicates_dropped"] == dups
    assert m["rows_read"] == rows + dups
    by_id = {r["id"]: r for r in recs}
    for rid, ans in answers.items():
        assert by_id[rid]["answer"] == ans
    assert m["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert m["source"]["hf_id"] == SOURCES[name].hf_id and m["source"]["file_sha256"]
    assert json.loads((tmp_path / f"{name}.manifest.json").read_text()) == m
    # the trainer's reader takes the output as is
    records, errors = read_prompt_file(str(out))
    assert len(records) == rows and not errors


def test_dapo_wrapper_is_removed():
    text = json.loads(Path(fixture("dapo_math_17k")).read_text().splitlines()[0])["prompt"][0]["content"]
    assert strip_dapo_wrapper(text) == "A jar holds 7 red and 5 blue marbles. How many marbles are in the jar?"


def test_plain_answer():
    assert plain_answer(["$\\frac{1}{2}$", "x"]) == "\\frac{1}{2}"
    assert plain_answer(27.0) == "27" and plain_answer(2.5) == "2.5" and plain_answer(" 7 ") == "7"
    with pytest.raises(ValueError):
        plain_answer([])


def test_bad_rows_name_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(PrepareError, match=r"bad.jsonl:row 2: none of the prompt columns \['problem'\]"):
        prepare("math500", str(tmp_path / "o"), from_file=str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(PrepareError, match=r"bad.jsonl:1: invalid JSON"):
        prepare("math500", str(tmp_path / "o"), from_file=str(bad))


def test_keep_ids_filters(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("fixture-1-0\nfixture-1-1\n")
    m = prepare("dapo_math_17k", str(tmp_path), from_file=fixture("dapo_math_17k"), keep_ids_file=str(keep),
                out_name="dapo_math_frpo_9453")
    assert m["rows"] == 1 and m["not_in_keep_ids"] == 7 and m["duplicates_dropped"] == 1
    assert (tmp_path / "dapo_math_frpo_9453.jsonl").read_text().count("\n") == 1
    assert m["name"] == "dapo_math_frpo_9453" and m["dataset"] == "dapo_math_17k"


def test_cli_prepare_and_unavailable(tmp_path, capsys):
    assert main(["data", "prepare", "aime25", "--out", str(tmp_path), "--from-file", fixture("aime25")]) == 0
    assert "aime25: 2 problems from 2 rows" in capsys.readouterr().out
    assert main(["data", "prepare", "dapo_math_frpo_9453", "--out", str(tmp_path)]) == 2
    assert "cannot be prepared" in capsys.readouterr().err
    assert main(["data", "prepare", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    assert main(["data", "list"]) == 0 and "dapo_math_frpo_9453" in UNAVAILABLE
