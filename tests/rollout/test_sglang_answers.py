"""An outage loses nothing already generated: the prompt groups a failed batch had answered are
kept under the run directory, and the resumed run's engine takes them instead of asking again
(rollout/sglang/answers.py). Real `megapkl serve` workers; the first is SIGKILLed mid-batch."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from megapkl.rollout.engine import RolloutEngineError, SamplingParams
from megapkl.rollout.sample import PromptItem
from megapkl.rollout.sglang import client as client_mod
from sglang_fixtures import free_port, start_worker, wait_healthy

GROUPS = 8


def _cfg(run_dir, url):
    from megapkl.config.loader import load_config

    return load_config("configs/demo/cpu_demo.yaml", [
        "rollout.engine=sglang", f"rollout.sglang.urls={json.dumps([url])}", f"run_dir={run_dir}",
        "rollout.sglang.max_concurrency=1", "rollout.sglang.no_engine_timeout_s=1",
        "rollout.sglang.health_interval_s=0.2", "rollout.sglang.health_timeout_s=2",
        "rollout.sglang.max_retries=1", "rollout.sglang.startup_timeout_s=120"])


def _engine(cfg):
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.sglang.build import build_sglang_engine

    from engine_contexts import context_of

    hf = hf_config_dict(load_spec("tiny-qwen3"), dtype="float32")
    return build_sglang_engine(cfg.rollout, context_of(cfg, hf))


def _weights(engine_like_seed=5):
    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import EmbeddedEngine

    ref = EmbeddedEngine(hf_config_dict(load_spec("tiny-qwen3"), dtype="float32"), seed=0)
    g = torch.Generator().manual_seed(engine_like_seed)
    return [(n, torch.randn(p.shape, generator=g) * 0.1) for n, p in ref.model.state_dict().items()]


def _draws(samples):
    return [(s.response_ids.tolist(), s.logp_behav.tolist(), s.version) for s in samples]


def test_outage_keeps_answered_groups_for_the_resumed_run(tmp_path, monkeypatch):
    if not os.path.isdir("configs/demo"):
        pytest.skip("run from the repository root")
    port = free_port()
    first = start_worker(tmp_path, port=port, name="first")
    wait_healthy([first])
    cfg, weights = _cfg(tmp_path / "run", first.url), _weights()
    prompts = [PromptItem(torch.arange(1 + i, 4 + i) % 100 + 3) for i in range(GROUPS)]
    sampling = SamplingParams(max_new_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    engine = _engine(cfg)
    try:
        engine.update_weights(weights, version=5)
        engine.new_batch()
        reference = _draws(engine.generate(prompts, 2, sampling))  # the uninterrupted batch

        def kill_after_three():  # one request at a time: the server dies with groups left to do
            while len(engine.answers._batch) < 3:
                time.sleep(0.005)
            os.killpg(first.popen.pid, signal.SIGKILL)
        engine.new_batch()
        killer = threading.Thread(target=kill_after_three)
        killer.start()
        with pytest.raises(RolloutEngineError):
            engine.generate(prompts, 2, sampling)
        killer.join()
    finally:
        engine.close()
        first.stop()
    path = tmp_path / "run" / "sglang" / "answered.pt"
    kept = torch.load(path, weights_only=True)
    assert 3 <= len(kept) < GROUPS, len(kept)

    # The resumed run: a new server (other random weights until the push) on the same URL, a new
    # engine over the same run directory, the same weights pushed at the same version.
    second = start_worker(tmp_path, port=port, seed=1, name="second")
    wait_healthy([second])
    sent = []
    request = client_mod.http.request
    monkeypatch.setattr(client_mod.http, "request",
                        lambda url, route, *a, **k: (sent.append(route), request(url, route, *a, **k))[1])
    engine = _engine(cfg)
    try:
        engine.update_weights(weights, version=5)
        engine.new_batch()
        resumed = _draws(engine.generate(prompts, 2, sampling))
    finally:
        engine.close()
        second.stop()
    assert resumed == reference  # the kept groups and the newly generated ones: the same draws
    assert sent.count("generate") == GROUPS - len(kept)  # nothing answered was asked again
    assert not path.exists()  # used up
