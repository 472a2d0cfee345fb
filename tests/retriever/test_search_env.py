"""The search environment (Search-R1's tags and texts) over megapkl's own retriever, the managed
retriever's lifecycle, and the answer exact-match reward."""
import os

import pytest
import torch

from megapkl.envs import build_env, build_retriever
from megapkl.envs.base import End, Observation
from megapkl.envs.search import INVALID, SearchEnv, format_passages
from megapkl.rollout.rewards import (AnswerEMReward, exact_match, exact_match_by_source,
                                     last_answer, normalize_answer)
from megapkl.rollout.sample import ACTION, OBSERVATION, Sample, Segment
from megapkl.rollout.turns import Budgets, Turn, TurnDriver


def turn(text):
    return Turn(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]),
                segments=(Segment(ACTION, 1, text=text),))


HITS = [{"document": {"id": "1", "contents": '"Paris"\nParis is the capital.\nOf France.'},
         "score": 3.0},
        {"document": {"id": "2", "contents": '"Lyon"\nLyon is a city.'}, "score": 1.0}]


def test_actions_and_texts():
    asked = []
    env = SearchEnv(lambda q: asked.append(q) or HITS)
    assert env.stop == ("</search>", "</answer>")
    obs = env.step(turn("<think>hm</think> <search>  capital of France </search>"))
    assert asked == ["capital of France"]
    # Search-R1: "\n\n<information>{passages.strip()}</information>\n\n", Doc i(Title: first line)
    assert obs.text == ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital.\nOf France.'
                        '\nDoc 2(Title: "Lyon") Lyon is a city.</information>\n\n')
    assert obs.closing == "</information>\n\n" and obs.source == "tool" and obs.tool == "search"
    assert env.step(turn("<answer> Paris </answer>")) == End("answer")
    bad = env.step(turn("I think the answer is Paris."))
    assert bad == Observation(INVALID, source="invalid")
    assert bad.text.startswith("\nMy previous action is invalid. If I want to search, I should "
                               "put the query between <search> and </search>. If I want")
    # an empty query is still a search (Search-R1 sends it); no hits: an empty block
    empty = SearchEnv(lambda q: asked.append(q) or [])
    assert empty.step(turn("<search></search>")).text == "\n\n<information></information>\n\n"
    assert asked[-1] == "" and format_passages([]) == ""


class Bytes:
    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode(errors="replace")


def test_a_cut_observation_keeps_its_closing():
    env = SearchEnv(lambda q: HITS * 20)
    driver = TurnDriver(env, Bytes(), Budgets(max_turns=4, max_response_tokens=4096,
                                              max_observation_tokens=80))
    ids, text = driver.observation_ids(env.step(turn("<search>x</search>")), 80)
    assert len(ids) <= 80 and text.endswith("</information>\n\n")
    assert text.startswith("\n\n<information>Doc 1(Title: \"Paris\")")
    driver.close()


def test_managed_retriever_serves_and_is_stopped(corpus, tmp_path):
    """`megapkl retriever serve` as a process the run owns: health-checked, queried through the
    search environment, stopped by close()."""
    from megapkl.config.typed import build
    from megapkl.config.sections_env import EnvConfig
    from megapkl.retriever.index import build_index
    from megapkl.rollout.sglang.launch import pick_ports

    build_index(str(corpus), str(tmp_path / "ix"))
    port = pick_ports("127.0.0.1", 18600, 1)[0]
    cfg = build(EnvConfig, {"type": "search", "search": {"index": str(tmp_path / "ix"),
                                                        "port": port}})
    retriever = build_retriever(cfg, tmp_path)
    try:
        retriever.start()
        env = build_env(cfg, retriever=retriever)
        obs = env.step(turn("<search>capital of Kenya</search>"))
        assert obs.text.startswith('\n\n<information>Doc 1(Title: "Nairobi") Nairobi is')
        env.close()
        pid = retriever.proc.popen.pid
    finally:
        retriever.close()
    assert not retriever.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "serving 68 passages (bm25)" in (tmp_path / "retriever.log").read_text()


def test_managed_retriever_that_cannot_start(tmp_path):
    from megapkl.envs.retriever_service import ManagedRetriever, RetrieverLaunchError

    with pytest.raises(RetrieverLaunchError, match="env.search.index: .* is not an index"):
        ManagedRetriever(str(tmp_path), log_path=tmp_path / "r.log").start()
    (tmp_path / "manifest.json").write_text('{"format": 99}')
    r = ManagedRetriever(str(tmp_path), log_path=tmp_path / "r.log", port=18590)
    with pytest.raises(RetrieverLaunchError, match="exited with code 1 before it answered; log: "):
        r.start()


