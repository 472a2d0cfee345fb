"""User rewards: `reward.type: python` (a function by dotted path, in a bounded worker process)
and `reward.type: http` (a reward server, with timeouts and retries). Real worker processes and a
real HTTP server on loopback."""
from __future__ import annotations

import http.server
import json
import logging
import sys
import textwrap
import threading
import time

import pytest
import torch

from megapkl.rollout.bounded_verify import RewardError
from megapkl.rollout.rewards import ERROR_KEY, FunctionReward, HttpReward
from megapkl.rollout.sample import Sample

MODULE = """
import os, sys, time, math

def lengths(prompts, responses, answers, fields):
    print("a user's print must not break the protocol")
    return [float(len(r)) + (100.0 if f.get("level") == "hard" else 0.0) + (a == r) * 1000.0
            for r, a, f in zip(responses, answers, fields)]

def raises(prompts, responses, answers, fields):
    raise ValueError("no reward for " + prompts[0])

def sleeps(prompts, responses, answers, fields):
    time.sleep(60)

def blocks_signals(prompts, responses, answers, fields):
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(60)

def too_few(prompts, responses, answers, fields):
    return [1.0]

def not_finite(prompts, responses, answers, fields):
    return [math.nan for _ in responses]

not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))  # for this process; the workers get PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    return "my_rewards"


def group(texts, answer="abc", gid=0, fields=None):
    return [Sample(uid=gid * 10 + i, group_id=gid, prompt_ids=torch.tensor([1]),
                   response_ids=torch.tensor([5]), logp_behav=torch.zeros(1), version=0,
                   prompt_text=f"prompt {gid}", response_text=t, answer=answer,
                   metadata={"source": "train.jsonl", "line": gid + 1, "fields": fields or {}})
            for i, t in enumerate(texts)]


def test_python_reward_scores_each_group_with_its_fields(user_module):
    with FunctionReward(f"{user_module}:lengths", -1.0, -2.0) as reward:
        samples = group(["a", "abc"], fields={"level": "hard"}) + group(["xyz", "ab"], gid=1)
        got = reward(samples)
    assert got.tolist() == [101.0, 1103.0, 3.0, 2.0]
    assert [s.reward for s in samples] == got.tolist()
    assert not any(ERROR_KEY in s.metadata for s in samples)


def test_a_function_that_cannot_be_loaded_fails_at_construction(user_module):
    with pytest.raises(RewardError, match=r"cannot load 'my_rewards:missing' \(AttributeError"):
        FunctionReward(f"{user_module}:missing")
    with pytest.raises(RewardError, match=r"cannot load 'no_such_module:f' \(ModuleNotFoundError"):
        FunctionReward("no_such_module:f")
    with pytest.raises(RewardError, match="not a callable"):
        FunctionReward(f"{user_module}:not_callable")


def test_a_raising_function_fails_the_batch_or_scores_incorrect(user_module, caplog):
    with FunctionReward(f"{user_module}:raises", on_error="fail") as reward:
        with pytest.raises(RewardError, match=r"reward.function my_rewards:raises failed on the "
                           r"group of prompt train.jsonl:1: ValueError: no reward for prompt 0"):
            reward(group(["a", "b"]))
    caplog.set_level(logging.WARNING, logger="megapkl.rollout.rewards")
    with FunctionReward(f"{user_module}:raises", 1.0, -1.0, on_error="incorrect") as reward:
        samples = group(["a", "b"])
        assert reward(samples).tolist() == [-1.0, -1.0]
    assert all("ValueError: no reward" in s.metadata[ERROR_KEY] for s in samples)
    assert "scored reward.incorrect" in caplog.text and "train.jsonl:1" in caplog.text


@pytest.mark.parametrize("name, kind", [("sleeps", "timeout"), ("blocks_signals", "killed")])
def test_a_hanging_function_is_bounded_and_the_next_call_works(user_module, name, kind):
    bad = FunctionReward(f"{user_module}:{name}", timeout_s=1, on_error="incorrect")
    t0 = time.monotonic()
    samples = group(["a", "b"])
    assert bad(samples).tolist() == [-1.0, -1.0]
    assert time.monotonic() - t0 < 20
    reason = samples[0].metadata[ERROR_KEY]
    assert ("timeout: no answer within reward.timeout_s (1 s)" in reason if kind == "timeout"
            else "no answer within 7 s (worker killed)" in reason), reason
    bad.close()
    good = FunctionReward(f"{user_module}:lengths", timeout_s=1)
    assert good(group(["abcd"])).tolist() == [4.0]
    good.close()


@pytest.mark.parametrize("name, why", [("too_few", "expected a list of 2 rewards"),
                                       ("not_finite", "reward 0 is nan")])
def test_a_wrong_answer_is_an_error(user_module, name, why):
    with FunctionReward(f"{user_module}:{name}") as reward:
        with pytest.raises(RewardError, match=why):
            reward(group(["a", "b"]))


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


@pytest.fixture
def reward_server():
    """A loopback reward server; `plan` is the list of answers (status, body or 'hang') to give,
    the last one repeated; `seen` the request bodies."""
    state = {"plan": [(200, None)], "seen": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["seen"].append(body)
            status, reply = state["plan"].pop(0) if len(state["plan"]) > 1 else state["plan"][0]
            if reply == "hang":
                time.sleep(3)
                return
            if reply is None:
                reply = {"rewards": [float(r == a) for r, a in
                                     zip(body["responses"], body["answers"])]}
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/reward"
    yield state
    server.shutdown()
    server.server_close()


def test_http_reward_posts_each_group_and_retries_server_errors(reward_server):
    reward = HttpReward(reward_server["url"], 1.0, 0.0, timeout_s=1, max_retries=2)
    samples = group(["abc", "x"], fields={"id": 7}) + group(["abc"], gid=1)
    assert reward(samples).tolist() == [1.0, 0.0, 1.0]
    first = reward_server["seen"][0]
    assert first == {"prompts": ["prompt 0"] * 2, "responses": ["abc", "x"],
                     "answers": ["abc", "abc"], "fields": [{"id": 7}, {"id": 7}]}
    reward_server["seen"].clear()
    reward_server["plan"] = [(503, {"error": "busy"}), (200, "hang"), (200, None)]
    assert reward(group(["abc"])).tolist() == [1.0]  # a 503 and a timeout, then an answer
    assert len(reward_server["seen"]) == 3


def test_http_reward_does_not_retry_a_client_error_and_names_it(reward_server):
    reward_server["plan"] = [(400, {"detail": "field 'answers' is required"})]
    reward = HttpReward(reward_server["url"], timeout_s=1, max_retries=3)
    with pytest.raises(RewardError, match=r"reward.url .* failed on the group of prompt "
                       r"train.jsonl:1: 1 attempt\(s\) failed: HTTP 400: .*answers' is required"):
        reward(group(["a"]))
    assert len(reward_server["seen"]) == 1
    down = HttpReward("http://127.0.0.1:9/reward", timeout_s=1, max_retries=1,
                      on_error="incorrect")
    samples = group(["a"])
    assert down(samples).tolist() == [-1.0]
    assert "2 attempt(s) failed" in samples[0].metadata[ERROR_KEY]
