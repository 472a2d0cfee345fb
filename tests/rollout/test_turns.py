"""Multi-turn trajectories: the Sample contract, the turn driver, and the embedded engine's turns.

What is certified here: the token ids trained on are exactly the ones the engine sampled (never
decoded and re-encoded), each action token's behaviour log-prob is the one the engine's forward
gave it (teacher-forced recomputation agrees at every action position), MoE routed experts cover
every fed token (observations included), an observation has no slot for a per-token behaviour
value, stop strings end a turn and stay in it, observations are cut with their closing tag kept,
and a failing environment is handled per env.on_error.
"""
import threading
import time

import pytest
import torch

from megapkl.envs.base import Environment
from megapkl.envs.lookup import LookupEnv
from megapkl.rollout.embedded import EmbeddedEngine
from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import ACTION, OBSERVATION, PromptItem, Sample, Segment
from megapkl.rollout.synthetic import CharTokenizer, LookupKV
from megapkl.rollout.turns import (ENV_ERROR_KEY, Budgets, End, EnvError, Observation, Trajectory,
                                   TurnDriver)

from rollout_tiny import DENSE, MOE, build_model, check_behaviour, teacher_forced

TOK = CharTokenizer()


def prompts_of(texts, answers=None):
    return [PromptItem(TOK.encode(t, add_special_tokens=False), text=t,
                       answer=None if answers is None else answers[i])
            for i, t in enumerate(texts)]


class Echo(Environment):
    """Inserts "<o>{turn}</o>" after every turn; ends after `turns` actions (the driver's budget)."""

    def __init__(self, stop=(), body="x"):
        self.stop, self.body, self.seen = tuple(stop), body, []

    def step(self, turn):
        self.seen.append(turn)
        return Observation(f"<o>{self.body * turn.turn}</o>", closing="</o>")


def driver(env, **budgets):
    b = dict(max_turns=3, max_response_tokens=40, max_turn_tokens=5, max_observation_tokens=8)
    b.update(budgets)
    return TurnDriver(env, TOK, Budgets(**b), timeout_s=5)


# ------------------------------------------------------------------ the Sample contract


def test_an_observation_has_no_slot_for_a_behaviour_value():
    segs = (Segment(ACTION, 2), Segment(OBSERVATION, 3), Segment(ACTION, 1))
    ids = torch.arange(10, 16)
    ok = Sample(uid=0, group_id=0, prompt_ids=torch.tensor([5]), response_ids=ids,
                logp_behav=torch.zeros(3), version=0, segments=segs)
    assert ok.num_actions == 3 and ok.action_mask.tolist() == [1, 1, 0, 0, 0, 1]
    # a per-token log-prob for every response token (placeholders at observations) is refused
    with pytest.raises(ValueError, match=r"logp_behav .* expected \[3\] \(one per action token\)"):
        Sample(uid=0, group_id=0, prompt_ids=torch.tensor([5]), response_ids=ids,
               logp_behav=torch.zeros(6), version=0, segments=segs)
    with pytest.raises(ValueError, match="topk_ids"):
        Sample(uid=0, group_id=0, prompt_ids=torch.tensor([5]), response_ids=ids,
               logp_behav=torch.zeros(3), version=0, segments=segs,
               topk_ids=torch.zeros(6, 2, dtype=torch.int64), topk_logp=torch.zeros(6, 2))


@pytest.mark.parametrize("segs, why", [
    ((Segment(ACTION, 2), Segment(OBSERVATION, 4)), "starts and ends with an action"),
    ((Segment(OBSERVATION, 2), Segment(ACTION, 4)), "starts and ends with an action"),
    ((Segment(ACTION, 2), Segment(ACTION, 4)), "adjacent segments"),
    ((Segment(ACTION, 2), Segment(OBSERVATION, 1), Segment(ACTION, 2)), "cover 5 tokens"),
])
def test_segments_must_tile_the_response(segs, why):
    actions = sum(g.length for g in segs if g.kind == ACTION)
    with pytest.raises(ValueError, match=why):
        Sample(uid=0, group_id=0, prompt_ids=torch.tensor([5]), response_ids=torch.arange(6),
               logp_behav=torch.zeros(actions), version=0, segments=segs)


