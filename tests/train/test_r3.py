"""R3 end to end: the experts the embedded engine records, replayed in the trainer's megatron
forward, give the engine's own log-probs (tiny Qwen3-MoE, same weights version)."""

from megapkl.config import load_config

MOE = ["model.name=tiny-qwen3-moe", "model.routing_replay=true", "parallel.data=1",
       "logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
       "rollout.responses_per_prompt=4", "rollout.max_response_len=4", "parallel.micro_batch_size=8",
       "rollout.temperature=0.8"]


def worker(rank, world, cfg):
    import dataclasses

    from megapkl.train.loop import Trainer
    from megapkl.train.run_context import RunContext

    t = Trainer(cfg, RunContext().__enter__())  # open for the rank's life
    t.keep_weights(t.schedule.plan(0))
    samples = t.rollouts.collect(0, [0] * cfg.rollout.prompts_per_batch)
    responses = samples
    assert all(r.routed_experts is not None for r in responses)
    replayed = t.learner.logprobs(t.learner.pack(responses))
    experts = t.learner.spec.num_experts
    shifted = [dataclasses.replace(r, routed_experts=(r.routed_experts + 1) % experts) for r in responses]
    wrong = t.learner.logprobs(t.learner.pack(shifted))
    diff = max(float((replayed[r.uid] - r.logp_behav).abs().max()) for r in responses)
    off = max(float((wrong[r.uid] - r.logp_behav).abs().max()) for r in responses)
    return diff, off, sum(r.response_len for r in responses)


def test_replayed_routing_reproduces_engine_logprobs(dist_run, tmp_path):
    cfg = load_config("configs/demo/cpu_demo.yaml", [*MOE, f"run_dir={tmp_path / 'r3'}"])
    diff, off, tokens = dist_run(worker, 1, cfg, timeout=240)[0]
    assert tokens > 0
    assert diff < 1e-4, f"replayed log-probs differ from the engine's by {diff}"
    assert off > 1e-2, "replaying other experts did not change the log-probs: replay is not in effect"