def test_a_retriever_whose_port_another_process_took_is_refused(corpus, tmp_path, monkeypatch):
    """The port was free when checked; another process took it before the retriever bound it
    and answers /health: the run must not search that process's index."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from megapkl.envs.retriever_service import ManagedRetriever, RetrieverLaunchError
    from megapkl.retriever.index import build_index
    from megapkl.rollout.sglang import launch

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    build_index(str(corpus), str(tmp_path / "ix"))
    other = ThreadingHTTPServer(("127.0.0.1", launch.pick_ports("127.0.0.1", 18640, 1)[0]), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    monkeypatch.setattr(launch, "port_free", lambda host, port: True)  # free when checked
    r = ManagedRetriever(str(tmp_path / "ix"), log_path=tmp_path / "r.log",
                         port=other.server_address[1])
    try:
        with pytest.raises(RetrieverLaunchError, match=r"^env.search.port: another process of "
                           r"this host listens on port \d+, neither the one megapkl launched"):
            r.start()
        assert not r.alive()
    finally:
        r.close()
        other.shutdown()
        other.server_close()


def test_a_retriever_that_could_not_bind_its_port_names_the_key(corpus, tmp_path, monkeypatch):
    """The port was free when checked; another process listens on it by the time the retriever
    binds: the retriever exits, and the error names the key to change."""
    import socket

    from megapkl.envs.retriever_service import ManagedRetriever, RetrieverLaunchError
    from megapkl.retriever.index import build_index
    from megapkl.rollout.sglang import launch

    build_index(str(corpus), str(tmp_path / "ix"))
    with socket.socket() as other:
        other.bind(("127.0.0.1", launch.pick_ports("127.0.0.1", 18660, 1)[0]))
        other.listen()
        monkeypatch.setattr(launch, "port_free", lambda host, port: True)  # free when checked
        r = ManagedRetriever(str(tmp_path / "ix"), log_path=tmp_path / "r.log",
                             port=other.getsockname()[1])
        with pytest.raises(RetrieverLaunchError, match=r"^env.search.port: port \d+ taken before "
                           r"it could bind it \(.*r\.log\); choose another"):
            r.start()
        assert not r.alive()


def test_a_dead_url_fails_before_any_rollout():
    from megapkl.config.typed import build
    from megapkl.config.sections_env import EnvConfig
    from megapkl.envs.retriever_client import RetrieverError

    cfg = build(EnvConfig, {"type": "search", "search": {"url": "http://127.0.0.1:9/retrieve",
                                                        "max_retries": 0}})
    with pytest.raises(RetrieverError, match=r"^retriever http://127.0.0.1:9/retrieve "
                       r"\(env.search.url\): 1 attempt\(s\) failed: connection refused"):
        build_env(cfg)


# ---- the reward

def sample(actions, golden=None, answer="Paris", source="nq", uid=0):
    """A multi-turn sample: action texts with observations between them."""
    segs, n = [], 0
    for i, a in enumerate(actions):
        if i:
            segs.append(Segment(OBSERVATION, 2, text="<information>x</information>",
                                source="tool"))
        segs.append(Segment(ACTION, 2, text=a))
    total = sum(s.length for s in segs)
    a_count = sum(s.length for s in segs if s.kind == ACTION)
    fields = {"source": source, **({"golden_answers": golden} if golden else {})}
    return Sample(uid=uid, group_id=0, prompt_ids=torch.tensor([1]),
                  response_ids=torch.arange(total), logp_behav=torch.zeros(a_count), version=0,
                  segments=tuple(segs), answer=answer,
                  prompt_text="... For example, <answer> x </answer>. Question: q?",
                  metadata={"fields": fields})


def test_normalisation_is_search_r1s():
    assert normalize_answer("  The Eiffel-Tower,  in PARIS!") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    assert exact_match("the United States", ["United States of America", "united states"])
    assert not exact_match("Paris, France", ["Paris"])


def test_answer_em_reads_the_last_answer_the_policy_wrote():
    r = AnswerEMReward(correct=1.0, incorrect=0.0)
    good = sample(["<search>capital</search>", "<answer>the paris</answer>"])
    two = sample(["<answer>Lyon</answer>", "<answer>Paris</answer>"])
    # no answer written: the prompt's example "<answer> x </answer>" is never read, even when
    # it would match
    none = sample(["<search>capital</search>", "I do not know"], golden=["x"])
    golden = sample(["<answer>City of Light</answer>"], golden=["Paris", "City of Light"])
    wrong_first = sample(["<answer>Paris</answer> <answer>Rome</answer>"])
    assert r([good, two, none, golden, wrong_first]).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert last_answer(["<answer>a</answer>", "no answer here"]) == "a"


def test_exact_match_per_source():
    r = AnswerEMReward(correct=1.0, incorrect=0.0)
    ss = [sample(["<answer>Paris</answer>"], source="nq", uid=0),
          sample(["<answer>Rome</answer>"], source="nq", uid=1),
          sample(["<answer>Paris</answer>"], source="hotpotqa", uid=2)]
    r(ss)
    assert exact_match_by_source(ss, r) == {"em/hotpotqa": 1.0, "em/nq": 0.5, "em/avg": 0.75}