def test_token_versions_are_per_action_token_and_the_sample_keeps_the_oldest():
    segs = (Segment(ACTION, 2), Segment(OBSERVATION, 1), Segment(ACTION, 1))
    s = Sample(uid=0, group_id=0, prompt_ids=torch.tensor([5]), response_ids=torch.arange(4),
               logp_behav=torch.zeros(3), version=3, segments=segs,
               versions=torch.tensor([3, 3, 4]))
    assert s.action_versions().tolist() == [3, 3, 4]
    with pytest.raises(ValueError, match="oldest"):
        Sample(uid=0, group_id=0, prompt_ids=torch.tensor([5]), response_ids=torch.arange(4),
               logp_behav=torch.zeros(3), version=4, segments=segs,
               versions=torch.tensor([3, 3, 4]))


# ------------------------------------------------------------------ the driver


def test_an_observation_is_cut_so_its_closing_tag_survives():
    d = driver(Echo())
    obs = Observation("<information>" + "abcdef " * 20 + "</information>", closing="</information>")
    ids, text = d.observation_ids(obs, 40)
    assert len(ids) <= 40 and text.endswith("</information>") and text.startswith("<information>")
    assert TOK.decode(ids) == text  # tokenized once, by itself: exactly the text inserted
    assert len(ids) == 40  # the longest prefix that fits (one id per character here)
    none, _ = d.observation_ids(obs, 10)  # not even the closing tag fits
    assert none is None
    d.close()


def test_budgets_end_a_trajectory_before_asking_the_environment():
    env = Echo()
    d = driver(env, max_turns=2)
    t = Trajectory(prompts_of(["ab"])[0], 0)
    t.add_action(torch.tensor([65]), torch.zeros(1), version=0, text="A", finish="length")
    assert d.react([t])[0] is not None and t.segments[-1].kind == OBSERVATION
    t.add_action(torch.tensor([66]), torch.zeros(1), version=0, text="B", finish="length")
    assert d.react([t]) == [None] and t.end_reason == "max_turns" and len(env.seen) == 1
    d.close()


class Slow(Environment):
    def __init__(self, seconds):
        self.seconds = seconds

    def step(self, turn):
        time.sleep(self.seconds)
        return End()


class Broken(Environment):
    def step(self, turn):
        raise KeyError("no such tool")


@pytest.mark.parametrize("env, match", [(Broken(), "KeyError: 'no such tool'"),
                                        (Slow(3.0), r"no answer within env.timeout_s \(0.5 s\)")])
def test_a_failing_environment_stops_or_scores_the_trajectory(env, match):
    t = Trajectory(prompts_of(["ab"])[0], 0)
    t.add_action(torch.tensor([65]), torch.zeros(1), version=0, text="A", finish="length")
    fail = TurnDriver(env, TOK, Budgets(3, 20), timeout_s=0.5, on_error="fail")
    start = time.monotonic()
    with pytest.raises(EnvError, match=match):
        fail.react([t])
    assert time.monotonic() - start < 2.0  # bounded by env.timeout_s, not by the step
    fail.close()
    kept = TurnDriver(env, TOK, Budgets(3, 20), timeout_s=0.5, on_error="incorrect")
    assert kept.react([t]) == [None] and t.end_reason == "error"
    sample = t.to_sample(0, 0, 1.0)
    assert match.split(":")[0].split(" ")[0] in sample.metadata[ENV_ERROR_KEY]
    kept.close()


def test_steps_of_different_trajectories_run_at_once():
    class Wait(Environment):
        def __init__(self):
            self.barrier = threading.Barrier(4, timeout=5)

        def step(self, turn):
            self.barrier.wait()  # passes only when all four steps run together
            return End()

    trajs = []
    for i in range(4):
        t = Trajectory(prompts_of(["ab"])[0], i)
        t.add_action(torch.tensor([65]), torch.zeros(1), version=0, text="A", finish="length")
        trajs.append(t)
    d = TurnDriver(Wait(), TOK, Budgets(3, 20), timeout_s=10)
    assert d.react(trajs) == [None] * 4
    d.close()


# ------------------------------------------------------------------ the embedded engine


