"""`env.type: python`: a user's environment in worker processes, bounded in time."""
import time

import pytest
import torch

from megapkl.envs.python import PythonEnv
from megapkl.rollout.sample import PromptItem
from megapkl.rollout.synthetic import CharTokenizer
from megapkl.rollout.turns import Budgets, End, EnvError, Observation, Trajectory, TurnDriver

TOK = CharTokenizer()


def turn_after(text):
    t = Trajectory(PromptItem(TOK.encode("q", add_special_tokens=False), text="q"), 0)
    ids = torch.tensor(TOK.encode(text, add_special_tokens=False))
    t.add_action(ids, torch.zeros(len(ids)), version=0, text=text, finish="stop", matched="</calc>")
    return t


def test_a_user_environment_answers_observations_and_ends():
    env = PythonEnv("user_envs:calculator", timeout_s=5, workers=2, stop=["</calc>"])
    try:
        step = env.step(turn_after("let me add <calc>2+40</calc>").turn())
        assert step == Observation("<result>42</result>", closing="</result>", tool="calc")
        assert env.step(turn_after("<answer>42</answer>").turn()) == End("answer")
        assert env.step(turn_after("hmm").turn()).source == "invalid"
        d = TurnDriver(env, TOK, Budgets(3, 60), timeout_s=5)
        t = turn_after("<calc>1+2</calc>")
        assert TOK.decode(d.react([t])[0]) == "<result>3</result>"
        d.close()
    finally:
        env.close()


def test_a_user_environment_that_hangs_is_killed_within_its_time_limit():
    env = PythonEnv("user_envs:sleepy", timeout_s=1, workers=1)
    try:
        start = time.monotonic()
        with pytest.raises(EnvError, match=r"env.function user_envs:sleepy: timeout: no answer "
                                           r"within env.timeout_s \(1 s\)"):
            env.step(turn_after("x").turn())
        assert time.monotonic() - start < 10
        workers = list(env._all)
        # the killed worker comes back for the next step, which is bounded again
        with pytest.raises(EnvError, match="timeout"):
            env.step(turn_after("x").turn())
    finally:
        env.close()
    assert all(w._worker.proc is None for w in workers)  # closing stops every worker process


@pytest.mark.parametrize("fn, match", [("user_envs:wrong", r"unknown keys|expected"),
                                       ("user_envs:nope", "cannot load")])
def test_a_wrong_user_environment_is_one_clear_line(fn, match):
    with pytest.raises(EnvError, match=match) as info:
        env = PythonEnv(fn, timeout_s=5, workers=1)
        try:
            env.step(turn_after("x").turn())
        finally:
            env.close()
    assert "\n" not in str(info.value)


def test_prints_of_a_user_environment_never_corrupt_its_answers():
    env = PythonEnv("user_envs:noisy", timeout_s=5, workers=1)
    try:
        assert env.step(turn_after("x").turn()) == End("end")
    finally:
        env.close()
