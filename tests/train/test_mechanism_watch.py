"""The one-line warnings when an objective's mechanism stops acting (train/mechanism_watch.py): the
rule on its own, and through a real run whose Proximal KL cost clip binds on every moving token."""
import pytest

from megapkl.train.mechanism_watch import BINDS, WINDOW, MechanismWatch


def pkl(clip, moving=0.5):
    return {"pkl/cost_clip_frac_moving": clip, "pkl/moving_frac": moving}


def test_the_cost_clip_warning_comes_once_after_a_window_above_one_half():
    watch = MechanismWatch()
    said = [watch.note(pkl(0.9)) for _ in range(WINDOW + 5)]
    assert [bool(s) for s in said] == [False] * (WINDOW - 1) + [True] + [False] * 5
    assert "objective.cost_clip" in said[WINDOW - 1][0] and "90%" in said[WINDOW - 1][0]


def test_updates_where_nothing_moved_are_left_out_and_one_half_is_not_most():
    watch = MechanismWatch()
    for _ in range(3 * WINDOW):  # a minibatch whose reference is the current policy, then 0.5
        assert watch.note(pkl(0.0, moving=0.0)) == []
        assert watch.note(pkl(BINDS)) == []
    watch = MechanismWatch()
    for _ in range(WINDOW - 1):  # left out: the mean is over updates that moved, all clipped
        assert watch.note(pkl(0.0, moving=0.0)) == [] and watch.note(pkl(1.0)) == []
    assert watch.note(pkl(0.0, moving=0.0)) == []
    assert watch.note(pkl(1.0))


def test_sis_warns_when_most_rejections_are_outside_the_top_k():
    watch = MechanismWatch()
    quiet = {"sis/reject_outside_topk": 0.9, "sis/accept_rate": 1.0}  # nothing rejected
    assert not any(watch.note(quiet) for _ in range(2 * WINDOW))
    said = [watch.note({"sis/reject_outside_topk": 0.6, "sis/accept_rate": 0.7})
            for _ in range(WINDOW)]
    assert said[-1] and "objective.sis.top_k" in said[-1][0] and not any(said[:-1])


def test_a_run_whose_cost_clip_binds_says_so_once(dist_run, tmp_path, capfd):
    from megapkl.config import load_config
    from megapkl.train.local import _rank_main
    from megapkl.train.metrics_log import read_metrics

    steps = 2 * WINDOW + 2
    cfg = load_config("configs/demo/cpu_demo.yaml", [
        "logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=4", "rollout.max_response_len=4", "parallel.micro_batch_size=4",
        "checkpoint.every=0", f"run_dir={tmp_path / 'run'}", "parallel.data=1",
                             "objective.name=proximal_kl", "objective.cost_clip=1e-9",
                             f"train.steps={steps}", "rollout.refresh_every=2",
                             "reference.refresh_every=2"])
    dist_run(_rank_main, 1, cfg, timeout=300)
    rows = read_metrics(cfg.run_dir)
    moved = [r for r in rows if r["pkl/moving_frac"] > 0]
    assert len(moved) >= WINDOW and all(r["pkl/cost_clip_frac_moving"] == 1.0 for r in moved)
    for r in rows:  # every moving token clipped: the all-token figure is the moving share
        assert r["pkl/cost_clip_frac"] == pytest.approx(r["pkl/moving_frac"], abs=1e-12)
    err = capfd.readouterr().err
    assert err.count("warning: the Proximal KL cost clip binds") == 1, err[-2000:]
    assert "objective.cost_clip" in err