def lookup_call(cfg, seed=3, topk=3):
    model = build_model(cfg)
    engine = EmbeddedEngine.from_model(model, tokenizer=TOK)
    task = LookupKV(digits=2)
    d = TurnDriver(LookupEnv(task), TOK, Budgets(max_turns=2, max_response_tokens=4,
                                                  max_turn_tokens=1, max_observation_tokens=2))
    probs = task.problems()[:6]
    ps = prompts_of([p.prompt for p in probs], [p.answer for p in probs])
    sp = SamplingParams(max_new_tokens=4, seed=seed, topk_logprobs=topk,
                        return_routed_experts="num_experts" in cfg)
    return model, engine, d, ps, sp


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_engine_records_are_the_forward_that_fed_each_token(cfg):
    model, engine, d, ps, sp = lookup_call(cfg)
    samples = engine.generate(ps, 8, sp, turns=d)
    multi = [s for s in samples if s.multi_turn]
    assert multi and len(multi) < len(samples)  # both kinds at random init
    for s in samples:
        _, experts = check_behaviour(model, s)
        if s.multi_turn:  # the observation is the tool's answer, tokenized by itself
            obs = s.segments[1]
            assert obs.kind == OBSERVATION and obs.text == f"={LookupKV(digits=2).value(int(s.prompt_text[1:]))}"
            assert s.response_ids[1:3].tolist() == TOK.encode(obs.text, add_special_tokens=False)
        if experts is not None:  # every fed token, observations included: prompt + response - 1
            assert s.routed_experts.shape[0] == s.prompt_len + s.response_len - 1
            assert torch.equal(s.routed_experts.sort(-1).values, experts.sort(-1).values)


def test_generated_ids_are_never_decoded_and_reencoded():
    """Tokens that decode to nothing (ids >= 127 for the character tokenizer) stay in the
    response exactly as sampled."""
    model = build_model(DENSE, seed=5)
    engine = EmbeddedEngine.from_model(model, tokenizer=TOK)
    d = driver(Echo())
    samples = engine.generate(prompts_of(["hello", "abc"]), 6, SamplingParams(max_new_tokens=40, seed=1),
                              turns=d)
    lossy = [s for s in samples if any(i >= 127 for i in s.response_ids.tolist())]
    assert lossy
    for s in samples:
        logp, _ = teacher_forced(model, s, 1.0)
        ref = logp[torch.arange(s.response_len), s.response_ids][s.action_mask]
        torch.testing.assert_close(s.logp_behav, ref, atol=2e-5, rtol=0)
    for s in lossy:  # what re-encoding the text would have trained on instead
        assert TOK.encode(s.response_text, add_special_tokens=False) != s.response_ids.tolist()


def test_stop_strings_end_a_turn_and_stay_in_it():
    model = build_model(DENSE, seed=2)
    engine = EmbeddedEngine.from_model(model, tokenizer=TOK, eos_token_ids=[])
    stops = tuple(chr(c) for c in range(ord("a"), ord("z") + 1))
    env = Echo(stop=stops)
    d = driver(env, max_turns=3, max_turn_tokens=6)
    samples = engine.generate(prompts_of(["hi"]), 16, SamplingParams(max_new_tokens=40, seed=4), turns=d)
    ended_by_stop = 0
    for s in samples:
        acts = [(g, ids) for g, ids in _segments_ids(s) if g.kind == ACTION]
        for g, ids in acts:
            letters = [i for i, t in enumerate(ids) if ord("a") <= t <= ord("z")]
            if letters:  # the first letter ends the turn and is its last token
                assert letters == [len(ids) - 1], (ids, g)
                ended_by_stop += 1
            else:
                assert len(ids) == 6  # the turn's budget
    assert ended_by_stop > 5
    assert all(t.matched in stops for t in env.seen if t.finish == "stop")


def test_a_trajectory_does_not_depend_on_the_calls_other_prompts():
    model, engine, d, ps, sp = lookup_call(DENSE, seed=None)
    sp = SamplingParams(max_new_tokens=4, prompt_seeds=tuple(range(10, 16)), topk_logprobs=3)
    together = engine.generate(ps, 4, sp, turns=d)
    alone = engine.generate(ps[2:3], 4, SamplingParams(max_new_tokens=4, prompt_seeds=(12,),
                                                        topk_logprobs=3), turns=d)
    for a, b in zip(together[8:12], alone):
        assert a.response_ids.tolist() == b.response_ids.tolist() and a.segments == b.segments
        torch.testing.assert_close(a.logp_behav, b.logp_behav, atol=2e-5, rtol=0)


def _segments_ids(s):
    at, out = 0, []
    for g in s.segments or (Segment(ACTION, s.response_len),):
        out.append((g, s.response_ids[at:at + g.length].tolist()))
        at += g.length
    return out
