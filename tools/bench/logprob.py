"""Benchmark: vocab-parallel log-prob + entropy + top-K vs naive log_softmax, forward+backward.

    python tools/bench/logprob.py            # 2048 tokens x 151936 vocab, fp32 (~1.2 GB logits)
    python tools/bench/logprob.py --small    # 256 tokens x 32768 vocab, seconds

Variants (each in its own forked process, so memory peaks do not mix):
  naive logp   log_softmax(x / T) then gather the target              (what most trainers do)
  naive all    the same plus entropy and the top-K gather             (same outputs as ours)
  ours logp    megapkl.parallel.vocab, target log-prob only
  ours all     target log-prob + entropy + top-K in one pass
  ours all TP2 two gloo ranks, each holding half the vocabulary
  megatron logp  megatron-core's `vocab_parallel_cross_entropy` on the same logits (divided by T
               first, as a Megatron trainer does), negated: the anchor a Megatron user has today.
               Its row at TP2 runs two gloo ranks. Goal: "ours logp" within 1.1x of it in time
               and peak memory, while "ours all" also returns entropy and top-K.

Time: best of --repeats of forward + backward (upstream gradient of ones), after the logits
exist and after an 8-token warm-up step. Ratios are against "naive all" (same outputs).

Peak extra memory: the rise of the process's resident set during forward + backward,
reported as a multiple of one logits tensor (the process's own shard under TP). Method:
glibc's mmap threshold is pinned at 64 KiB (mallopt), so every tensor buffer is its own
mapping, touched pages count in RSS and freed tensors leave RSS immediately; the kernel's RSS
high-water mark (VmHWM) is reset through /proc/self/clear_refs just before the step and read
right after; the largest rise over the repeats is reported. The number therefore includes
the logits gradient (one logits tensor: the floor for any method that materialises it) and
every temporary; torch's CPU allocator does not cache, so nothing hides in a pool. Caveat:
the pinned threshold makes every >= 64 KiB allocation fault in fresh pages, which can slow
allocation-heavy code (the naive path) at small sizes; at the default size every large
tensor is above glibc's own 32 MiB mmap ceiling anyway, so timings are unaffected there.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megapkl.parallel.forked import run_forked  # noqa: E402
from megapkl.parallel.vocab import default_chunk_tokens, token_logprobs_entropy_topk  # noqa: E402

GIB = 2**30


# ---------------------------------------------------------------- memory measurement


def pin_malloc_to_mmap() -> None:
    """Make RSS follow live tensors: big allocations are mmapped and unmapped on free."""
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold, m_trim_threshold = -3, -1
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 64 * 1024)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS; returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


# ---------------------------------------------------------------- the step being measured


def make_inputs(args, vocab_local: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(args.tokens, vocab_local, generator=gen).mul_(3.0).to(args.dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    topk = torch.randint(0, args.vocab, (args.tokens, args.topk), generator=gen)
    return logits, targets, topk


def naive_step(x, targets, topk, temperature, everything: bool):
    logp_all = torch.log_softmax(x.float() / temperature, dim=-1)
    outs = [logp_all.gather(1, targets[:, None])[:, 0]]
    if everything:
        outs.append(-(logp_all.exp() * logp_all).sum(-1))
        outs.append(logp_all.gather(1, topk))
    return outs


def megatron_step(x, targets, temperature):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return [-vocab_parallel_cross_entropy(x.float() / temperature, targets)]


def ours_step(x, targets, topk, temperature, everything: bool, group, chunk):
    out = token_logprobs_entropy_topk(x, targets, group, temperature,
                                      topk_ids=topk if everything else None,
                                      need_entropy=everything, chunk_tokens=chunk)
    return [t for t in out if t is not None]


def measure(rank, world_size, args, variant: str):
    """Runs in a fresh forked process: (best seconds, peak extra bytes, logits bytes, sample)."""
    pin_malloc_to_mmap()
    vocab_local = args.vocab // world_size
    logits, targets, topk = make_inputs(args, vocab_local, seed=rank)
    group = None
    if world_size > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    if variant.startswith("megatron"):  # megatron reads its TP group from parallel_state
        from megapkl.parallel.groups import init_parallel

        init_parallel(tp=world_size)
    everything = variant.endswith("all")

    def step(x, t, k):
        if variant.startswith("naive"):
            outs = naive_step(x, t, k, args.temperature, everything)
        elif variant.startswith("megatron"):
            outs = megatron_step(x, t, args.temperature)
        else:
            outs = ours_step(x, t, k, args.temperature, everything, group, args.chunk)
        sum(o.sum() for o in outs).backward()
        return outs

    # warm-up on 8 tokens: one-time costs (autograd engine start, lazy inits) are not per step
    step(logits[:8].detach().requires_grad_(), targets[:8], topk[:8])
    best, peak = float("inf"), 0
    for _ in range(args.repeats):
        x = logits.detach().requires_grad_()
        base = reset_peak_rss()
        start = time.perf_counter()
        outs = step(x, targets, topk)
        best = min(best, time.perf_counter() - start)
        peak = max(peak, peak_rss() - base)
        sample = [o.detach()[:4].clone() for o in outs] + [x.grad[:4].clone()]
        del outs, x
    return best, peak, logits.numel() * logits.element_size(), sample


# ---------------------------------------------------------------- report


def run_variant(args, variant: str, tp: int):
    anchor = variant.startswith("megatron")  # megatron's process groups: compat, gloo even at TP1
    results = run_forked(measure, tp, args, variant, threads=args.threads, install_compat=anchor,
                         init_distributed=tp > 1 or anchor, timeout=args.timeout)
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    chunk = args.chunk or default_chunk_tokens(args.vocab, tokens=args.tokens)
    print(f"tokens={args.tokens} vocab={args.vocab} dtype={str(args.dtype)[6:]} K={args.topk} "
          f"T={args.temperature} threads/process={args.threads} chunk_tokens={chunk} "
          f"repeats={args.repeats}")
    rows, samples = [], {}
    for variant, tp in [("naive logp", 1), ("naive all", 1), ("megatron logp", 1), ("ours logp", 1),
                        ("ours all", 1)] + (
            [("megatron logp", 2), ("ours logp", 2), ("ours all", 2)] if not args.no_tp2 else []):
        for rank, (secs, peak, nbytes, sample) in enumerate(run_variant(args, variant, tp)):
            rows.append((variant, tp, rank, secs, peak, nbytes))
            samples[(variant, tp, rank)] = sample
    naive_all = next(r[3] for r in rows if r[0] == "naive all")
    print(f"one logits tensor: {rows[0][5] / GIB:.3f} GiB (per rank at TP2: half)")
    print(f"{'variant':<13} {'tp':>2} {'rank':>4} {'fwd+bwd s':>10} {'vs naive all':>12} "
          f"{'peak extra GiB':>15} {'x logits':>9}")
    for variant, tp, rank, secs, peak, nbytes in rows:
        print(f"{variant:<13} {tp:>2} {rank:>4} {secs:>10.3f} {secs / naive_all:>12.2f} "
              f"{peak / GIB:>15.3f} {peak / nbytes:>9.2f}")
    for tp in sorted({t for _, t, *_ in rows}):
        anchor = [r for r in rows if r[0] == "megatron logp" and r[1] == tp]
        ours = [r for r in rows if r[0] == "ours logp" and r[1] == tp]
        for a, o in zip(anchor, ours):
            print(f"ours logp / megatron vocab_parallel_cross_entropy (TP{tp} rank {a[2]}): time "
                  f"{o[3] / a[3]:.2f}x, peak extra memory {o[4] / max(a[4], 1):.2f}x (goal <= 1.1x)")
    diff = (samples[("ours logp", 1, 0)][0].double()
            - samples[("megatron logp", 1, 0)][0].double()).abs().max().item()
    print(f"max |ours logp - megatron logp| on the first 4 tokens (TP1): {diff:.1e}")
    ref, got = samples[("naive all", 1, 0)], samples[("ours all", 1, 0)]
    diffs = ", ".join(f"{name} {(a.double() - b.double()).abs().max().item():.1e}"
                      for name, a, b in zip(("logp", "entropy", "topk", "grad"), got, ref))
    print(f"max |ours - naive| on the first 4 tokens (TP1): {diffs}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="256 tokens x 32768 vocab")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: auto)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (1: the ranks share the cores)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-tp2", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.small:
        args.tokens, args.vocab = 256, 32768
    args.dtype = getattr(torch, args.dtype)
    if args.vocab % 2:
        p.error("--vocab must be even (TP=2 splits it in halves)")
    return args


if __name__ == "__main__":
    main()
