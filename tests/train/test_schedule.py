"""Protocol schedules (docs/spec.md section 10) checked step by step."""
import pytest

from megapkl.config import load_config
from megapkl.train.schedule import Schedule


def test_periodic_refresh_n4_reference_l2():
    s = Schedule("periodic_refresh", refresh_every=4, groups_per_batch=2, reference_mode="snapshot",
                 reference_every=2)
    got = [(p.update, p.new_batch, p.group_versions[0], p.reference_version, p.refresh_reference,
            max(p.staleness)) for p in map(s.plan, range(9))]
    assert got == [
        (0, True, 0, 0, True, 0), (1, True, 0, 0, False, 1), (2, True, 0, 2, True, 2),
        (3, True, 0, 2, False, 3), (4, True, 4, 4, True, 0), (5, True, 4, 4, False, 1),
        (6, True, 4, 6, True, 2), (7, True, 4, 6, False, 3), (8, True, 8, 8, True, 0),
    ]
    assert all(0 <= st <= 3 for p in map(s.plan, range(100)) for st in p.staleness)


def test_on_policy_is_fresh_every_update():
    s = Schedule("on_policy", reference_mode="behavior")
    for u in range(6):
        p = s.plan(u)
        assert p.new_batch and p.group_versions == (u,) and p.staleness == [0]
        assert p.reference_version is None and not p.refresh_reference


@pytest.mark.parametrize("k", [0, 4, 16])
def test_controlled_staleness_bound_and_minibatch_reuse(k):
    s = Schedule("controlled_staleness", minibatches=4, groups_per_batch=3, max_staleness=k,
                 reference_mode="per_batch")
    for u in range(200):
        p = s.plan(u)
        assert p.new_batch == (u % 4 == 0) and p.batch == u // 4 and p.minibatch == u % 4
        u_b = 4 * p.batch
        assert p.group_versions == (max(0, u_b - k),) * 3
        assert u_b - p.group_versions[0] == min(k, u_b)   # lag at batch start <= k, used fully
        assert p.reference_version == u_b and p.refresh_reference == (u % 4 == 0)


def test_uniform_stale_lags_uniform_in_1_to_k_and_deterministic():
    s = Schedule("uniform_stale", groups_per_batch=64, max_staleness=8, reference_mode="behavior", seed=3)
    lags = []
    for u in range(40, 240):
        p = s.plan(u)
        assert p.group_versions == Schedule("uniform_stale", groups_per_batch=64, max_staleness=8,
                                            reference_mode="behavior", seed=3).plan(u).group_versions
        lags += p.staleness
    assert set(lags) == set(range(1, 9))
    counts = [lags.count(i) for i in range(1, 9)]
    assert max(counts) / min(counts) < 1.3  # 12,800 draws: each lag within ~15% of 1,600
    early = s.plan(2)
    assert all(v >= 0 for v in early.group_versions) and max(early.staleness) <= 2
    other_seed = Schedule("uniform_stale", groups_per_batch=64, max_staleness=8, reference_mode="behavior", seed=4)
    assert other_seed.plan(100).group_versions != s.plan(100).group_versions


def test_from_config_demo_and_pool_bound():
    cfg = load_config("configs/demo/cpu_demo.yaml")
    s = Schedule.of(cfg.rollout, cfg.reference, cfg.seed)
    assert (s.protocol, s.refresh_every, s.reference_every) == ("periodic_refresh", 4, 4)
    cs = Schedule("controlled_staleness", minibatches=4, max_staleness=16, reference_mode="per_batch")
    for u in range(100):
        assert u - cs.oldest_needed(u) <= 16 + 3 + 1


@pytest.mark.parametrize("schedule", [
    Schedule("periodic_refresh", refresh_every=4, groups_per_batch=2),
    Schedule("controlled_staleness", minibatches=4, groups_per_batch=3, max_staleness=5),
    Schedule("controlled_staleness", minibatches=2, groups_per_batch=3, max_staleness=0),
    Schedule("uniform_stale", groups_per_batch=8, max_staleness=3, seed=5),
    Schedule("on_policy")], ids=lambda s: s.protocol)
def test_versions_not_kept_are_never_generated_from(schedule):
    """The trainer keeps version u for the rollouts only when `may_generate_from(u)`: every
    version a batch names must be one of those (else its file was never written)."""
    named = {v for b in range(240 // schedule.minibatches) for v in schedule.group_versions(b)}
    assert named and all(schedule.may_generate_from(v) for v in named)
    if schedule.protocol in ("periodic_refresh", "controlled_staleness"):  # none kept in vain
        assert {u for u in range(200) if schedule.may_generate_from(u)} <= named
