"""Benchmark: trainer step time vs a bare forward/backward of the same model and batch.

Both sides run megatron's forward-backward schedule over the same micro-batches (CPU, one rank):
- bare: logits -> log_softmax -> gathered label log-probs -> -mean (plain cross-entropy), the
  cheapest loss a trainer could use;
- trainer: `Learner.train_step`'s loss path, i.e. the minibatch statistics, the vocab-parallel
  log-prob/entropy/top-K op, the objective (`--objective`, default proximal_kl with full-tail
  future-KL credit) with its LossContext and metrics.
Neither side includes the optimizer step or rollout generation. Interleaved repetitions, medians,
ratio printed side by side. Goal: overhead <= 10%.

    python tools/bench/trainer.py [--objective proximal_kl] [--hidden 256 --layers 4 --vocab 8192]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args):
    from megapkl.config import load_config
    from megapkl.train.learner import Learner
    from megapkl.train.loop import init_groups

    cfg = load_config("configs/demo/cpu_demo.yaml", [
        "parallel.data=1", f"objective.name={args.objective}", "logging.tensorboard=false",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.arch={{vocab_size: {args.vocab}, ffn_hidden_size: {4 * args.hidden}, "
        f"num_attention_heads: {args.hidden // 32}, num_query_groups: {args.hidden // 64}, head_dim: 32}}",
        f"parallel.micro_batch_size={args.micro}"])
    groups = init_groups(cfg.parallel, cfg.model, cfg.train.seed)
    return cfg, Learner(cfg.model, cfg.parallel, cfg.train, cfg.objective,
                        temperature=cfg.rollout.temperature, groups=groups)


def responses(args, g):
    from megapkl.rollout.sample import Sample

    out = []
    for i in range(args.responses):
        p, r = args.prompt, args.response
        logp = -torch.rand(r, generator=g) * 3
        out.append(Sample(version=0, prompt_ids=torch.randint(3, args.vocab, (p,), generator=g),
                            response_ids=torch.randint(3, args.vocab, (r,), generator=g),
                            logp_behav=logp, logp_prox=logp + 0.01 * torch.randn(r, generator=g),
                            advantage=float(torch.randn((), generator=g)), group_id=i // 8, uid=i))
    return out


def bare_step(learner, mbs):
    from megapkl.parallel import megatron_loss as ML

    def loss_func(mb, logits):
        rows = ML.action_values(mb, logits).float()
        lp = torch.log_softmax(rows, -1).gather(1, ML.action_labels(mb)[:, None])[:, 0]
        n = max(1, lp.numel())
        return -lp.sum(), torch.tensor(n, dtype=torch.int), None

    ML.run_schedule(learner.model, mbs, ML.make_forward_step(loss_func), forward_only=False,
                    groups=learner.groups)


def trainer_step(learner, mbs, step):
    from megapkl.parallel import megatron_loss as ML

    obj, groups = learner.objective, learner.groups
    stats = ML.count_minibatch(mbs, groups)
    if ML.prepass_required(obj, groups, len(mbs)):
        stats = ML.run_prepass(obj, groups, learner.model, mbs, stats, learner.temperature, step)
    spec = ML.PolicyLossSpec(cfg=obj, groups=groups, stats=stats, temperature=learner.temperature, step=step)
    reports = ML.forward_backward(spec, learner.model, mbs)
    ML.reduce_reports(reports, groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objective", default="proximal_kl")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg, learner = build(args)
    mbs = learner.pack(responses(args, torch.Generator().manual_seed(0)))
    from megapkl.models.optimizer import zero_grads

    bare, ours = [], []
    for rep in range(args.reps + 1):  # first repetition is warm-up
        for fn, acc in ((lambda: bare_step(learner, mbs), bare), (lambda: trainer_step(learner, mbs, rep), ours)):
            zero_grads(learner.model, learner.optimizer)
            t0 = time.perf_counter()
            fn()
            if rep:
                acc.append(time.perf_counter() - t0)
    b, o = statistics.median(bare), statistics.median(ours)
    tokens = args.responses * args.response
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.responses} responses x ({args.prompt} prompt + {args.response} response) tokens, "
          f"micro-batch {args.micro}, threads {torch.get_num_threads()}, median of {args.reps}")
    print(f"bare forward/backward (cross-entropy) {b * 1e3:8.1f} ms")
    print(f"trainer step ({cfg.objective.name:11s})   {o * 1e3:8.1f} ms   overhead {100 * (o / b - 1):+.1f}%  "
          f"({tokens / o:.0f} action tokens/s)")


if __name__ == "__main__":
    main()
