"""tools/study_cpu.py: the declared study plans and validates as written, and its verdicts follow
the declared rule from per-seed summaries (paired tests, Holm within the family)."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from megapkl.analysis import compare_stats as st

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("study_cpu", ROOT / "tools" / "study_cpu.py")
study = importlib.util.module_from_spec(spec)
sys.modules["study_cpu"] = study  # its dataclasses look their module up
spec.loader.exec_module(study)


def test_every_declared_setting_validates(tmp_path):
    from megapkl.analysis.compare import plan_arms, method_label

    arms = 0
    for name, fam in study.FAMILIES.items():
        methods = {s.name: {method_label(m) for m in s.methods} for s in fam.settings}
        for s in fam.settings:
            arms += len(plan_arms(study.BASE, s.methods, [0], s.overrides, tmp_path / s.name))
        added = tuple(t for c in fam.added + fam.declared for t in c.tests)
        for t in fam.tests + fam.described + added:  # every test names arms of its settings
            assert {t.a, t.b} <= methods[t.setting] and (t.lo is None or {t.a, t.b} <= methods[t.lo])
    # pilot 3, PKL 8, SIS 8, TETPO 4 per seed; the follow-up: its pilot 3, clip 10, SIS 4, TETPO 2;
    # the noise floor's re-run 2
    assert arms == 23 + 19 + 2


def test_the_follow_up_runs_what_the_doc_declares():
    """The follow-up's arms resolve to the declared settings (eps_F 0.05 / eps_mid / none, SIS's
    envelope over the whole vocabulary, TETPO's cosine schedule), and docs/study-cpu.md's
    "Follow-up" section names every one of its settings, arms and declared tests."""
    from megapkl.rollout.synthetic import CharTokenizer

    k4, k16 = study.FAMILIES["clip"].settings
    clip = {m: c.objective.cost_clip for m, c in study.arm_configs(k4).items()}
    assert clip == {"pg": 0.05, "grpo": 0.05, "proximal_kl": 0.05, "proximal_kl_eps_null": None,
                    "proximal_kl_eps_mid": clip["proximal_kl_eps_mid"]}
    assert clip["proximal_kl_eps_mid"] in study.PILOT_EPS
    assert [c.rollout.max_staleness for c in study.arm_configs(k16).values()] == [16] * 5
    for s in study.FAMILIES["clip_pilot"].settings:
        assert study.arm_configs(s)["proximal_kl"].objective.cost_clip == float(s.name[-3:]) / 100
    for s in study.FAMILIES["sis_full"].settings:
        cfg = study.arm_configs(s)
        assert cfg["sis_grpo"].objective.sis.enabled and not cfg["grpo"].objective.sis.enabled
        assert cfg["sis_grpo"].objective.sis.top_k == study.VOCAB == CharTokenizer.vocab_size
        assert cfg["sis_grpo"].objective.kl_init_coef == 0.0 == cfg["grpo"].objective.kl_init_coef
    (tl,) = study.FAMILIES["tetpo_lr"].settings
    cfg = study.arm_configs(tl)
    assert (cfg["tetpo"].train.lr_schedule, cfg["tetpo_cosine"].train.lr_schedule) == ("constant", "cosine")
    assert cfg["tetpo_cosine"].objective.kappa == cfg["tetpo"].objective.kappa == 0.85
    assert cfg["tetpo_cosine"].train.warmup_steps == 0.05 * cfg["tetpo"].train.steps
    text = (ROOT / "docs" / "study-cpu.md").read_text()
    section = text[text.index("## Follow-up (declared 2026-12-04"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    assert text.index("## What was tried and what was not") < text.index("## Follow-up")
    for key in study.FOLLOW_UP:
        fam = study.FAMILIES[key]
        assert f"`{key}`" in section
        for s in fam.settings:
            assert f"`{s.name}`" in section, s.name
            assert all(f"`{study.label(m)}`" in section for m in s.methods), s.name
        for c in fam.declared:
            for t in c.tests:
                assert t.label() in section, t.label()
    assert "/work" not in text and "../shared" not in text


def test_eps_mid_rule_and_guard(tmp_path):
    """eps_mid is the smallest grid value that clips at most 10% of moving tokens in the pilot
    (the largest if none does); the clip family does not start without the pilot's choice."""
    assert study.eps_mid_choice({0.1: 0.3, 0.2: 0.08, 0.4: 0.01}) == 0.2
    assert study.eps_mid_choice({0.1: 0.1, 0.2: 0.08, 0.4: 0.01}) == 0.1
    assert study.eps_mid_choice({0.1: 0.5, 0.2: 0.3, 0.4: 0.2}) == 0.4
    assert study.eps_mid_choice({0.1: 0.05}) is None
    with pytest.raises(SystemExit, match="needs the pilot first"):
        study.check_eps_mid(tmp_path)
    have = study.arm_configs(study.FAMILIES["clip"].settings[0])["proximal_kl_eps_mid"].objective.cost_clip
    other = next(e for e in study.PILOT_EPS if e != have)
    fracs = {e: (0.05 if e >= other else 0.5) for e in study.PILOT_EPS}  # the rule picks `other`
    for e, s in zip(study.PILOT_EPS, study.FAMILIES["clip_pilot"].settings):
        (tmp_path / f"{s.name}.json").write_text(json.dumps(
            {"summary": {"diagnostics": {"proximal_kl": {study.MOVING: [fracs[e]] * 2}}}, "runs": {}}))
    assert study.pilot_fractions(tmp_path) == fracs
    with pytest.raises(SystemExit, match=f"the pilot chose eps_F = {other}"):
        study.check_eps_mid(tmp_path)


