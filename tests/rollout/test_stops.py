"""Stop strings on single-turn responses: the embedded engine and `megapkl serve` (in process).

The rule is SGLang's (megapkl/rollout/stops.py; tests/contract/test_stop_strings_contract.py
checks it against SGLang's scheduler code): a response ends once the decoded text of its last
tokens holds a stop string, its ids keep the string, its text keeps it only with no_stop_trim.
Each response draws token t from its own random stream, so a response with stop strings is the
same response without them, cut where the first stop string completes.
"""
from __future__ import annotations

import pytest
import torch

from megapkl.rollout.embedded import EmbeddedEngine
from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import PromptItem
from megapkl.rollout.synthetic import CharTokenizer

from rollout_tiny import DENSE, build_model

TOK = CharTokenizer()
STOP = ("C", "J", "H", "<:", "Dd")


def first_stop(ids, stop):
    """Tokens up to where a stop string first appears in the text of the last (longest stop
    string + 1) tokens so far (None: never)."""
    window = 1 + max(len(s) for s in stop)
    for t in range(1, len(ids) + 1):
        if any(s in TOK.decode(ids[max(0, t - window):t]) for s in stop):
            return t
    return None


def test_a_response_is_cut_where_its_first_stop_string_completes():
    engine = EmbeddedEngine.from_model(build_model(DENSE, seed=3), tokenizer=TOK,
                                       eos_token_ids=[])
    prompts = [PromptItem(TOK.encode(t, add_special_tokens=False)) for t in ("hi", "ok")]
    free = engine.generate(prompts, 16, SamplingParams(max_new_tokens=24, seed=5))
    cut = engine.generate(prompts, 16, SamplingParams(max_new_tokens=24, seed=5, stop=STOP))
    stopped = 0
    for a, b in zip(free, cut):
        ids = a.response_ids.tolist()
        end = first_stop(ids, STOP)
        if end is None:
            assert b.response_ids.tolist() == ids and b.finish_reason == "length"
            assert b.matched is None
            continue
        stopped += 1
        assert b.response_ids.tolist() == ids[:end] and b.finish_reason == "stop"
        assert b.matched in STOP and b.matched in TOK.decode(ids[max(0, end - 3):end])
        torch.testing.assert_close(b.logp_behav, a.logp_behav[:end], atol=0, rtol=0)
    assert stopped >= 8
    with pytest.raises(ValueError, match="tokenizer"):
        EmbeddedEngine.from_model(build_model(DENSE)).generate(
            prompts, 1, SamplingParams(max_new_tokens=2, stop=STOP))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A `megapkl serve` app over a tiny Qwen3 with a character-level Hugging Face tokenizer,
    and the same app without a tokenizer."""
    from transformers import AutoTokenizer

    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.models.tiny import write_tokenizer
    from megapkl.serve.serve import SGLangCompatServer
    from megapkl.serve.serve_state import InterruptibleEngine, ServeState

    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = hf_config_dict(load_spec("tiny-qwen3"), dtype="float32")
    torch.manual_seed(0)
    engine = InterruptibleEngine(cfg, seed=0, tokenizer=tok)
    engine.update_weights(list(engine.model.state_dict().items()), version=0)
    state = ServeState(engine, model_path="m", served_model_name="m")
    return (SGLangCompatServer(state, tokenizer=tok), SGLangCompatServer(state), tok)


def generate(server, tok, **sampling):
    body = {"input_ids": tok.encode("hello", add_special_tokens=False), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "sampling_seed": 3, "ignore_eos": True,
                                **sampling}}
    return server.dispatch("POST", "/generate", body)


def test_serve_stops_as_sglang_answers(app):
    server, bare, tok = app
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    status, free = generate(server, tok)
    assert status == 200 and free["meta_info"]["finish_reason"]["type"] == "length"
    status, kept = generate(server, tok, stop=letters, no_stop_trim=True)
    assert status == 200, kept
    ids, reason = kept["output_ids"], kept["meta_info"]["finish_reason"]
    end = next(t for t in range(1, 17) if tok.decode(ids[:t])[-1:] in letters)
    assert ids == free["output_ids"][:end]  # the same draws, cut at the first letter
    assert reason == {"type": "stop", "matched": tok.decode(ids[-1:])}
    text = tok.decode(ids, skip_special_tokens=True)
    assert kept["text"] == text and text.endswith(reason["matched"])
    status, trimmed = generate(server, tok, stop=letters)  # the ids keep it, the text does not
    assert trimmed["output_ids"] == ids and trimmed["text"] == text[:text.find(reason["matched"])]
    status, one = generate(server, tok, stop=reason["matched"], no_stop_trim=True)  # a string
    assert status == 200 and one["meta_info"]["finish_reason"]["type"] == "stop"


def test_serve_refuses_stop_strings_as_sglang_does(app):
    from megapkl.rollout.stops import unavailable

    server, bare, tok = app
    assert generate(bare, tok, stop="x") == (400, {"error": {"message": unavailable(["x"])}})
    status, body = generate(server, tok, stop=5)
    assert status == 400 and "`stop`" in body["error"]
    status, body = generate(server, tok, stop=["x"] * 33)
    assert status == 400 and "at most 32 stop strings" in body["error"]["message"]
    status, body = generate(server, tok, no_stop_trim="yes")
    assert status == 400 and "no_stop_trim" in body["error"]
