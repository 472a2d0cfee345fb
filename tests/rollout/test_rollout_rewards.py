"""Rewards: boxed extraction, math-verify correctness, mappings, failure -> incorrect."""
from __future__ import annotations

import pytest
import torch

from megapkl.rollout.rewards import MathReward, SyntheticReward, build_reward, last_boxed
from megapkl.rollout.sample import Sample
from megapkl.rollout.synthetic import EOS_ID, make_synthetic_task


def sample(response_text=None, answer=None, response_ids=(5,)):
    ids = torch.tensor(response_ids)
    return Sample(uid=0, group_id=0, prompt_ids=torch.tensor([1]), response_ids=ids,
                  logp_behav=torch.zeros(len(ids)), version=0, response_text=response_text,
                  answer=answer)


@pytest.mark.parametrize("text, expect", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{\\sqrt{\\frac{a}{b}}} and more", "\\sqrt{\\frac{a}{b}}"),
    ("\\boxed {7}", "7"),
    ("\\fbox{3}", "3"),
    ("\\boxed{5} and then \\boxed{\\frac{1}{", "5"),  # a box cut off by the length limit
    ("no box here", None),
    ("\\boxed", None),
    ("", None),
])
def test_last_boxed(text, expect):
    assert last_boxed(text) == expect


@pytest.mark.parametrize("correct, incorrect", [(1.0, -1.0), (1.0, 0.0)])
def test_math_reward_mappings(correct, incorrect):
    reward = MathReward(correct, incorrect)
    cases = [
        ("Thus \\boxed{42}", "42", correct),
        ("Thus \\boxed{41}", "42", incorrect),
        ("\\boxed{\\frac{1}{2}}", "0.5", correct),  # math-verify equivalence
        ("\\boxed{\\frac{1}{2}}", "\\frac12", correct),
        ("first \\boxed{3}, finally \\boxed{\\dfrac{3}{4}}", "3/4", correct),
        ("first \\boxed{3/4}, finally \\boxed{3}", "3/4", incorrect),  # only the last box counts
        ("The answer is 42.", "42", incorrect),  # no box: invalid under require_boxed
        ("\\boxed{", "42", incorrect),  # unparseable
        ("\\boxed{}}}{{", "42", incorrect),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", correct),
        ("\\boxed{42}", "\\boxed{42}", correct),  # gold already boxed
    ]
    samples = [sample(text, gold) for text, gold, _ in cases]
    got = reward(samples)
    assert got.tolist() == [want for _, _, want in cases]
    assert [s.reward for s in samples] == got.tolist()
    assert reward.accuracy(got) == pytest.approx(sum(w == correct for *_, w in cases) / len(cases))


def test_math_reward_without_box_requirement():
    reward = MathReward(1.0, -1.0, require_boxed=False)
    assert reward.check("The final answer is 42", "42")
    assert reward.check("so \\boxed{42}", "42")
    assert not reward.check("gibberish", "42")


def test_math_reward_never_raises_nor_hangs_a_thread(caplog):
    """Training rewards use the evaluation's bounded verifier: a pathological answer is scored
    wrong and logged, also off the main thread (where math-verify's own SIGALRM guard cannot run)."""
    import logging
    import threading
    import time

    caplog.set_level(logging.WARNING, logger="megapkl.rollout.bounded_verify")
    reward = MathReward(1.0, -1.0, timeout_s=1)
    assert reward.score(sample("\\boxed{42}", "not a ))) number ((")) == -1.0
    slow = sample("The answer is \\boxed{9^{9^{9^{9}}}}", "1")
    box, t0 = {}, time.monotonic()
    worker = threading.Thread(target=lambda: box.update(r=reward.score(slow)))
    worker.start()
    worker.join(120)
    assert not worker.is_alive() and box["r"] == -1.0 and time.monotonic() - t0 < 60
    assert "timed out" in caplog.text and "sample 0" in caplog.text
    assert reward.score(sample("\\boxed{42}", "42")) == 1.0  # the worker goes on
    reward.close()


def test_math_reward_decodes_with_tokenizer():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "\\boxed{" + "".join(str(i) for i in ids) + "}"

    reward = MathReward(1.0, 0.0, tokenizer=Tok())
    assert reward.score(sample(None, "45", response_ids=(4, 5))) == 1.0
    with pytest.raises(ValueError, match="response_text or a tokenizer"):
        MathReward().score(sample(None, "45"))


def test_reward_mapping_validation():
    with pytest.raises(ValueError, match="must be >"):
        MathReward(0.0, 1.0)


def test_synthetic_reward_and_builder():
    task = make_synthetic_task("add_mod10")
    reward = SyntheticReward(task, 1.0, -1.0)
    seven, eight = ord("7"), ord("8")
    assert reward.score(sample(answer="7", response_ids=(seven, EOS_ID))) == 1.0
    assert reward.score(sample(answer="7", response_ids=(seven + 10, eight))) == 1.0
    assert reward.score(sample(answer="7", response_ids=(eight, seven))) == -1.0
    assert reward.score(sample(answer="7", response_ids=(EOS_ID, seven))) == -1.0

    from megapkl.config.sections_train import RewardConfig

    class Data:
        synthetic = "add_mod10"

    built = build_reward(RewardConfig(type="synthetic", incorrect=0.0), Data)
    assert isinstance(built, SyntheticReward) and built.incorrect == 0.0
    assert isinstance(build_reward(RewardConfig(type="math"), None), MathReward)
