"""Measure the communication the distributed policy loss adds under context parallelism.

    python tools/bench/cp_comm.py                    # CP=2, DP=1, 16 responses, 2 micro-batches
    python tools/bench/cp_comm.py --cp 2 --dp 2 --responses 32 --micro 2

Runs the loss path of `megapkl.parallel.megatron_loss` on forked gloo ranks without a model
(the model's own CP traffic, e.g. the attention K/V all-gather, is not the loss's): responses ->
micro-batches -> CP shards -> `TokenBatch` with synthetic log-probs -> minibatch counts,
pre-pass (TETPO/GEPO/M2PO), `shard_context` + `policy_loss` per shard, metric reduction. Every
torch.distributed collective is wrapped to record its payload: "sent" is the tensor a rank
contributes (all_reduce buffer, all_gather input), "received" what it gets back (the all_gather
output; the all_reduce buffer). Reported per action token of the minibatch, summed over ranks,
and per rank per micro-batch the number of collective calls (latency, which dominates at
these sizes).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megapkl.parallel.forked import run_forked  # noqa: E402

CASES = {
    "pg": {"name": "pg"},
    "grpo": {"name": "grpo"},
    "proximal_kl H=full": {"name": "proximal_kl"},
    "proximal_kl H=5 linear": {"name": "proximal_kl", "horizon": 5, "tail": "linear"},
    "seq_is": {"name": "seq_is"},
    "gspo": {"name": "gspo"},
    "gspo + SIS": {"name": "gspo", "sis": {"enabled": True, "top_k": 10}},
    "tetpo": {"name": "tetpo"},
    "gepo": {"name": "gepo"},
    "m2po": {"name": "m2po"},
}


class CommCounter:
    """Wraps torch.distributed collectives in this process and sums their payloads."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.sent = self.received = self.calls = 0
        self._orig = {}

    def __enter__(self) -> "CommCounter":
        for name in self.NAMES:
            self._orig[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._orig[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            out, inp = (args + (None, None))[:2]
            nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
            if name == "all_gather":
                self.sent += nbytes(inp)
                self.received += sum(nbytes(t) for t in out)
            elif name == "all_gather_into_tensor":
                self.sent += nbytes(inp)
                self.received += nbytes(out)
            else:  # all_reduce / broadcast / reduce_scatter: the first tensor argument
                self.sent += nbytes(out)
                self.received += nbytes(out)
            self.calls += 1
            return fn(*args, **kwargs)
        return counted


def make_responses(n: int, seed: int, k: int = 10):
    from megapkl.rollout.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for uid in range(n):
        p, t = int(torch.randint(64, 512, (1,), generator=g)), int(torch.randint(128, 2048, (1,), generator=g))
        lp = -torch.rand(t, generator=g) * 2
        topk = torch.randint(0, 1000, (t, k), generator=g)
        out.append(Sample(version=0, prompt_ids=torch.randint(0, 1000, (p,), generator=g),
                            response_ids=topk[:, 0].clone(), logp_behav=lp, advantage=float(torch.randn(1, generator=g)),
                            group_id=uid // 8, uid=uid, logp_prox=lp + 0.05 * torch.randn(t, generator=g),
                            topk_ids=topk, topk_logp=-torch.rand(t, k, generator=g) * 2))
    return out


def worker(rank, world_size, args):
    from megapkl.objectives import PolicyLossConfig
    from megapkl.parallel import batching as B
    from megapkl.parallel import megatron_loss as L
    from megapkl.parallel.groups import ParallelGroups
    from megapkl.parallel.shard_loss import shard_policy_loss, shard_prepass

    cp, dp = args.cp, args.dp
    d, c = divmod(rank, cp)
    cps = [dist.new_group([x * cp + y for y in range(cp)]) for x in range(dp)]
    dps = [dist.new_group([x * cp + y for x in range(dp)]) for y in range(cp)]
    groups = ParallelGroups.from_groups(world=dist.group.WORLD, tp=None, pp=None, cp=cps[d], dp=dps[c],
                                        dp_cp=dist.group.WORLD, ep=None)
    rs = make_responses(args.responses, args.seed)
    mine = rs[d::dp]
    shards = [B.shard_for_cp(mb, c, cp) for mb in B.make_micro_batches(mine, args.micro, B.pad_multiple(cp))]
    g = torch.Generator().manual_seed(rank)
    logp = [mb.fields["logp_behav"][mb.loss_mask] + 0.1 * torch.randn(mb.num_action_tokens, generator=g)
            for mb in shards]
    topk = [mb.fields["topk_logp_behav"][mb.loss_mask] + 0.1 for mb in shards]
    results = {}
    for label, case in CASES.items():
        cfg = PolicyLossConfig.from_dict(case)
        with CommCounter() as cc:
            stats = L.count_minibatch(shards, groups)
            spec = L.PolicyLossSpec(cfg=cfg, groups=groups, stats=stats)
            batches = [B.token_batch(mb, lp, topk_logp=tk if cfg.sis.enabled else None)
                       for mb, lp, tk in zip(shards, logp, topk)]
            if L.prepass_required(cfg, groups, len(shards)):
                pre = []
                for mb, tb in zip(shards, batches):
                    ctx = L.shard_context(spec, mb, tb)
                    pre.append(shard_prepass(cfg, tb, ctx))
                spec.stats = L.gather_prepass(cfg, groups, pre, stats)
            reports = []
            for mb, tb in zip(shards, batches):
                out = shard_policy_loss(cfg, tb, L.shard_context(spec, mb, tb))
                reports.append(L.ShardReport(loss=out.loss.detach(), num_tokens=tb.num_tokens, parts=out.parts))
            L.reduce_reports(reports, groups)
        results[label] = (cc.sent, cc.received, cc.calls, stats.num_tokens)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--responses", type=int, default=16)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ranks = run_forked(worker, args.cp * args.dp, args, timeout=600)
    tokens = ranks[0]["pg"][3]
    print(f"CP={args.cp} DP={args.dp}: {args.responses} responses, {int(tokens)} action tokens, "
          f"{args.micro} micro-batches per DP rank")
    print(f"{'objective':26s} {'sent B/token':>13s} {'recv B/token':>13s} {'calls/rank/mb':>14s}")
    for label in CASES:
        sent = sum(r[label][0] for r in ranks)
        recv = sum(r[label][1] for r in ranks)
        calls = max(r[label][2] for r in ranks) / args.micro
        print(f"{label:26s} {sent / tokens:13.2f} {recv / tokens:13.2f} {calls:14.1f}")


if __name__ == "__main__":
    main()