def test_peak_windows_and_moving_means():
    """A run's peak is where its eval EMA is highest; the diagnostics are averaged over the 40
    updates up to it and over the updates after it; the clipped fraction of moving tokens only
    over updates in which tokens moved."""
    rows = []
    for step in range(100):
        r = {"step": step, "grad_norm": 1.0 if step < 50 else 3.0,
             study.MOVING: 0.0 if step % 4 == 0 else 0.6, "pkl/moving_frac": 0.0 if step % 4 == 0 else 1.0}
        if (step + 1) % 10 == 0:  # an evaluation shares its update's row
            r.update({study.PRIMARY: 0.9 if step + 1 == 50 else 0.1, "eval/version": step + 1})
        rows.append(r)
    assert study._mean(rows, study.MOVING) == pytest.approx(0.6)
    w = study.peak_windows(rows, ("grad_norm",))
    assert w["peak"] == 50 and w["collapsed"]
    assert w["rise"]["grad_norm"] == 1.0 and w["fall"]["grad_norm"] == 3.0


def test_test_families_are_as_declared():
    """SIS: the two N = 4 tests only (the N = 1 difference in differences would repeat them);
    PKL: descriptive tests one Holm family per setting, the level claim added as its own family."""
    fam = study.FAMILIES["sis"]
    assert [(t.setting, t.lo) for t in fam.tests] == [("sis_n4", None)] * 2
    pkl = study.FAMILIES["pkl"]
    groups = study.per_setting(pkl.described)
    assert list(groups) == ["pkl_k4", "pkl_k16"] and all(len(g) == 4 for g in groups.values())
    (level,) = pkl.added
    assert {(t.a, t.b, t.setting, t.lo) for t in level.tests} == {
        (a, "grpo", k, None) for a in ("proximal_kl", "proximal_kl_h4") for k in ("pkl_k4", "pkl_k16")}


def _summary(per_method: dict) -> dict:
    return {"seeds": [0, 1, 2, 3], "metrics": {study.PRIMARY: {"methods": {
        m: {study.SUMMARY: {"values": v}} for m, v in per_method.items()}}}}


def test_verdicts_follow_the_declared_rule():
    fam = study.FAMILIES["tetpo"]
    base = [0.50, 0.40, 0.60, 0.45]
    good = {"tetpo": [x + 0.10 + 0.01 * i for i, x in enumerate(base)], "gepo": base,
            "m2po": [x - 0.02 for x in base], "grpo": [x + 0.01 for x in base]}
    _, results = study.test_lines({"tetpo_u16": _summary(good)}, fam.tests)
    assert [t.b for t, _, _ in results] == ["gepo", "m2po", "grpo"]
    ref = [st.paired_t(good["tetpo"], good[b]) for b in ("gepo", "m2po", "grpo")]
    assert [r.diff for _, r, _ in results] == pytest.approx([r.diff for r in ref])
    assert [p for _, _, p in results] == pytest.approx(st.holm([r.p for r in ref]))
    assert study.verdict(results, 3).startswith("supported")
    worse = dict(good, m2po=[x + 0.3 + 0.01 * i for i, x in enumerate(base)])
    assert study.verdict(study.test_lines({"tetpo_u16": _summary(worse)}, fam.tests)[1],
                         3).startswith("contradicted")
    noisy = dict(good, grpo=[good["tetpo"][0] + 0.2, good["tetpo"][1] - 0.2, *good["tetpo"][2:]])
    assert study.verdict(study.test_lines({"tetpo_u16": _summary(noisy)}, fam.tests)[1],
                         3) == "not resolved: 2 of 3 tests resolved in the claimed direction"
    assert study.verdict([], 3).startswith("not yet measured")


