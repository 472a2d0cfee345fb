"""tools/bench/peer_trl.py: one description gives both systems the same settings.

The megapkl side is read back through megapkl's own config loader, the TRL side is the plain
`GRPOConfig` keyword dict (TRL itself is not installed here); the tokenizer and the reward the TRL
side uses are checked against megapkl's CharTokenizer and SyntheticReward.
"""
import importlib.util
from pathlib import Path

import pytest
import torch

from megapkl.config import load_config
from megapkl.models.spec import hf_config_dict, load_spec, spec_from_model_config
from megapkl.rollout.rewards import SyntheticReward
from megapkl.rollout.sample import Sample
from megapkl.rollout.synthetic import CharTokenizer, make_synthetic_task

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("peer_trl", ROOT / "tools" / "bench" / "peer_trl.py")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)

# The shipped description and one with every number changed: a setting one side hard-codes
# instead of reading from the description fails the second.
OTHER = dict(peer.DESCRIPTION, prompts_per_update=8, group_size=4, micro_batch_size=8,
             max_response_len=3, temperature=0.7, top_p=0.9, lr=1.0e-3, adam_beta1=0.8,
             adam_beta2=0.99, adam_eps=1.0e-6, weight_decay=0.01, grad_clip=0.5, clip_eps=0.1,
             reward_correct=1.0, reward_incorrect=0.0)


@pytest.mark.parametrize("d", [peer.DESCRIPTION, OTHER], ids=["demo", "changed"])
def test_both_sides_get_the_same_settings(d, tmp_path):
    cfg = load_config(str(peer.DEMO_CONFIG), peer.megapkl_overrides(d, 3, 7, tmp_path / "run"))
    t = peer.trl_settings(d, 3, 7, tmp_path / "trl")
    r, tr, o = cfg.rollout, cfg.train, cfg.objective
    assert (cfg.seed, tr.steps) == (t["seed"], t["max_steps"]) == (3, 7)
    assert cfg.parallel.data == 1 and cfg.parallel.micro_batch_size == t["per_device_train_batch_size"]
    assert r.responses_per_prompt == t["num_generations"] == d["group_size"]
    assert (r.prompts_per_batch * r.responses_per_prompt
            == t["per_device_train_batch_size"] * t["gradient_accumulation_steps"]
            == d["prompts_per_update"] * d["group_size"])
    assert r.max_response_len == t["max_completion_length"] == d["max_response_len"]
    assert (r.temperature, r.top_p) == (t["temperature"], t["top_p"]) == (d["temperature"], d["top_p"])
    assert r.top_k == -1 and t["top_k"] == 0  # each side's spelling of "no top-k"
    assert (tr.lr, tr.adam_beta1, tr.adam_beta2, tr.adam_eps, tr.weight_decay, tr.grad_clip) == (
        t["learning_rate"], t["adam_beta1"], t["adam_beta2"], t["adam_epsilon"], t["weight_decay"],
        t["max_grad_norm"])
    assert tr.lr == d["lr"] and tr.grad_clip == d["grad_clip"]
    assert (tr.lr_schedule, tr.warmup_steps) == ("constant", 0)
    assert (t["lr_scheduler_type"], t["warmup_steps"]) == ("constant", 0)
    # on-policy GRPO, one update per batch, no KL term, token-mean loss, group-mean advantage
    assert (r.protocol, r.refresh_every, r.minibatches_per_batch) == ("on_policy", 1, 1)
    assert cfg.reference.mode == "behavior" and t["num_iterations"] == 1 and t["beta"] == 0.0
    assert o.name == "grpo" and (o.eps_clip_low, o.eps_clip_high) == (t["epsilon"], t["epsilon_high"])
    assert o.kl_init_coef == 0.0 and o.entropy_coef == 0.0
    assert o.aggregation == "token_mean" and t["loss_type"] == "dapo"
    assert cfg.advantage.mode == "group_mean" and t["scale_rewards"] == "none"
    assert (cfg.reward.correct, cfg.reward.incorrect) == (d["reward_correct"], d["reward_incorrect"])
    assert cfg.data.synthetic == d["task"]
    # the same architecture: the TRL side builds its Qwen3Config from this very dict
    assert cfg.model.dtype == "fp32" and not t["bf16"] and not t["fp16"]
    assert cfg.model.recompute == "none" and not t["gradient_checkpointing"]
    assert (hf_config_dict(spec_from_model_config(cfg.model), "float32")
            == hf_config_dict(load_spec(d["model"]), "float32"))


def test_two_rank_system_changes_only_the_rank_count(tmp_path):
    """megapkl DP=2 trains the same batch in the same micro-batches, split over two ranks."""
    one = peer.megapkl_overrides(peer.DESCRIPTION, 3, 7, tmp_path / "run")
    two = peer.megapkl_overrides(peer.DESCRIPTION, 3, 7, tmp_path / "run", ranks=2)
    assert [a for a, b in zip(one, two) if a != b] == ["parallel.data=1"] and len(one) == len(two)
    cfg = load_config(str(peer.DEMO_CONFIG), two)
    assert cfg.parallel.data == 2
    assert cfg.parallel.micro_batch_size == peer.DESCRIPTION["micro_batch_size"]
    assert (cfg.rollout.prompts_per_batch * cfg.rollout.responses_per_prompt
            == peer.DESCRIPTION["prompts_per_update"] * peer.DESCRIPTION["group_size"])


def test_cpu_seconds_counts_child_processes(tmp_path):
    """DP=2's ranks are children of the launching process: their CPU time is the system's."""
    import subprocess
    import sys
    import time

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
    parent = ("import subprocess, sys, time\n"
              f"c = [subprocess.Popen([sys.executable, '-c', {spin!r}]) for _ in range(2)]\n"
              "[x.wait() for x in c]\ntime.sleep(5)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        best = 0.0
        while proc.poll() is None and best < 2.5:
            best = max(best, peer.cpu_seconds(proc.pid))
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert best >= 2.5  # two children of 1.5 CPU s each, the parent idle


def test_trl_tokenizer_has_megapkl_ids():
    tok, ref = peer.char_tokenizer(), CharTokenizer()
    for p in make_synthetic_task("next_mod10").problems():
        assert tok(p.prompt)["input_ids"] == ref.encode(p.prompt)
    assert len(tok) == ref.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        ref.pad_token_id, ref.bos_token_id, ref.eos_token_id)


def test_trl_reward_scores_as_megapkl():
    task = make_synthetic_task("next_mod10")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128, (2,), generator=g).tolist() for _ in range(400)]
    ids += [[ord(str((d + 1) % 10)), 2] for d in range(10)] + [[2], [0, 5]]  # right, EOS, PAD
    answers = [str((i + 1) % 10) for i in range(len(ids))]
    for d in (peer.DESCRIPTION, OTHER):
        ours = SyntheticReward(task, d["reward_correct"], d["reward_incorrect"])
        want = [ours.score(Sample(uid=i, group_id=0, prompt_ids=torch.tensor([1, 48]),
                                  response_ids=torch.tensor(x), logp_behav=torch.zeros(len(x)),
                                  version=0, answer=a))
                for i, (x, a) in enumerate(zip(ids, answers))]
        got = peer.score_completions(task, ids, answers, d)
        assert got == want
        assert d["reward_correct"] in got and d["reward_incorrect"] in got
