"""Multi-turn trajectories on the SGLang engine, against a real `megapkl serve` process (the
embedded engine behind SGLang's HTTP API) holding a character-level Hugging Face tokenizer.

Certified here, as tests/rollout/test_turns.py certifies it for the embedded engine: each turn
is sent as the trajectory's exact ids (ids that decode to nothing stay as sampled), every action
token's behaviour log-prob and top-K equal a teacher-forced recomputation of the whole
trajectory by the trainer-side model, stop strings end a turn inside the server and stay in it,
the routed experts of every fed token come back exactly once over the turns (prompt + response
- 1 rows, equal to the recomputation's router choices), and trajectories are independent: one
whose tool answers only after every other trajectory has finished does not hold them back, and
a trajectory is the same generated alone.
"""
from __future__ import annotations

import threading

import pytest
import torch

from megapkl.envs.base import End, Environment, Observation
from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import ACTION, OBSERVATION, PromptItem
from megapkl.rollout.turns import Budgets, TurnDriver

from rollout_tiny import check_behaviour
from sglang_fixtures import start_worker, wait_healthy

LETTERS = tuple(chr(c) for c in range(ord("a"), ord("z") + 1))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(URL, tokenizer, trainer-side model, its HF config) of one tiny-Qwen3-MoE worker with a
    tokenizer and routed experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.models.tiny import write_tokenizer
    from megapkl.rollout.embedded import load_hf_config

    tmp = tmp_path_factory.mktemp("sglang_turns")
    write_tokenizer(tmp / "tok")
    worker = start_worker(tmp, model_config="tiny-qwen3-moe",
                          args=["--tokenizer", str(tmp / "tok"), "--enable-return-routed-experts"])
    try:
        wait_healthy([worker])
        hf = hf_config_dict(load_spec("tiny-qwen3-moe"), dtype="float32")
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(load_hf_config({**hf, "initializer_range": 0.2}))
        yield worker.url, AutoTokenizer.from_pretrained(tmp / "tok"), model.eval(), hf
    finally:
        worker.stop()


def engine_for(served, **kw):
    from megapkl.rollout.embedded import checkpoint_tensors
    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync

    url, tok, model, hf = served
    engine = SGLangEngine(Fleet([Worker(url, state="ready")], health=HealthSettings(timeout_s=60)),
                          hf, WeightSync(SyncSettings(mode="tensor", timeout_s=60)),
                          tokenizer=tok, heartbeat=False, **kw)
    engine.update_weights(list(checkpoint_tensors(model)), version=3)
    return engine


class Tagged(Environment):
    """After each turn: "<o>k</o>" (k: the turn), until the driver's budgets end it."""

    stop = LETTERS

    def __init__(self):
        self.seen = []

    def step(self, turn):
        self.seen.append(turn)
        return Observation(f"<o>{turn.turn}</o>", closing="</o>", tool="tag")


def prompts(tok, texts):
    return [PromptItem(tok.encode(t, add_special_tokens=False), text=t) for t in texts]


def split(sample):
    at, out = 0, []
    for g in sample.segments or ():
        out.append((g, sample.response_ids[at:at + g.length].tolist()))
        at += g.length
    return out


def test_turns_are_the_servers_exact_ids_logprobs_stops_and_experts(served):
    url, tok, model, _ = served
    env = Tagged()
    driver = TurnDriver(env, tok, Budgets(max_turns=3, max_response_tokens=30, max_turn_tokens=6,
                                          max_observation_tokens=8), timeout_s=30)
    engine = engine_for(served)
    try:
        sampling = SamplingParams(max_new_tokens=30, seed=11, topk_logprobs=3,
                                  return_routed_experts=True)
        samples = engine.generate(prompts(tok, ["hi", "go on"]), 4, sampling, turns=driver)
    finally:
        engine.close()
        driver.close()
    assert [s.group_id for s in samples] == [0] * 4 + [1] * 4
    assert sum(s.multi_turn for s in samples) >= 4 and all(s.version == 3 for s in samples)
    letter_ids = {tok.convert_tokens_to_ids(c) for c in LETTERS}
    stopped = 0
    for s in samples:
        _, experts = check_behaviour(model, s)
        # every fed token's experts exactly once over the turns, observations included
        assert s.routed_experts.shape == (s.prompt_len + s.response_len - 1, 2, 2)
        assert torch.equal(s.routed_experts.sort(-1).values, experts.sort(-1).values)
        parts = split(s)
        for k, (g, ids) in enumerate(parts):
            if g.kind == OBSERVATION:  # the environment's text, tokenized by itself
                assert ids == tok.encode(g.text, add_special_tokens=False)
                continue
            letters = [i for i, t in enumerate(ids) if t in letter_ids]
            if letters:  # the server stopped at the first letter, which the turn keeps
                assert letters == [len(ids) - 1], ids
                stopped += 1
            else:  # its turn's budget, a stop token, or the end of the response's budget
                assert len(ids) == 6 or ids[-1] in (0, 2) or k == len(parts) - 1, ids
    assert stopped >= 4
    assert all(t.matched in LETTERS for t in env.seen if t.matched is not None)
    assert any(t.matched is not None for t in env.seen)
    # ids that decode to nothing (the tokenizer has 99 of the model's 128) were sent back as ids
    lossy = [s for s in samples if any(i >= 99 for i in s.response_ids.tolist())]
    assert lossy
    for s in lossy:
        assert tok.encode(tok.decode(s.response_ids.tolist()),
                          add_special_tokens=False) != s.response_ids.tolist()