def test_difference_in_differences_pairs_settings_by_seed():
    fam = study.FAMILIES["pkl"]
    k4 = {"pg": [0.5, 0.6, 0.4], "grpo": [0.6, 0.6, 0.5], "proximal_kl": [0.6, 0.7, 0.5],
          "proximal_kl_h4": [0.6, 0.6, 0.6]}
    k16 = {"pg": [0.2, 0.3, 0.2], "grpo": [0.3, 0.4, 0.2], "proximal_kl": [0.5, 0.6, 0.5],
           "proximal_kl_h4": [0.4, 0.4, 0.3]}
    summaries = {"pkl_k4": _summary(k4), "pkl_k16": _summary(k16)}
    _, results = study.test_lines(summaries, fam.tests)
    t, r, _ = results[0]  # (proximal_kl - grpo at k16) - (... at k4): per seed 0.2, 0.1, 0.3
    assert (t.a, t.b, t.lo) == ("proximal_kl", "grpo", "pkl_k4")
    assert r.diff == pytest.approx(0.2)
    ref = st.paired_t([0.2, 0.1, 0.3], [0.0, 0.0, 0.0])
    assert (r.low, r.high, r.p) == (pytest.approx(ref.low), pytest.approx(ref.high), pytest.approx(ref.p))
    assert len(results) == 4 and study.verdict(results, 4).startswith(("not resolved", "supported"))


def test_analysis_reads_back_its_committed_copies(tmp_path, capsys):
    """`analyze OUT --docs D` copies each setting's per-seed summary (and run record) to D, and
    `analyze D` prints the same tables and tests from those copies alone."""

    from megapkl.analysis.compare import Comparison, summarize

    rows = lambda v: [{"step": i, "train/accuracy": x, "eval/micro_avg/accuracy": x,  # noqa: E731
                       "eval/version": i + 1} for i, x in enumerate(v)]
    cmp = Comparison(tmp_path, ["tetpo", "gepo", "m2po", "grpo"], [0, 1, 2], study.CRITERIA)
    cmp.runs = {m: {s: rows([0.1 * s, 0.2 + d, 0.5 + d + 0.01 * s]) for s in range(3)}
                for m, d in (("tetpo", 0.3), ("gepo", 0.0), ("m2po", 0.1), ("grpo", 0.2))}
    (tmp_path / "out" / "tetpo_u16").mkdir(parents=True)
    (tmp_path / "out" / "tetpo_u16" / "summary.json").write_text(json.dumps(summarize(cmp)))
    (tmp_path / "out" / "tetpo_u16" / "runs.json").write_text('{"tetpo/seed-0": {"commit": "abc"}}')
    (tmp_path / "out" / "tetpo_u16" / "curve_eval_micro_avg_accuracy.png").write_bytes(b"png")
    study.analyze(tmp_path / "out", None)  # printing only: nothing copied, nothing raised
    assert not (tmp_path / "docs").exists()
    capsys.readouterr()
    study.analyze(tmp_path / "out", tmp_path / "docs")
    first = capsys.readouterr().out
    assert (tmp_path / "docs" / "tetpo_u16.png").read_bytes() == b"png"
    copy = json.loads((tmp_path / "docs" / "tetpo_u16.json").read_text())
    assert copy["runs"] == {"tetpo/seed-0": {"commit": "abc"}}
    study.analyze(tmp_path / "docs", None)
    assert capsys.readouterr().out == first
    assert "| tetpo - gepo at tetpo_u16 | 0.2 |" in first and "**Verdict: supported" in first


