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


# ---- the search agent's QA benchmarks: exact match of the policy's last <answer>

QA = [{"id": "q0", "question": "capital of France", "golden_answers": ["Paris", "City of Light"]},
      {"id": "q1", "question": "capital of Italy", "golden_answers": ["Rome"]}]


def qa_sample(actions, golds, observation="<information>x</information>"):
    """A multi-turn sample whose action segments are `actions`, an observation between each."""
    from megapkl.rollout.sample import ACTION, OBSERVATION, Segment

    segs = []
    for i, a in enumerate(actions):
        segs += ([Segment(OBSERVATION, 2, text=observation, source="tool")] if i else []) + \
            [Segment(ACTION, 2, text=a)]
    n = sum(s.length for s in segs)
    return Sample(uid=0, group_id=0, prompt_ids=torch.tensor([1]), response_ids=torch.arange(n),
                  logp_behav=torch.zeros(2 * len(actions)), version=1, segments=tuple(segs),
                  answer=golds[0], metadata={"fields": {"golden_answers": golds, "source": "nq"}})


def test_qa_benchmarks_score_the_policys_last_answer_with_the_runs_environment(tmp_path):
    """QA sets are scored by the answer_em rule (last <answer> of the policy's own turns against
    every gold answer), rolled out turn by turn through the driver handed in, and averaged per
    benchmark and over benchmarks (the papers' Avg) beside the pooled micro average."""
    import json

    from megapkl.envs.base import Environment
    from megapkl.models.hf_mapping import expected_hf_shapes
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import EmbeddedEngine
    from megapkl.rollout.turns import Budgets, Observation, TurnDriver

    src = tmp_path / "flashrag.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in QA))
    for name in ("nq", "bamboogle"):
        prepare(name, str(tmp_path / "eval"), from_file=str(src))
    ev = EvalConfig(benchmarks=[BenchmarkConfig(name=n, greedy=False, n_samples=1)
                                for n in ("nq", "bamboogle")] +
                    [BenchmarkConfig(name="mine", n_samples=1, path=str(tmp_path / "eval" / "nq.jsonl"),
                                     scoring="answer_em")],
                    data_dir=str(tmp_path / "eval"), max_response_len=90)
    tok = CharTokenizer()
    nq, bam, mine = load_benchmarks(ev, DataConfig(train_path="unused.jsonl", prompt_template="raw"),
                                    tok)
    assert (nq.kind, bam.kind, mine.kind) == ("answer_em",) * 3
    scoring = Scoring(tokenizer=tok)
    right = qa_sample(["<search>France</search>", "<answer> the City of Light </answer>"],
                      ["Paris", "City of Light"])
    assert scoring(nq, right, "manual") == (True, "the City of Light", None)
    # the retrieved passages hold the gold answer in answer tags: they never count
    leak = qa_sample(["<search>France</search>", "I am not sure."], ["Paris"],
                     observation="<information><answer>Paris</answer></information>")
    assert scoring(nq, leak, "manual") == (False, None, None)
    assert scoring(nq, qa_sample(["<answer>Rome</answer> <answer>Lyon</answer>"], ["Rome"]),
                   "manual")[0] is False  # the last answer counts

    class Leaky(Environment):
        """After every turn, a passage that holds the gold answer in answer tags."""

        def step(self, turn):
            return Observation("<information><answer>Paris</answer></information>",
                               closing="</information>")

    spec = load_spec("tiny-qwen3")
    engine = EmbeddedEngine(hf_config_dict(spec, dtype="float32"), tokenizer=tok)
    torch.manual_seed(0)
    engine.update_weights(((n, torch.randn(s) * 0.1) for n, s in expected_hf_shapes(spec).items()), 1)
    driver = TurnDriver(Leaky(), tok, Budgets(max_turns=2, max_response_tokens=400,
                                              max_turn_tokens=4, max_observation_tokens=64),
                        timeout_s=5)
    try:
        records = evaluate(engine, [nq, bam], ev, SimpleNamespace(max_response_len=8), step=1,
                           seed=0, scoring=scoring, turns=driver)
    finally:
        driver.close()
    assert [(r.benchmark, r.prompt_id) for r in records] == [
        ("nq", "q0"), ("nq", "q1"), ("bamboogle", "q0"), ("bamboogle", "q1")]
    # two turns with the observation between them, within the evaluation's budget (90, not 400)
    assert all("<information><answer>Paris</answer></information>" in r.response
               and r.response_len <= 90 for r in records)
    assert not any(r.correct for r in records)
    assert records[0].golds == ["Paris", "City of Light"] and records[1].golds is None
    records[0].correct = records[1].correct = records[2].correct = True  # nq 2/2, bamboogle 1/2
    summary = summarize_records([nq, bam], records)
    assert summary["benchmarks"]["nq"]["mean@1"] == 1.0
    assert summary["macro_average"] == {"benchmarks": 2, "accuracy": 0.75}
    assert summary["micro_average"]["accuracy"] == 0.75
    row = json.loads(write_results(tmp_path / "out", 1, {"step": 1, **summary}, records)[1]
                     .read_text().splitlines()[0])
    assert row["golds"] == ["Paris", "City of Light"] and row["extracted"] is None
