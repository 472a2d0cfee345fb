"""pass@k against brute-force enumeration of k-subsets; mean@k and micro-averages by hand."""
import itertools
import math

import pytest

from megapkl.eval.metrics import default_ks, mean_at_k, micro_average, pass_at_k, summarize


def brute_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (c correct) that hold at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable_and_matches_binomials():
    for n, c, k in [(200, 3, 16), (1000, 1, 64), (64, 10, 64), (500, 0, 32)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, then one division
        got = pass_at_k(n, c, k)
        assert 0.0 <= got <= 1.0 and got == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert pass_at_k(16, 1, 1) == pytest.approx(1 / 16)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_mean_at_k_and_summary_by_hand():
    per_prompt = [[True, False, False, False], [True, True, True, True], [False] * 4]
    # prompt fractions 1/4, 1, 0 -> mean 5/12; pooled 5 of 12
    assert mean_at_k(per_prompt) == pytest.approx(5 / 12)
    s = summarize(per_prompt, ks=[1, 2, 4])
    assert s["mean@4"] == pytest.approx(5 / 12) and s["accuracy"] == pytest.approx(5 / 12)
    # pass@1 = mean@4 here; pass@2: (1 - C(3,2)/C(4,2)) = 1/2, 1, 0 -> 1/2; pass@4: 1, 1, 0 -> 2/3
    assert s["pass@1"] == pytest.approx(5 / 12)
    assert s["pass@2"] == pytest.approx(0.5)
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert (s["num_prompts"], s["num_samples"], s["num_correct"]) == (3, 12, 5)
    g = summarize([[True], [False], [True]], greedy=True)
    assert g["pass@1_greedy"] == pytest.approx(2 / 3) and "mean@1" not in g


def test_micro_average_pools_responses_not_benchmarks():
    a = summarize([[True]] * 3 + [[False]])            # 3 / 4 greedy-style
    b = summarize([[True, False, False, False]] * 4)   # 4 / 16
    m = micro_average({"a": a, "b": b})
    assert m["accuracy"] == pytest.approx(7 / 20)       # not (0.75 + 0.25) / 2
    assert m["num_samples"] == 20


def test_default_ks():
    assert default_ks(16) == [1, 2, 4, 8, 16] and default_ks(1) == [1] and default_ks(6) == [1, 2, 4, 6]


def test_macro_average_weighs_every_benchmark_the_same():
    """SIS Table 1's Avg: GRPO on Qwen3-8B-Base's six QA sets average to 45.85, whatever their
    sizes (pooled samples would be dominated by PopQA's 14,267 questions)."""
    from megapkl.eval.metrics import macro_average

    em = {"nq": 49.14, "triviaqa": 66.99, "popqa": 44.68, "hotpotqa": 46.24, "musique": 19.24,
          "bamboogle": 48.8}
    sizes = {"nq": 3610, "triviaqa": 11313, "popqa": 14267, "hotpotqa": 7405, "musique": 2417,
             "bamboogle": 125}
    per = {k: {"num_samples": sizes[k], "num_correct": round(sizes[k] * v / 100),
               "accuracy": v / 100} for k, v in em.items()}
    assert macro_average(per)["accuracy"] == pytest.approx(0.4585, abs=5e-5)
    assert micro_average(per)["accuracy"] == pytest.approx(0.5028, abs=5e-4)