def test_descriptive_tests_are_adjusted_within_their_setting(capsys):
    """Each setting's descriptive tests get Holm's adjustment over that setting's tests alone."""
    k4 = {"pg": [0.1, 0.2, 0.15, 0.12], "grpo": [0.5, 0.6, 0.55, 0.7],
          "proximal_kl": [0.3, 0.35, 0.2, 0.4], "proximal_kl_h4": [0.2, 0.3, 0.35, 0.25]}
    k16 = {m: [x * 0.5 + 0.01 * i for i, x in enumerate(v)] for m, v in k4.items()}
    summaries = {"pkl_k4": _summary(k4), "pkl_k16": _summary(k16)}
    for setting, tests in study.per_setting(study.FAMILIES["pkl"].described).items():
        _, results = study.test_lines(summaries, tests)
        data = summaries[setting]["metrics"][study.PRIMARY]["methods"]
        raw = [st.paired_t(data[t.a][study.SUMMARY]["values"], data[t.b][study.SUMMARY]["values"]).p
               for t in tests]
        assert [p for _, _, p in results] == pytest.approx(st.holm(raw)), setting


def test_later_minibatch_mechanism_metrics(tmp_path):
    """A proximal metric's mean over the updates after each batch's first minibatch: from the
    rows when the runs are at hand (per-batch reference, M from the run's config.yaml), and
    derived as M / (M - 1) times the logged mean from a summary that has only that."""
    from megapkl.analysis.compare import (LATER, Comparison, mechanism_means,
                                          per_batch_minibatches)

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("rollout: {minibatches_per_batch: 4}\nreference: {mode: per_batch}\n")
    assert per_batch_minibatches(run) == 4
    (run / "config.yaml").write_text("rollout: {minibatches_per_batch: 4}\nreference: {mode: behavior}\n")
    assert per_batch_minibatches(run) is None and per_batch_minibatches(tmp_path / "none") is None
    clip = [0.0, 0.6, 0.7, 0.8, 0.0, 0.5, 0.4, 0.3]  # the first of every 4 is 0 (ratio 1)
    cmp = Comparison(tmp_path, ["proximal_kl"], [0], study.CRITERIA,
                     {"proximal_kl": {0: [{"step": i, "pkl/cost_clip_frac": x, "is/log_dev": x}
                                          for i, x in enumerate(clip)]}}, {"proximal_kl": 4})
    got = mechanism_means(cmp)["proximal_kl"]
    assert got["pkl/cost_clip_frac"] == [pytest.approx(np.mean(clip))]
    assert got["pkl/cost_clip_frac" + LATER] == [pytest.approx(3.3 / 6)]
    assert study.later_minibatches(np.mean(clip), 4) == pytest.approx(3.3 / 6)
    assert "is/log_dev" + LATER not in got  # not a function of the proximal ratio
    setting = study.FAMILIES["pkl"].settings[0]
    logged = {"mechanisms": {"proximal_kl": {"pkl/cost_clip_frac": [0.3, 0.45]},
                             "grpo": {"clip/frac": [0.03], "clip/frac" + LATER: [0.05]}}}
    rows = dict(study.mechanism_rows(logged, setting, ("pkl/cost_clip_frac", "clip/frac")))
    assert rows["pkl/cost_clip_frac" + LATER + "*"][2] == pytest.approx(0.5)  # 0.375 * 4 / 3
    assert rows["clip/frac" + LATER][1] == 0.05  # logged: used as it is, not derived


