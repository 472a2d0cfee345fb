"""Benchmark: each objective's loss + coefficients + metrics (+ backward to logp) versus plain pg.

One run, same synthetic batch (default 1M tokens in 4k responses, groups of 8, K = 10 top-K for
SIS), interleaved repetitions, median times, ratios printed side by side:

    python tools/bench/objectives.py [--tokens 1048576] [--responses 4096] [--reps 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megapkl.objectives import PolicyLossConfig, TokenBatch, policy_loss

CASES = {
    "pg (token_mean)": {"name": "pg"},
    "grpo": {"name": "grpo"},
    "dapo": {"name": "dapo"},
    "cispo": {"name": "cispo"},
    "proximal_kl H=full": {"name": "proximal_kl", "horizon": "full"},
    "proximal_kl H=32 tail": {"name": "proximal_kl", "horizon": 32, "tail": "linear"},
    "seq_is": {"name": "seq_is"},
    "is_free": {"name": "is_free"},
    "gspo": {"name": "gspo"},
    "tetpo (24 steps)": {"name": "tetpo", "bisection_steps": 24},
    "gepo": {"name": "gepo"},
    "m2po": {"name": "m2po"},
    "dppo_tv (K=10)": {"name": "dppo_tv"},
    "clip_cov": {"name": "clip_cov"},
    "grpo + sis K=10": {"name": "grpo", "sis": {"enabled": True, "top_k": 10}},
    "proximal_kl + sis K=10": {"name": "proximal_kl", "sis": {"enabled": True, "top_k": 10}},
    "gspo + sis K=10": {"name": "gspo", "sis": {"enabled": True, "top_k": 10}},
}


def make_batch(n_tokens: int, n_resp: int, k: int, vocab: int = 151936, seed: int = 0) -> TokenBatch:
    """Random lengths summing to n_tokens, log-probs with a stale behavior policy, top-K fields."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n_tokens - 1, generator=g)[: n_resp - 1] + 1).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n_tokens])]))
    ridx = torch.repeat_interleave(torch.arange(n_resp), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(n_tokens) - starts[ridx] + 1
    logp_behav = -torch.rand(n_tokens, generator=g) * 3
    logp = (logp_behav + 0.1 * torch.randn(n_tokens, generator=g)).requires_grad_()
    logp_prox = logp_behav + 0.05 * torch.randn(n_tokens, generator=g)
    rewards = torch.randint(0, 2, (n_resp,), generator=g).float() * 2 - 1
    group = torch.arange(n_resp) // 8
    adv = (rewards - rewards.view(-1, 8).mean(1).repeat_interleave(8))[ridx]
    topk_ids = torch.randint(0, vocab, (n_tokens, k), generator=g)
    token_ids = torch.where(torch.rand(n_tokens, generator=g) < 0.9, topk_ids[:, 0],
                            torch.randint(0, vocab, (n_tokens,), generator=g))
    topk_logp_behav = -torch.rand(n_tokens, k, generator=g) * 4
    topk_logp_behav[:, 0] = logp_behav
    topk_logp = topk_logp_behav + 0.1 * torch.randn(n_tokens, k, generator=g)
    return TokenBatch(logp=logp, logp_behav=logp_behav, logp_prox=logp_prox, advantages=adv,
                      response_index=ridx, group_index=group, positions=positions,
                      token_ids=token_ids, topk_ids=topk_ids, topk_logp_behav=topk_logp_behav,
                      topk_logp=topk_logp, step=3)


def run_once(cfg: PolicyLossConfig, batch: TokenBatch) -> float:
    batch.logp.grad = None
    t0 = time.perf_counter()
    out = policy_loss(cfg, batch)
    out.loss.backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--responses", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = make_batch(args.tokens, args.responses, 10)
    cfgs = {name: PolicyLossConfig.from_dict(d) for name, d in CASES.items()}
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    for name, cfg in cfgs.items():  # warm-up
        run_once(cfg, batch)
    for _ in range(args.reps):  # interleaved so drift hits every case alike
        for name, cfg in cfgs.items():
            times[name].append(run_once(cfg, batch))
    base = statistics.median(times["pg (token_mean)"])
    print(f"{args.tokens} tokens, {args.responses} responses, threads={torch.get_num_threads()}, "
          f"median of {args.reps}; goal <= 1.05x pg")
    print(f"{'objective':28s} {'ms':>9s} {'x pg':>7s}")
    for name in cfgs:
        med = statistics.median(times[name])
        print(f"{name:28s} {med * 1e3:9.2f} {med / base:7.2f}")


if __name__ == "__main__":
    main()
