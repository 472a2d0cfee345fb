"""Benchmark: peak memory of the training pass on skewed response lengths, fixed-count vs
token-balanced micro-batches, against a batch of uniform lengths with the same token count.

    python tools/bench/microbatch_memory.py [--responses 32 --long 4 --base 60 --stretch 8]

One minibatch of `--responses` responses whose response lengths are `--base` tokens except
`--long` of them, `--stretch` times longer (the skew of RL rollouts: a few long answers), and a
batch of uniform lengths with the same number of tokens. Each variant runs the trainer's own path
(`Learner.pack`, then the loss pass of `Learner.train_step`: megatron's forward/backward schedule,
the vocab-parallel log-prob and the objective; no optimizer step) in a fresh forked process:

  uniform, fixed count      micro_batch_size responses per micro-batch (the reference)
  skewed,  fixed count      the same count: a micro-batch holding a long response pads every
                            row to it (one row per response) and its activations set the peak
  skewed,  token-balanced   parallel.max_tokens_per_micro_batch = the padded tokens of one
                            uniform micro-batch (first-fit decreasing)

Peak extra memory: the rise of the resident set during the pass (the method of
tools/bench/logprob.py: mmapped allocations, VmHWM reset just before). Goal: token-balanced
within 1.1x of uniform. Ratios are printed side by side, measured in one run.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from logprob import peak_rss, pin_malloc_to_mmap, reset_peak_rss  # noqa: E402
from megapkl.parallel.forked import run_forked  # noqa: E402

MIB = 2**20


def lengths(args, skewed: bool) -> list[int]:
    if skewed:
        return [args.base * (args.stretch if i % (args.responses // args.long) == 0 else 1)
                for i in range(args.responses)]
    total = args.base * (args.responses - args.long) + args.base * args.stretch * args.long
    return [total // args.responses + (i < total % args.responses) for i in range(args.responses)]


def samples(args, resp_lengths, vocab: int):
    from megapkl.rollout.sample import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i, t in enumerate(resp_lengths):
        logp = -torch.rand(t, generator=g) * 3
        out.append(Sample(uid=i, group_id=i // 8, version=0,
                          prompt_ids=torch.randint(3, vocab, (args.prompt,), generator=g),
                          response_ids=torch.randint(3, vocab, (t,), generator=g), logp_behav=logp,
                          logp_prox=logp + 0.01 * torch.randn(t, generator=g),
                          advantage=float(torch.randn((), generator=g))))
    return out


def worker(rank, world, args, skewed: bool, balanced: bool):
    from megapkl.config import load_config
    from megapkl.train.learner import Learner
    from megapkl.train.loop import init_groups

    sys.path.insert(0, os.path.dirname(__file__))
    from trainer import trainer_step

    pin_malloc_to_mmap()
    per_micro = args.micro * (args.prompt + -(-sum(lengths(args, False)) // args.responses))
    budget = -(-per_micro // 2) * 2     # the padded tokens of one uniform micro-batch
    over = ["parallel.data=1", f"objective.name={args.objective}", "logging.tensorboard=false",
            f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.arch={{vocab_size: {args.vocab}, ffn_hidden_size: {4 * args.hidden}, "
            f"num_attention_heads: {args.hidden // 32}, num_query_groups: {args.hidden // 64}, "
            "head_dim: 32}", f"parallel.micro_batch_size={args.micro}",
            f"rollout.max_response_len={args.base * args.stretch}",
            f"rollout.max_prompt_len={args.prompt}", f"rollout.prompts_per_batch={args.responses // 8}",
            "rollout.responses_per_prompt=8"]
    if balanced:
        over.append(f"parallel.max_tokens_per_micro_batch={max(budget, args.base * args.stretch + args.prompt)}")
    cfg = load_config("configs/demo/cpu_demo.yaml", over)
    learner = Learner(cfg.model, cfg.parallel, cfg.train, cfg.objective,
                      temperature=cfg.rollout.temperature,
                      groups=init_groups(cfg.parallel, cfg.model, cfg.train.seed))
    mbs = learner.pack(samples(args, lengths(args, skewed), args.vocab))
    trainer_step(learner, mbs[:1], 0)   # warm-up: one-time allocations are not the pass's peak
    learner.model[0].zero_grad_buffer()
    peak = 0
    for rep in range(args.repeats):
        base = reset_peak_rss()
        trainer_step(learner, mbs, rep)
        peak = max(peak, peak_rss() - base)
        learner.model[0].zero_grad_buffer()
    shapes = sorted({tuple(mb.tokens.shape) for mb in mbs})
    return peak, len(mbs), sum(mb.num_action_tokens for mb in mbs), shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objective", default="proximal_kl")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--responses", type=int, default=32)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--base", type=int, default=60)
    ap.add_argument("--stretch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="responses per fixed-count micro-batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    rows = []
    for name, skewed, balanced in (("uniform, fixed count", False, False),
                                   ("skewed, fixed count", True, False),
                                   ("skewed, token-balanced", True, True)):
        ((peak, n, tokens, shapes),) = run_forked(worker, 1, args, skewed, balanced,
                                                   threads=args.threads, timeout=1800)
        rows.append((name, peak, n, tokens, shapes))
    ref = rows[0][1]
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.responses} responses, prompt {args.prompt}; skewed: {args.long} of them "
          f"{args.stretch}x longer than {args.base}; threads {args.threads}, max of {args.repeats}")
    print(f"{'variant':<24} {'micro-batches':>13} {'action tokens':>13} {'peak extra MiB':>15} "
          f"{'vs uniform':>10}  [b, S] shapes")
    for name, peak, n, tokens, shapes in rows:
        print(f"{name:<24} {n:>13} {tokens:>13} {peak / MIB:>15.1f} {peak / ref:>10.2f}  "
              f"{shapes[:4]}{' ...' if len(shapes) > 4 else ''}")
    print(f"token-balanced / uniform peak: {rows[2][1] / ref:.2f}x (goal <= 1.1x); fixed count / "
          f"uniform: {rows[1][1] / ref:.2f}x")


if __name__ == "__main__":
    main()