def test_run_records_hold_the_environment(tmp_path):
    from megapkl.analysis.compare import Arm

    version = study.code_version()
    study.record(tmp_path / "runs.json", version, Arm("grpo", 3, [], tmp_path), 12.34)
    rec = json.loads((tmp_path / "runs.json").read_text())["grpo/seed-3"]
    assert rec["wall_s"] == 12.3 and len(rec["commit"]) == 40
    env = rec["environment"]
    assert env["packages"]["torch"] and env["torch"]["version"].startswith(env["packages"]["torch"])
    assert set(env["packages"]) >= {"numpy", "megatron-core", "transformers", "scipy"}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_the_reported_numbers_are_recomputed_from_the_committed_summaries(capsys):
    """Every declared test, descriptive difference and per-method summary that `analyze` computes
    from the committed per-seed JSON (docs/study-cpu/) stands in docs/study-cpu.md with the same
    effect, interval and Holm p, and each family's section states the same verdict."""
    docs = ROOT / "docs" / "study-cpu"
    study.analyze(docs, None)
    printed = capsys.readouterr().out
    text = (ROOT / "docs" / "study-cpu.md").read_text()
    checked = 0
    for key, fam in study.FAMILIES.items():
        if not fam.tests or not all((docs / f"{s.name}.json").exists() for s in fam.settings):
            continue
        part = printed[printed.index(f"### {key}:"):]
        part = part[:part.index("\n### ")] if "\n### " in part else part
        section = text[text.index(f"### {key.upper()} family"):]
        section = section[:section.index("\n### ")] if "\n### " in section else section
        rows = [_cells(ln) for ln in section.splitlines() if ln.startswith("| ")]
        methods = [study.label(m) for m in fam.settings[0].methods]
        final = False  # the post-hoc final-value tables: held by test_both_summaries_table
        for ln in part.splitlines():
            c = _cells(ln)
            if not ln.startswith("|"):
                final = ln.startswith("The same tests on the final value") or (final and not ln)
                continue
            if final:
                continue
            if ln.startswith("| ") and c[0] in methods:  # a method's summary
                assert any(r[0] == c[0] and c[1] in r for r in rows), (key, ln)
                checked += 1
            elif ln.startswith("| ") and " at " in c[0]:  # effect, t interval, Holm p
                assert any(c[1] in r and c[2] in r and c[5] in r for r in rows), (key, ln)
                checked += 1
            elif ln.startswith("| ") and "/" in c[0]:  # a mechanism metric: the whole row
                assert c in rows, (key, ln)
                checked += 1
        for start, where in (("**Verdict: ", "**Verdict on \""),
                             ("**Verdict on the added claim: ", "**Verdict on the added claim")):
            if start not in part:
                continue
            said = part[part.index(start) + len(start):].split(":")[0]  # e.g. "not resolved"
            how_many = re.search(r"(\d+ of \d+)", part[part.index(start):].splitlines()[0])
            verdict_line = " ".join(section[section.index(where):][:200].split())
            assert said in verdict_line and (how_many is None or how_many.group(1) in verdict_line), \
                (key, said, verdict_line)
    # method rows 8 + 8 + 4, declared tests 4 + 2 + 3, added 4 (PKL), descriptive 8 + 2,
    # mechanism rows 14 + 14 (PKL), 4 + 6 (SIS), 5 (TETPO)
    assert checked == 20 + 9 + 4 + 10 + 43


def _interval(cell: str) -> str:
    lo, hi = (float(x) for x in cell.strip("[]").split(","))
    return f"[{lo:.3f}, {hi:.3f}]"


def test_the_follow_up_results_are_recomputed_from_the_committed_summaries(capsys):
    """Every declared test of the follow-up that `analyze` computes from the committed per-seed
    JSON stands in docs/study-cpu.md's "Follow-up results" with its effect, 95% t interval and
    Holm p, at the three decimals the doc writes."""
    docs = ROOT / "docs" / "study-cpu"
    study.analyze(docs, None)
    printed = capsys.readouterr().out
    text = (ROOT / "docs" / "study-cpu.md").read_text()
    rows = [_cells(ln) for ln in text[text.index("## Follow-up results"):].splitlines()
            if ln.startswith("| ")]
    checked, declared = 0, False
    for ln in printed.splitlines():
        if ln.startswith("Declared before the runs"):
            declared = True
        elif ln.startswith(("**Verdict", "### ", "The same tests on the final value")):
            declared = False
        elif declared and ln.startswith("| ") and " at " in ln:
            c = _cells(ln)
            effect, interval, holm = f"{abs(float(c[1])):.3f}", _interval(c[2]), c[5]
            assert any(any(interval in x for x in r) and any(effect in x for x in r)
                       and any(x.strip("*") == holm for x in r) for r in rows), ln
            checked += 1
    assert checked == 6 + 6 + 1 + 1  # PKL level and degradation, SIS at N = 4, TETPO


def test_the_reported_aggregates_are_recomputed_from_the_committed_summaries():
    """The IQM and probability-of-improvement table of docs/study-cpu.md matches the committed JSON."""
    text = (ROOT / "docs" / "study-cpu.md").read_text()
    table = text[text.index("### Aggregates"):text.index("## Wall time")]
    rows = [_cells(ln) for ln in table.splitlines() if " at " in ln and ln.startswith("| ")]
    assert len(rows) == 15
    for name, iqm_a, iqm_b, prob in rows:
        pair, setting = name.split(" at ")
        a, b = pair.split(" - ")
        m = json.loads((ROOT / "docs" / "study-cpu" / f"{setting}.json").read_text())
        m = m["summary"]["metrics"][study.PRIMARY]
        assert f"{m['methods'][a]['auc']['iqm']:.3g}" == iqm_a, name
        assert f"{m['methods'][b]['auc']['iqm']:.3g}" == iqm_b, name
        ab = [q["prob_improvement"] for q in m["pairs"]["auc"] if (q["a"], q["b"]) == (a, b)]
        ba = [1 - q["prob_improvement"] for q in m["pairs"]["auc"] if (q["a"], q["b"]) == (b, a)]
        assert f"{(ab + ba)[0]:.2f}" == prob, name


