"""Benchmark metrics from per-sample correctness (pure functions, no torch).

    pass_at_k(n, c, k)     unbiased estimate of P(at least one of k draws is correct) from n >= k
                           samples of which c are correct: 1 - C(n - c, k) / C(n, k)
    mean_at_k(correct)     Avg@k / mean@k: the fraction of the k samples per prompt that are
                           correct, averaged over prompts (with k samples for every prompt this is
                           also total correct / total responses)
    summarize(per_prompt)  the per-benchmark summary; `micro_average` pools benchmarks' samples,
                           `macro_average` averages their accuracies

`per_prompt` is a list of lists of booleans: the correctness of each sample drawn for one prompt.
Greedy pass@1 is mean@1 of one greedy sample per prompt.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), computed as the product prod_{i = n - c + 1}^{n} (1 - k / i).

    The product form never builds the binomials (which overflow floats for n in the hundreds) and
    stays in [0, 1]; C(n - c, k) / C(n, k) = prod_{j=0}^{k-1} (n - c - j) / (n - j) equals it."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n (n samples per prompt), got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_at_k(per_prompt: Sequence[Sequence[bool]]) -> float:
    """Mean over prompts of the fraction of that prompt's samples that are correct."""
    if not per_prompt:
        raise ValueError("mean_at_k: no prompts")
    return sum(sum(map(bool, s)) / len(s) for s in _nonempty(per_prompt)) / len(per_prompt)


def _nonempty(per_prompt: Sequence[Sequence[bool]]) -> Sequence[Sequence[bool]]:
    for i, s in enumerate(per_prompt):
        if len(s) == 0:
            raise ValueError(f"prompt {i} has no samples")
    return per_prompt


def summarize(per_prompt: Sequence[Sequence[bool]], ks: Iterable[int] = (), greedy: bool = False
              ) -> dict[str, float]:
    """{num_prompts, num_samples, num_correct, accuracy, mean@n, pass@k for k in ks (<= n)}.

    `accuracy` is num_correct / num_samples (the micro average inside the benchmark); mean@n uses
    the smallest per-prompt sample count n; greedy runs report it as pass@1_greedy."""
    _nonempty(per_prompt)
    if not per_prompt:
        raise ValueError("summarize: no prompts")
    n_min = min(len(s) for s in per_prompt)
    total = sum(len(s) for s in per_prompt)
    right = sum(sum(map(bool, s)) for s in per_prompt)
    out: dict[str, float] = {"num_prompts": len(per_prompt), "num_samples": total,
                             "num_correct": right, "accuracy": right / total}
    if greedy:
        out["pass@1_greedy"] = mean_at_k(per_prompt)
    else:
        out[f"mean@{n_min}"] = mean_at_k(per_prompt)
    for k in sorted(set(ks)):
        if k <= n_min:
            out[f"pass@{k}"] = sum(pass_at_k(len(s), sum(map(bool, s)), k)
                                   for s in per_prompt) / len(per_prompt)
    return out


def micro_average(summaries: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Pooled over benchmarks: total correct / total responses (a benchmark weighs by its
    samples; the papers' "Avg" columns are `macro_average`)."""
    total = sum(int(s["num_samples"]) for s in summaries.values())
    right = sum(int(s["num_correct"]) for s in summaries.values())
    if total == 0:
        raise ValueError("micro_average: no samples")
    return {"num_samples": total, "num_correct": right, "accuracy": right / total}


def macro_average(summaries: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The unweighted mean of the benchmarks' accuracies (every benchmark weighs the same, however
    many prompts and samples it has): the SIS paper's "Avg" column."""
    if not summaries:
        raise ValueError("macro_average: no benchmarks")
    accs = [float(s["accuracy"]) for s in summaries.values()]
    return {"benchmarks": len(accs), "accuracy": sum(accs) / len(accs)}


def default_ks(n: int) -> list[int]:
    """pass@k reported for k = 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]
