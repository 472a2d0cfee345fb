"""SGLang protocol end to end for R3 and FP8, against real `megapkl serve` processes.

R3: a tiny-Qwen3-MoE worker started with --enable-return-routed-experts, behind the real
sglang-router, generates for the real trainer (`rollout.engine: sglang`); the routed experts come
back base64 on the wire, the client maps their rows onto the trainer's replay positions, and the
megatron-core learner replaying them reproduces the engine's log-probs.

FP8: a worker started with --quantization fp8 and the client with rollout.fp8's transform: every
sync mode sends block-FP8 buckets, the worker holds what write_fp8_checkpoint writes, and a
mismatched FP8 tensor is refused naming the weight.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sglang_fixtures import make_serve_cluster  # noqa: F401

MOE = ["model.name=tiny-qwen3-moe", "model.routing_replay=true", "parallel.data=1",
       "logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
       "rollout.responses_per_prompt=4", "rollout.max_response_len=6", "parallel.micro_batch_size=8",
       "rollout.temperature=0.8", "checkpoint.every=0"]
EXPERT_GAIN = 8.0


# ---------------------------------------------------------------------------------------- R3

def r3_worker(rank, world, cfg):
    """Runs in a forked gloo rank: one batch from the SGLang engine, then the learner's log-probs
    of it replaying the wire's experts, routing on its own, and replaying wrong experts."""
    from megapkl.models.chunks import model_chunks
    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.train.loop import Trainer

    t = Trainer(cfg)
    assert isinstance(t.rollouts.engine, SGLangEngine)
    with torch.no_grad():  # louder experts (the random init's are faint): routing shows in logp
        for chunk in model_chunks(t.learner.model):
            for name, p in chunk.named_parameters():
                if "mlp.experts" in name and "linear_fc2" in name:
                    p.mul_(EXPERT_GAIN)
    t.keep_weights(0)  # the engine gets the trainer's weights, gain included
    samples = t.rollouts.collect(0, [0] * cfg.rollout.prompts_per_batch)
    assert samples and all(s.version == 0 and s.routed_experts is not None for s in samples)
    shapes = {tuple(s.routed_experts.shape[1:]) for s in samples}
    rows_ok = all(s.routed_experts.shape[0] == s.prompt_len + s.response_len - 1 for s in samples)
    learner = t.learner
    experts = learner.spec.num_experts

    def logprobs(batch):
        out = learner.logprobs(learner.pack(batch))
        return torch.cat([(out[s.uid] - s.logp_behav).abs() for s in samples])

    replayed = logprobs(samples)
    natural = logprobs([dataclasses.replace(s, routed_experts=None) for s in samples])
    wrong = logprobs([dataclasses.replace(s, routed_experts=(s.routed_experts + 1) % experts)
                      for s in samples])
    return dict(shapes=shapes, rows_ok=rows_ok, tokens=int(replayed.numel()),
                replayed=float(replayed.max()), natural=float(natural.max()),
                natural_tokens=int((natural > 1e-4).sum()), wrong=float(wrong.max()),
                wrong_tokens=int((wrong > 1e-2).sum()))


def test_routed_experts_over_the_wire_replay_engine_logprobs(make_serve_cluster, dist_run,
                                                             tmp_path):
    from megapkl.config import load_config

    cluster = make_serve_cluster(num_workers=1, model_config="tiny-qwen3-moe",
                                 worker_args=["--enable-return-routed-experts"])
    cfg = load_config("configs/demo/cpu_demo.yaml", [
        *MOE, f"run_dir={tmp_path / 'r3'}", "rollout.engine=sglang",
        f"rollout.sglang.urls={json.dumps(cluster.worker_urls)}",
        f"rollout.sglang.router_url={cluster.router_url}"])
    got = dist_run(r3_worker, 1, cfg, timeout=300)[0]
    print(f"R3 over the wire: {got}")
    assert got["shapes"] == {(2, 2)} and got["rows_ok"]  # 2 MoE layers x top-2, P + R - 1 rows
    assert got["tokens"] >= 16
    assert got["replayed"] < 1e-4, f"replayed log-probs differ from the engine's by {got}"
    # Replay is in effect: other experts move the log-probs far beyond the tolerance.
    assert got["wrong"] > 1e-2 and got["wrong_tokens"] > got["tokens"] // 4, got