def test_both_summaries_table_and_the_noise_floor_are_in_the_doc(capsys):
    """docs/study-cpu.md carries `analyze`'s table of every test a verdict rests on, on the mean
    over the run and on the final value (labelled post hoc), and its noise-floor table, row for
    row as computed from the committed per-seed JSON."""
    docs = ROOT / "docs" / "study-cpu"
    study.analyze(docs, None)
    printed = capsys.readouterr().out
    text = (ROOT / "docs" / "study-cpu.md").read_text()
    for head in ("### Noise floor", "### Every test of a verdict"):
        part = printed[printed.index(head):]
        part = part[:part.index("\n### ", 1)]
        rows = [ln for ln in part.splitlines() if ln.startswith("| ")]
        assert len(rows) > 4 and all(ln in text for ln in rows), \
            [ln for ln in rows if ln not in text][:3]
    assert "final value (post hoc)" in text
    summaries = study.load_summaries(docs, None)
    lines = study.both_table(summaries, study.noise_floor(summaries))
    tests = sum(len(f.tests) + sum(len(c.tests) for c in f.added + f.declared)
                for f in study.FAMILIES.values())
    assert len(lines) == 2 + tests == 2 + 9 + 4 + 14


def test_the_floor_is_read_beside_every_effect():
    """The floor of an effect is sqrt(2) (a difference) or 2 (a difference in differences) times
    one arm's, and an effect is read only outside both its interval's 0 and the floor."""
    pairs = ((("a", "x"), ("b", "x")),)
    summaries = {s: _summary({"x": v}) for s, v in (("a", [0.5, 0.6, 0.4, 0.3]),
                                                    ("b", [0.45, 0.62, 0.41, 0.25]))}
    for s in summaries.values():
        s["metrics"][study.PRIMARY]["methods"]["x"]["seeds"] = s["seeds"]
        s["metrics"][study.PRIMARY]["methods"]["x"]["final"] = {"values": [0.0] * 4}
    f = study.floor_stats(summaries, pairs, n=10)["auc"]
    d = [0.05, -0.02, -0.01, 0.05]
    assert f["pairs"] == 4 and f["per_seed"] == pytest.approx(0.05)
    assert f["arm"] == pytest.approx(1.96 * np.std(d, ddof=1) / np.sqrt(10))
    floor = {"auc": f}
    diff, did = study.Test("p", "q", "s"), study.Test("p", "q", "s", lo="t")
    assert study.floor_of(diff, floor, "auc") == pytest.approx(f["arm"] * np.sqrt(2))
    assert study.floor_of(did, floor, "auc") == pytest.approx(f["arm"] * 2)
    big = st.paired_t([1.0, 1.1, 1.2, 1.05], [0.0, 0.1, 0.05, 0.0])
    small = st.paired_t([0.01, 0.012, 0.011, 0.013], [0.0, 0.001, 0.0, 0.002])
    assert study.reading(big, 0.1) == "read" and study.reading(small, 0.1) == "below the floor"
    assert study.reading(st.paired_t([0.1, -0.1, 0.2, -0.2], [0, 0, 0, 0]), 0.1) == "interval holds 0"


def test_a_block_whose_code_changed_stops_before_its_next_run(tmp_path):
    """Each run is recorded with the commit read at its own start; when that is not the code the
    block's process imported, the block stops before training anything."""
    from megapkl.analysis.compare import Arm

    then = {"commit": "0" * 40, "local_changes": False}
    arm = Arm("grpo", 0, [], tmp_path / "grpo" / "seed-0")
    with pytest.raises(SystemExit, match="the code changed during this block"):
        study.one_by_one(tmp_path / "runs.json", then, study.BASE, [arm])
    assert not (tmp_path / "runs.json").exists() and not arm.run_dir.exists()