class HeldUntilOthersEnd(Environment):
    """The tool of the prompt "slow" answers only once every other trajectory has ended (each
    other one ends at its second turn): under lock-step rounds it would wait for ever."""

    def __init__(self, others: int):
        self.others, self.ended, self.lock = others, 0, threading.Lock()
        self.all_ended = threading.Event()

    def step(self, turn):
        if turn.prompt_text == "slow":
            if turn.turn == 1:
                assert self.all_ended.wait(60), "the other trajectories were held back"
                return Observation("<o>late</o>", closing="</o>")
            return End("answer")
        if turn.turn >= 2:
            with self.lock:
                self.ended += 1
                if self.ended == self.others:
                    self.all_ended.set()
            return End("answer")
        return Observation("<o>1</o>", closing="</o>")


def test_a_trajectory_waiting_on_its_tool_holds_back_no_other(served):
    url, tok, model, _ = served
    env = HeldUntilOthersEnd(others=6)
    budgets = Budgets(max_turns=3, max_response_tokens=40, max_turn_tokens=4,
                      max_observation_tokens=12)
    driver = TurnDriver(env, tok, budgets, timeout_s=90)
    again = TurnDriver(HeldUntilOthersEnd(others=2), tok, budgets, timeout_s=90)
    engine = engine_for(served)
    try:
        sampling = SamplingParams(max_new_tokens=40, prompt_seeds=(5, 6, 7, 8), ignore_eos=True)
        samples = engine.generate(prompts(tok, ["slow", "a", "b", "c"]), 2, sampling,
                                  turns=driver)
        assert env.all_ended.is_set()
        assert all(s.turns == 2 for s in samples)  # the slow ones got their late observation
        # a trajectory is the same generated alone: its seeds are its own
        alone = engine.generate(prompts(tok, ["b"]), 2, SamplingParams(
            max_new_tokens=40, prompt_seeds=(7,), ignore_eos=True), turns=again)
    finally:
        engine.close()
        driver.close()
        again.close()
    for a, b in zip(samples[4:6], alone):
        assert a.response_ids.tolist() == b.response_ids.tolist() and a.segments == b.segments
        torch.testing.assert_close(a.logp_behav, b.logp_behav, atol=0, rtol=0)


def test_router_forwards_stop_strings_and_a_worker_without_tokenizer_is_refused(served,
                                                                                 tmp_path):
    """A turn through the real sglang-router ends at the same stop string as sent to the worker
    (the router keeps `stop` and `no_stop_trim`); the worker's /server_info passes the run's
    check for stop strings, the same report under --skip-tokenizer-init does not."""
    from megapkl.rollout.sglang.served import Expected, mismatches
    from sglang_fixtures import http, start_router, wait_router_ready

    url, tok, _, _ = served
    router = start_router(tmp_path, [url])
    try:
        wait_router_ready(router, 1)
        body = {"input_ids": tok.encode("hi", add_special_tokens=False), "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16, "sampling_seed": 3, "ignore_eos": True,
                                    "stop": list(LETTERS), "no_stop_trim": True}}
        direct, routed = http("POST", url + "/generate", body), http("POST", router.url +
                                                                     "/generate", body)
    finally:
        router.stop()
    assert direct[0] == routed[0] == 200, (direct, routed)
    assert direct[1]["meta_info"]["finish_reason"]["matched"] in LETTERS
    for key in ("output_ids", "text"):
        assert routed[1][key] == direct[1][key]
    assert routed[1]["meta_info"]["finish_reason"] == direct[1]["meta_info"]["finish_reason"]
    info = http("GET", url + "/server_info")[1]
    want = Expected(tp=info["tp_size"], kv_cache_dtype="auto", routed_experts=True,
                    context_length=None, architectures=(), tokenizer=True)
    assert info["skip_tokenizer_init"] is False and not mismatches(info, {}, want)
    assert [m for m in mismatches({**info, "skip_tokenizer_init": True}, {}, want)
            if "--skip-tokenizer-init" in m]


def test_servers_holding_a_tokenizer_whose_eos_the_model_does_not_stop_at_are_refused(tmp_path):
    """SGLang ends a response at its tokenizer's EOS as well (Req._check_token_based_finish):
    with stop strings the servers hold the tokenizer, so its EOS must be one the run stops at."""
    import types

    from megapkl.models.tiny import write_tokenizer
    from megapkl.rollout.sglang.build import served_tokenizer
    from megapkl.rollout.sglang.launch import ServerLaunchError

    write_tokenizer(tmp_path)
    tok = types.SimpleNamespace(eos_token_id=3)
    ctx = types.SimpleNamespace(stop=("</search>",), tokenizer_path=str(tmp_path),
                                hf_config={"eos_token_id": [1, 2]})
    with pytest.raises(ServerLaunchError, match=r"model.tokenizer: its EOS id 3 .*\[1, 2\]"):
        served_tokenizer(ctx, tok)
    ctx.hf_config = {"eos_token_id": 3}
    assert served_tokenizer(ctx, tok) == str(tmp_path)
    ctx.stop = ()  # no stop strings: ids in and out, no tokenizer on the servers
    assert served_tokenizer(ctx, types.SimpleNamespace(eos_token_id=9)) is None
