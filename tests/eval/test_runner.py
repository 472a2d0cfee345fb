"""The math benchmark path of the runner: a prepared JSONL -> prompts with their ids -> a real
embedded engine -> math-verify scoring -> summary and files."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapkl.config.sections_train import BenchmarkConfig, DataConfig, EvalConfig
from megapkl.data.prepare import prepare
from megapkl.eval.runner import (EvalError, Scoring, evaluate, load_benchmarks, summarize_records,
                                 write_results)
from megapkl.rollout.sample import Sample
from megapkl.rollout.synthetic import CharTokenizer

FIX = Path(__file__).parents[1] / "data" / "fixtures"


@pytest.fixture()
def setup(tmp_path):
    prepare("math500", str(tmp_path / "eval"), from_file=str(FIX / "math500.jsonl"))
    ev = EvalConfig(benchmarks=[BenchmarkConfig(name="math500", greedy=False, n_samples=2)],
                    data_dir=str(tmp_path / "eval"), max_response_len=3)
    data = DataConfig(train_path="unused.jsonl", prompt_template="raw")
    return ev, data, tmp_path


def test_math_benchmark_through_a_real_engine(setup):
    from megapkl.models.hf_mapping import expected_hf_shapes
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import EmbeddedEngine

    ev, data, tmp = setup
    tok = CharTokenizer()
    [bench] = load_benchmarks(ev, data, tok)
    assert bench.ids == ["test/algebra/9001.json", "test/algebra/9002.json"]  # the JSONL ids
    assert bench.items[1].text == "Simplify $\\sqrt{50}$." and bench.items[1].answer == "5\\sqrt{2}"
    spec = load_spec("tiny-qwen3")
    engine = EmbeddedEngine(hf_config_dict(spec, dtype="float32"), tokenizer=tok)
    torch.manual_seed(0)
    engine.update_weights(((n, torch.randn(s) * 0.1) for n, s in expected_hf_shapes(spec).items()), 3)
    scoring = Scoring(tokenizer=tok)
    try:
        records = evaluate(engine, [bench], ev, SimpleNamespace(max_response_len=8), step=3, seed=0,
                           scoring=scoring)
        # three random tokens cannot hold a boxed answer: every sample is scored wrong, none errs
        assert [(r.prompt_id, r.sample) for r in records] == [
            ("test/algebra/9001.json", 0), ("test/algebra/9001.json", 1),
            ("test/algebra/9002.json", 0), ("test/algebra/9002.json", 1)]
        assert all(not r.correct and r.error is None and r.response_len <= 3 for r in records)
        # the same scorer on responses that do answer
        right = Sample(uid=0, group_id=0, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([65]),
                       logp_behav=torch.zeros(1),
                       version=3, response_text="so it is \\boxed{5 \\sqrt 2}", answer="5\\sqrt{2}")
        assert scoring(bench, right, "manual") == (True, "5 \\sqrt 2", None)
        wrong = Sample(uid=1, group_id=0, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([65]),
                       logp_behav=torch.zeros(1),
                       version=3, response_text="\\boxed{7}", answer="29")
        assert scoring(bench, wrong, "manual") == (False, "7", None)
    finally:
        scoring.close()
    records[0].correct = True  # the summary counts what the records say
    summary = {"step": 3, **summarize_records([bench], records)}
    m = summary["benchmarks"]["math500"]
    assert (m["num_samples"], m["num_correct"], m["mean@2"], m["pass@2"]) == (4, 1, 0.25, 0.5)
    js, samples = write_results(tmp / "out", 3, summary, records)
    assert js.name == "step_000003.json" and len(samples.read_text().splitlines()) == 4


def test_missing_benchmark_file_says_how_to_prepare(setup):
    ev, data, _ = setup
    ev.benchmarks = [BenchmarkConfig(name="aime24")]
    with pytest.raises(EvalError, match=r"no prompt file at .*aime24.jsonl \(run `megapkl data prepare aime24"):
        load_benchmarks(ev, data, CharTokenizer())


def test_command_line_benchmark_takes_the_table_protocol(setup):
    ev, data, tmp = setup
    prepare("aime24", str(tmp / "eval"), from_file=str(FIX / "aime24.jsonl"))
    [math500, aime] = load_benchmarks(ev, data, CharTokenizer(), names=["math500", "aime24"])
    assert (math500.greedy, math500.n_samples) == (False, 2)  # configured
    assert (aime.greedy, aime.n_samples) == (False, 16)        # PKL: mean@16 on AIME
