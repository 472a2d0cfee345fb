"""Stop strings and multi-turn requests, read by SGLang's own code (in the SGLang process).

Executed from sglang: the /generate contract gate, `GenerateReqInput` and its normalization, the
tokenizer the tokenizer manager loads for the launch arguments (`get_tokenizer`, none under
--skip-tokenizer-init), `SamplingParams(**sampling_params).normalize(tokenizer)` with its
`raise_if_tokenizer_required` and `.verify`; `ServerArgs` from megapkl's command line; and the
scheduler's stop-string check (`Req._check_str_based_finish` with `tail_str`), run token by token.

What this holds: the request a multi-turn turn sends (its stop strings with no_stop_trim, the
trajectory's ids, routed_experts_start_len) is accepted by a server launched the way megapkl
launches it for a run whose environment has stop strings (with the model's tokenizer), and
refused with SGLang's words by a server launched as for any other run (--skip-tokenizer-init):
the launch is what makes stop strings possible. `megapkl serve` refuses them alike, and matches
them where SGLang's scheduler does (megapkl/rollout/stops.py, which the embedded engine uses).
"""
from __future__ import annotations

import random

import pytest

from megapkl_side import launched

STOP = ["</calc>", "</answer>"]
ENV = ("env.type=python", "env.function=my_envs:calculator", f"env.stop={STOP}",
       "env.max_turn_tokens=8")
VOCAB = 128


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from megapkl.models.tiny import write_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return path


def turn_body(tokenizer_dir, routed_start: int = 5):
    """The body of a trajectory's second turn, as the SGLang engine builds it."""
    import torch
    from transformers import AutoTokenizer

    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.sample import PromptItem
    from megapkl.rollout.sglang.multi_turn import turn_sampling
    from megapkl.rollout.sglang.protocol import generate_payload
    from megapkl.rollout.turns import Budgets, Trajectory, TurnDriver

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    env = type("Calc", (), {"stop": tuple(STOP), "step": lambda self, turn: None})()
    driver = TurnDriver(env, tok, Budgets(max_turns=3, max_response_tokens=40, max_turn_tokens=9))
    try:
        traj = Trajectory(PromptItem([5, 6, 7]), 0)
        traj.add_action(torch.tensor([40, 120, 41]), torch.zeros(3), version=1, text="",
                        finish="stop", matched="</calc>")
        traj.add_observation(torch.tensor([60, 61]), "=5", "tool")
        sampling = turn_sampling(SamplingParams(max_new_tokens=40, return_routed_experts=True,
                                                topk_logprobs=2), driver, traj)
        return generate_payload(traj.context_ids().tolist(), sampling, 1, seed=1234,
                                routed_start=routed_start), traj
    finally:
        driver.close()


def test_a_turn_with_stop_strings_is_taken_by_the_server_megapkl_launches(
        sglang, tokenizer_dir, tmp_path, monkeypatch):
    run = launched("moe_r3_tp2_ep2", tmp_path, monkeypatch,
                   extra=(*ENV, f"model.tokenizer={tokenizer_dir}"))
    argv = run.sglang_argv()
    body, traj = turn_body(tokenizer_dir)
    got = sglang.call("stop_request", argv, body, VOCAB)
    assert "error" not in got, f"SGLang refuses the turn of a run with stop strings: {got}"
    assert got["skip_tokenizer_init"] is False and got["tokenizer_path"] == str(tokenizer_dir)
    assert got["stop_strs"] == STOP and got["no_stop_trim"] is True
    assert got["stop_str_max_len"] == max(len(s) for s in STOP)  # one token per character
    assert got["input_ids"] == traj.context_ids().tolist()  # the ids themselves, re-encoded never
    assert got["max_new_tokens"] == 9 and got["sampling_seed"] == 1234 and got["n"] == 1
    assert got["return_logprob"] is True and got["logprob_start_len"] == -1
    assert got["top_logprobs_num"] == 2
    assert got["return_routed_experts"] is True and got["routed_experts_start_len"] == 5


def test_without_the_launchs_tokenizer_sglang_refuses_stop_strings(sglang, tokenizer_dir,
                                                                     tmp_path, monkeypatch):
    """A run without stop strings launches --skip-tokenizer-init; SGLang refuses the same turn
    there, in the words `megapkl serve` uses for it too."""
    from megapkl.rollout.stops import unavailable

    run = launched("moe_r3_tp2_ep2", tmp_path, monkeypatch)
    body, _ = turn_body(tokenizer_dir)
    got = sglang.call("stop_request", run.sglang_argv(), body, VOCAB)
    assert got.get("error") == f"ValueError: {unavailable(STOP)}", got


def test_a_run_with_stop_strings_and_no_tokenizer_directory_is_refused(tmp_path, monkeypatch):
    from megapkl.rollout.sglang.launch import ServerLaunchError

    with pytest.raises(ServerLaunchError, match=r"env.stop: .*model.tokenizer"):
        launched("moe_r3_tp2_ep2", tmp_path, monkeypatch, extra=ENV)


def test_megapkl_matches_stop_strings_where_sglangs_scheduler_does(sglang, tokenizer_dir):
    """Random outputs over the stop strings' characters, special tokens (decoded as text by
    SGLang's window) and ids the tokenizer does not have (decoded to nothing)."""
    from transformers import AutoTokenizer

    from megapkl.models.tiny import char_id
    from megapkl.rollout.stops import StopStrings

    stop = ["</s>", "ab", "<|im_end|>", "b<"]
    alphabet = [char_id(c) for c in "</s>ab|imend_ x"] + [0, 1, 2, 120, 127]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(0)
    outputs = []
    for _ in range(300):  # random ids, most with a stop string's characters spliced in
        ids = [rng.choice(alphabet) for _ in range(12)]
        if rng.random() < 0.7:
            at, piece = rng.randrange(12), [char_id(c) for c in rng.choice(stop)]
            ids[at:at] = piece[:1] + [120] * rng.randint(0, 1) + piece[1:]  # a gap decodes to ""
        outputs.append(ids)
    theirs = sglang.call("stop_matches", str(tokenizer_dir), stop, outputs)
    strings = StopStrings(stop, tok)
    ours = []
    for ids in outputs:
        found = next(((t, strings.match(ids[:t])) for t in range(1, len(ids) + 1)
                      if strings.match(ids[:t]) is not None), None)
        ours.append(None if found is None else (found[0], found[1], found[0]))
    assert sum(x is not None for x in theirs) > 150 and len({x[1] for x in theirs if x}) == 4
    assert [tuple(x) if x else None for x in theirs] == ours
