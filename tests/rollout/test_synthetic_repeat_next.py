"""The long-answer synthetic task repeat_next_L: problems, reading, partial-credit reward (by hand),
and the evaluation's all-positions accuracy."""
import types
from pathlib import Path

import pytest
import torch

from megapkl.rollout.rewards import SyntheticReward, build_reward
from megapkl.rollout.sample import Sample
from megapkl.rollout.synthetic import EOS_ID, SYNTHETIC_TASKS, make_synthetic_task

STUDY = str(Path(__file__).resolve().parents[2] / "configs" / "study" / "repeat_next.yaml")


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def sample(response: list[int], answer: str) -> Sample:
    return Sample(uid=0, group_id=0, prompt_ids=torch.tensor([1, ord("1")]),
                  response_ids=torch.tensor(response, dtype=torch.int64),
                  logp_behav=torch.zeros(len(response)), version=0, answer=answer)


def test_problems_and_reading():
    t = make_synthetic_task("repeat_next_8")
    assert t.name == "repeat_next_8" and make_synthetic_task("repeat_next_16").length == 16
    probs = t.problems()
    assert len(probs) == 100 and len({p.prompt for p in probs}) == 10
    assert {(p.prompt, p.answer) for p in probs if p.prompt in "19"} == {("1", "22222222"),
                                                                         ("9", "00000000")}
    # token id v spells digit (v - 48) mod 10: 'l' = 108 spells 0, '<' = 60 spells 2
    assert t.extract(ids("2<222222") + [9, 9]) == "22222222"   # only the first L positions count
    assert t.extract(ids("l2") + [EOS_ID] + ids("2222")) == "02"  # EOS ends the response
    assert t.extract([EOS_ID]) is None and t.extract([]) is None
    assert t.is_correct(ids("22222222"), "22222222") and not t.is_correct(ids("2222222"), "22222222")
    assert t.chance_accuracy(8) == pytest.approx((125 / 1280) ** 8) and t.chance_accuracy(4) == 0.0


def test_partial_credit_by_hand():
    t = make_synthetic_task("repeat_next_8")
    assert t.fraction_correct(ids("22322222"), "22222222") == 7 / 8
    assert t.fraction_correct(ids("222") + [EOS_ID], "22222222") == 3 / 8
    assert t.fraction_correct(ids("33333333"), "22222222") == 0.0
    r01 = SyntheticReward(t, correct=1.0, incorrect=0.0)
    rpm = SyntheticReward(t, correct=1.0, incorrect=-1.0)
    s = [sample(ids("22322222"), "22222222"), sample(ids("22222222"), "22222222"),
         sample(ids("2") + [EOS_ID], "22222222")]
    assert r01(s).tolist() == [7 / 8, 1.0, 1 / 8]
    assert rpm(s).tolist() == [-1 + 2 * 7 / 8, 1.0, -1 + 2 / 8]   # -1 + 2 * fraction
    assert [x.reward for x in s] == [-1 + 2 * 7 / 8, 1.0, -1 + 2 / 8]
    assert rpm.accuracy(rpm(s)) == pytest.approx(1 / 3)          # only all-correct counts
    # a task without partial credit keeps its binary reward
    nm = SyntheticReward(make_synthetic_task("next_mod10"), correct=1.0, incorrect=-1.0)
    assert nm([sample(ids("5x"), "2"), sample(ids("2x"), "2")]).tolist() == [-1.0, 1.0]
    built = build_reward(types.SimpleNamespace(type="synthetic", correct=1.0, incorrect=0.0),
                         types.SimpleNamespace(synthetic="repeat_next_8"))
    assert built([sample(ids("22222223"), "22222222")]).tolist() == [7 / 8]


def test_evaluation_counts_all_positions():
    from megapkl.config import load_config
    from megapkl.eval.runner import Scoring, load_benchmarks

    assert "repeat_next_8" in SYNTHETIC_TASKS
    cfg = load_config(STUDY)  # the study's evaluation: 16 samples of each of the 10 prompts
    (bench,) = load_benchmarks(cfg.eval, cfg.data, None)
    assert (len(bench.items), bench.n_samples, bench.kind) == (10, 16, "synthetic")
    score = Scoring()
    right, got, _ = score(bench, sample(ids("22222222"), "22222222"), "w")
    wrong, got2, _ = score(bench, sample(ids("22222232"), "22222222"), "w")
    assert (right, got, wrong, got2) == (True, "22222222", False, "22222232")
