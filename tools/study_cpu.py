"""The CPU-scale study of docs/study-cpu.md: run it (in parts), then state each claim's verdict.

    python tools/study_cpu.py run OUT [--family pilot,pkl,sis,tetpo] [--seeds 0-9]
    python tools/study_cpu.py run OUT --family clip_pilot --seeds 100-101   # the follow-up's pilot
    python tools/study_cpu.py run OUT --family clip,sis_full,tetpo_lr --seeds 0-9  # the follow-up
    python tools/study_cpu.py run OUT --family floor --seeds 0-9      # the noise floor's re-run
    python tools/study_cpu.py analyze OUT [--docs docs/study-cpu]      # tables and verdicts
    python tools/study_cpu.py analyze docs/study-cpu                   # the same from the copies
    python tools/study_cpu.py analyze docs/study-cpu --docs docs/study-cpu  # and refresh them

`run` trains every setting of the chosen families through `megapkl compare` (arms are exactly their
presets on configs/study/repeat_next.yaml, plus the family's declared overrides), one run after
another. A run whose metrics.jsonl already holds its last update is kept, so the study can be run
in several parts and resumes where it stopped; each run's code version (git commit, and whether
the tracked tree had local changes), environment (megapkl.analysis.environment) and wall time go
to OUT/<setting>/runs.json. `analyze` reads each setting's finished runs (recomputing its
summary.json, the per-seed values), copies that with runs.json to --docs/<setting>.json with the
primary curve as <setting>.png. Given that folder instead it analyses the copies alone, without
training: the statistics derived from the per-seed values (Kaplan-Meier medians) are recomputed
with this code, and written back with --docs; per-seed values are never changed. It prints the
declared tests (paired differences and difference-in-differences by seed, paired t with Holm's
adjustment within each family) and the verdict of each claim, the claims added after the results
with theirs, the descriptive tests (one Holm family per setting) and the mechanism metrics.

Every test is also printed on the final value (post hoc: no final-value test was declared), and
every effect beside the noise floor (docs/study-cpu.md, "Noise floor": the family `floor` runs
clip_k16's GRPO and no-clip arms again, and re-run minus committed per seed sets the floor) with
the reading it allows. Each run's record holds the commit read at that run's start.

The follow-up (docs/study-cpu.md, "Follow-up") adds the families clip_pilot, clip, sis_full and
tetpo_lr: its claims are declared before its runs (`Family.declared`), and it averages metrics
that `megapkl compare` does not summarise (`Family.diagnostics`) from each run's metrics.jsonl.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megapkl.analysis import compare_stats as st  # noqa: E402
from megapkl.analysis.compare import (LATER, PROXIMAL_METRICS, Arm, Criteria,  # noqa: E402
                                      compare, fmt_p, run_local, _fmt)

BASE = str(ROOT / "configs" / "study" / "repeat_next.yaml")
PKL_H4 = str(ROOT / "configs" / "study" / "proximal_kl_h4.yaml")
PRIMARY = "eval/micro_avg/accuracy"
SUMMARY = "auc"           # the declared summary of a curve: its mean over the evaluations
CRITERIA = Criteria(metric=PRIMARY)


@dataclass(frozen=True)
class Setting:
    name: str
    methods: tuple[str, ...]
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Test:
    """One declared comparison: a - b in `setting`, or with `lo` set the difference in differences
    (a - b in setting) - (a - b in lo), per seed."""

    a: str
    b: str
    setting: str
    lo: Optional[str] = None

    def label(self) -> str:
        if self.lo is None:
            return f"{self.a} - {self.b} at {self.setting}"
        return f"({self.a} - {self.b}) at {self.setting} minus at {self.lo}"


@dataclass(frozen=True)
class Claim:
    """A claim with its own Holm family and a verdict by the declared rule: added after the
    study's results were seen (`Family.added`, reported as such) or declared before the runs
    (`Family.declared`, the follow-up). With `per_arm` the family is adjusted as a whole and a
    verdict is stated for each arm `a` from its own tests (one claim per cost clip, say)."""

    claim: str
    tests: tuple[Test, ...]
    why: str                                # why it was added, or what it tests
    per_arm: bool = False
    two_sided: bool = False                 # no direction claimed: report either way


@dataclass(frozen=True)
class Family:
    claim: str
    settings: tuple[Setting, ...]
    tests: tuple[Test, ...] = ()            # Holm-adjusted together; all > 0 supports the claim
    described: tuple[Test, ...] = field(default=())  # one Holm family per setting, descriptive
    added: tuple[Claim, ...] = ()           # declared after the results (see Claim)
    mechanisms: tuple[str, ...] = ()        # the mechanism metrics its report shows
    declared: tuple[Claim, ...] = ()        # the follow-up: declared before its runs
    diagnostics: tuple[str, ...] = ()       # averaged here from metrics.jsonl (see diagnostic_means)
    windows: bool = False                   # diagnostics before / after each run's peak (TETPO)


def _per(name: str, methods, *over) -> Setting:
    return Setting(name, tuple(methods), tuple(over))


PKL_ARMS = ("pg", "grpo", "proximal_kl", PKL_H4)
PKL_X = ("proximal_kl", "proximal_kl_h4")    # the Proximal KL arms the PKL tests compare
# TETPO App. B protocol, scaled: a lag drawn from U{1..16} per prompt group, weights against the
# sampler, mean-centred advantages, one update per batch of 32 x 8
UNIFORM16 = ("rollout.protocol=uniform_stale", "rollout.max_staleness=16", "rollout.snapshot_pool=32",
             "reference.mode=behavior", "advantage.mode=group_mean", "rollout.minibatches_per_batch=1",
             "parallel.micro_batch_size=128", "train.steps=200")
SIS_ARMS = ("grpo", "sis_grpo", "gspo", "sis_gspo")
FAMILIES = {
    "pilot": Family("the task is learned on-policy", (
        _per("pilot_onpolicy", ["grpo"], "rollout.protocol=on_policy", "rollout.max_staleness=null",
             "rollout.minibatches_per_batch=1", "parallel.micro_batch_size=128", "train.steps=150"),
        # the most off-policy setting of the study still learns within its budget
        _per("pilot_k16", ["grpo"], "rollout.max_staleness=16", "train.steps=400"),
        _per("pilot_u16", ["grpo"], *UNIFORM16))),
    "pkl": Family("Proximal KL degrades less than GRPO and PG as staleness grows (k 4 -> 16)", (
        _per("pkl_k4", PKL_ARMS, "rollout.max_staleness=4"),
        _per("pkl_k16", PKL_ARMS, "rollout.max_staleness=16")),
        tests=tuple(Test(a, b, "pkl_k16", "pkl_k4") for a in PKL_X for b in ("grpo", "pg")),
        described=tuple(Test(a, b, s) for s in ("pkl_k4", "pkl_k16")
                        for a in PKL_X for b in ("grpo", "pg")),
        added=(Claim("Proximal KL scores above GRPO in every matched off-policy setting (k 4, 16)",
                     tuple(Test(a, "grpo", s) for s in ("pkl_k4", "pkl_k16") for a in PKL_X),
                     "the paper's level claim, missing from the declared tests"),),
        mechanisms=("pkl/credit_p10", "pkl/credit_p50", "pkl/credit_p90", "pkl/adv_abs_mean",
                    "pkl/cost_clip_frac", "clip/frac", "is/log_dev", "kl/prox_k3")),
    "sis": Family("SIS helps token-IS objectives as minibatches per rollout grow (N 1 -> 4)", (
        # same rollout budget (100 batches of 32 x 8): N = 1 is 100 updates, N = 4 is 400;
        # KL to the initial model off in every arm (sis_grpo's preset has 1e-3, the others 0)
        _per("sis_n1", SIS_ARMS, "rollout.max_staleness=0", "rollout.minibatches_per_batch=1",
             "parallel.micro_batch_size=128", "train.steps=100", "eval.every=5",
             "objective.kl_init_coef=0.0"),
        _per("sis_n4", SIS_ARMS, "rollout.max_staleness=0", "eval.every=20",
             "objective.kl_init_coef=0.0")),
        # SIS - no SIS at N = 4; the N = 1 control is descriptive. Its difference in differences
        # (N = 4 minus N = 1) is not a test of its own: at N = 1 SIS is the identity (w = 1), so
        # it repeats the N = 4 test and would only double Holm's m.
        tests=(Test("sis_grpo", "grpo", "sis_n4"), Test("sis_gspo", "gspo", "sis_n4")),
        described=(Test("sis_grpo", "grpo", "sis_n1"), Test("sis_gspo", "gspo", "sis_n1")),
        mechanisms=("sis/accept_rate", "clip/frac", "is/log_dev", "kl/prox_k3")),
    "tetpo": Family("TETPO beats GEPO, M2PO and GRPO under uniform staleness U{1..16}", (
        _per("tetpo_u16", ("tetpo", "gepo", "m2po", "grpo"), *UNIFORM16),),
        tests=tuple(Test("tetpo", b, "tetpo_u16") for b in ("gepo", "m2po", "grpo")),
        mechanisms=("tetpo/tempered_frac", "tetpo/alpha_mean", "clip/frac", "m2po/mask_frac",
                    "is/log_dev", "kl/prox_k3")),
}

# ---------------------------------------------------------------- the follow-up (declared 2026-12-04)
# docs/study-cpu.md, "Follow-up": declared before any of its runs. Its settings reuse the study's
# base and overrides; only what the follow-up asks about changes.

STUDY = ROOT / "configs" / "study"
EPS_MID = str(STUDY / "proximal_kl_eps_mid.yaml")    # eps_F from the pilot (see eps_mid_choice)
EPS_NULL = str(STUDY / "proximal_kl_eps_null.yaml")  # no cost clip
TETPO_COS = str(STUDY / "tetpo_cosine.yaml")         # the TETPO paper's lr schedule
CLIP_X = ("proximal_kl", "proximal_kl_eps_mid", "proximal_kl_eps_null")  # eps_F 0.05, mid, none
# The pilot's grid of eps_F (at k = 16, where eps_F = 0.05 clipped most) and its rule: the
# smallest value whose runs clip at most CLIP_TARGET of the moving tokens (else the largest).
PILOT_EPS = (0.1, 0.2, 0.4)
CLIP_TARGET = 0.10
MOVING = "pkl/cost_clip_frac_moving"
# The SIS paper's envelope is a maximum over the whole vocabulary (its eq. 7); its top-K is a cheap
# stand-in that assumes little mass outside K (Prop. 2). The tiny model's vocabulary is 128, so
# K = 128 is the exact envelope; the study's K = 10 left 42-50% of on-policy tokens outside it.
VOCAB = 128
TETPO_DIAG = ("tetpo/alpha_mean", "tetpo/alpha_min", "tetpo/tempered_frac", "tetpo/ess_frac_before",
              "tetpo/ess_frac_after", "clip/frac", "grad_norm", "is/log_dev", "is/w_max")

FAMILIES.update({
    "clip_pilot": Family("the follow-up's pilot: how often each eps_F clips at k = 16 (sizes eps_mid)", tuple(
        _per(f"clip_pilot_e{round(e * 100):03d}", ("proximal_kl",), "rollout.max_staleness=16",
             f"objective.cost_clip={e}") for e in PILOT_EPS),
        diagnostics=(MOVING, "pkl/moving_frac", "grad_norm")),
    "clip": Family("Proximal KL's cost clip at this scale: eps_F 0.05, eps_mid, none against GRPO and PG", (
        _per("clip_k4", ("pg", "grpo", "proximal_kl", EPS_MID, EPS_NULL), "rollout.max_staleness=4"),
        _per("clip_k16", ("pg", "grpo", "proximal_kl", EPS_MID, EPS_NULL), "rollout.max_staleness=16")),
        described=tuple(Test(a, b, s) for s in ("clip_k4", "clip_k16") for a, b in (
            *((x, "pg") for x in CLIP_X), ("proximal_kl_eps_mid", "proximal_kl"),
            ("proximal_kl_eps_null", "proximal_kl"))),
        declared=(
            Claim("Proximal KL scores above GRPO in every matched off-policy setting (k 4, 16)",
                  tuple(Test(a, "grpo", s) for a in CLIP_X for s in ("clip_k4", "clip_k16")),
                  "the PKL paper's level claim, one verdict per eps_F", per_arm=True),
            Claim("Proximal KL degrades less than GRPO and PG as staleness grows (k 4 -> 16)",
                  tuple(Test(a, b, "clip_k16", "clip_k4") for a in CLIP_X for b in ("grpo", "pg")),
                  "the PKL paper's degradation claim, one verdict per eps_F", per_arm=True)),
        mechanisms=("pkl/credit_p10", "pkl/credit_p50", "pkl/credit_p90", "pkl/adv_abs_mean",
                    "pkl/cost_clip_frac", "clip/frac", "is/log_dev", "kl/prox_k3"),
        diagnostics=(MOVING, "grad_norm")),
    "sis_full": Family("SIS with its exact envelope (top-K = the whole vocabulary, 128): N 1 -> 4", (
        # the study's sis_n1 / sis_n4 with K = 128; GRPO only (the budget)
        _per("sis_full_n1", ("grpo", "sis_grpo"), "rollout.max_staleness=0",
             "rollout.minibatches_per_batch=1", "parallel.micro_batch_size=128", "train.steps=100",
             "eval.every=5", "objective.kl_init_coef=0.0", f"objective.sis.top_k={VOCAB}"),
        _per("sis_full_n4", ("grpo", "sis_grpo"), "rollout.max_staleness=0", "eval.every=20",
             "objective.kl_init_coef=0.0", f"objective.sis.top_k={VOCAB}")),
        described=(Test("sis_grpo", "grpo", "sis_full_n1"),),   # the control: 0 by construction
        declared=(Claim("SIS helps GRPO when minibatches per rollout grow (N = 4), with an envelope "
                        "that holds the behaviour policy's mass",
                        (Test("sis_grpo", "grpo", "sis_full_n4"),), "the SIS paper's claim at N = 4"),),
        mechanisms=("sis/accept_rate", "clip/frac", "is/log_dev", "kl/prox_k3"),
        diagnostics=("sis/reject_outside_topk", "sis/xi_k", "grad_norm")),
    "tetpo_lr": Family("TETPO's collapses: the study's constant lr against the paper's cosine schedule", (
        _per("tetpo_lr_u16", ("tetpo", TETPO_COS), *UNIFORM16),),
        declared=(Claim("the TETPO paper's cosine schedule changes TETPO's mean eval accuracy "
                        "(report either way; collapses are read by the declared rule)",
                        (Test("tetpo_cosine", "tetpo", "tetpo_lr_u16"),),
                        "no direction claimed: a verdict in either direction is reported",
                        two_sided=True),),
        mechanisms=("tetpo/tempered_frac", "tetpo/alpha_mean", "clip/frac", "is/log_dev"),
        diagnostics=TETPO_DIAG, windows=True),
})
FOLLOW_UP = ("clip_pilot", "clip", "sis_full", "tetpo_lr")

# ---------------------------------------------------------------- the noise floor (declared 2026-12-07)
# docs/study-cpu.md, "Noise floor": clip_k16's grpo and proximal_kl_eps_null arms, seeds 0-9, run
# again with the same configs on a later commit; per seed, re-run minus committed (REPEATS) is what
# re-executing the same config moves a run's value by, and every effect is printed beside it.
FAMILIES["floor"] = Family("the noise floor: clip_k16's grpo and no-clip arms run again", (
    _per("floor_k16", ("grpo", EPS_NULL), "rollout.max_staleness=16"),))
REPEATS = {"floor_k16": "clip_k16"}  # re-run setting -> the committed setting it repeats
FLOOR_EFFECT = ("proximal_kl_eps_null", "grpo")  # the paired effect re-estimated by the re-run


# ---------------------------------------------------------------- run

def code_version() -> dict:
    """The commit, whether the tracked tree had local changes, and the environment (package
    versions, torch build, CPU, threads): per-seed values are reproducible within one."""
    from megapkl.analysis.environment import environment

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "local_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "environment": environment()}


def record(path: Path, version: dict, arm: Arm, wall: float) -> None:
    """Add the run of `arm` to the setting's records: the code version read when it started."""
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[f"{arm.method}/seed-{arm.seed}"] = {**version, "wall_s": round(wall, 1),
                                            "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")


def one_by_one(records: Path, block: dict, config: str, arms) -> None:
    """Train `arms` one at a time, each recorded with the code version read at its own start. This
    process imported the code once, at the block's start: a commit or a tracked change made since
    stops the block (start it again), so no run is recorded with code other than the code it ran."""
    for arm in arms:
        version = code_version()
        now, then = ((v["commit"], v["local_changes"]) for v in (version, block))
        if now != then:
            raise SystemExit(f"[study] the code changed during this block (commit, local changes: "
                             f"{then} at its start, {now} now); run the block again")
        run_local(config, [arm], skip_finished=True,
                  on_done=functools.partial(record, records, version))


def run(out: Path, families: list[str], seeds: list[int]) -> None:
    if "clip" in families:
        check_eps_mid(out)
    block = code_version()  # the code this process imported
    for fam in families:
        for s in FAMILIES[fam].settings:
            where = out / s.name
            print(f"[study] {s.name}: {', '.join(map(label, s.methods))} x seeds {seeds}", flush=True)
            runner = functools.partial(one_by_one, where / "runs.json", block)
            compare(BASE, s.methods, seeds, s.overrides, out=where, criteria=CRITERIA,
                    runner=runner)
            done = finished_seeds(where, s)  # this block's seeds and every earlier block's
            if done != seeds:
                compare(BASE, s.methods, done, s.overrides, out=where, criteria=CRITERIA,
                        analyze_only=True)


def finished_seeds(where: Path, s: Setting) -> list[int]:
    """Seeds whose run of every method of `s` holds its last update."""
    from megapkl.analysis.compare import finished, plan_arms

    found = sorted({int(p.name.split("-")[1]) for p in where.glob("*/seed-*")})
    arms = plan_arms(BASE, s.methods, found, s.overrides, where)
    return [seed for seed in found if all(finished(BASE, a) for a in arms if a.seed == seed)]


# ---------------------------------------------------------------- the follow-up's own metrics

def _rows(where: Path, method: str, seed: int) -> list[dict]:
    from megapkl.train.metrics_log import read_metrics

    return read_metrics(where / label(method) / f"seed-{seed}")


def _mean(rows: list[dict], name: str) -> Optional[float]:
    """Mean of `name` over the training rows that log it; MOVING only over the updates in which
    some token moved (a minibatch trained from the reference's weights logs 0 for it)."""
    v = [r[name] for r in rows if isinstance(r.get(name), (int, float)) and "step" in r
         and (name != MOVING or r.get("pkl/moving_frac", 0) > 0)]
    return float(np.mean(v)) if v else None


def diagnostic_means(where: Path, s: Setting, names: tuple[str, ...]) -> dict:
    """method -> metric -> per-seed mean over the run's updates, for metrics `megapkl compare`
    does not summarise (a metric a method does not log is left out)."""
    out: dict = {}
    for m in s.methods:
        per = {n: [_mean(_rows(where, m, seed), n) for seed in finished_seeds(where, s)] for n in names}
        out[label(m)] = {n: v for n, v in per.items() if v and all(x is not None for x in v)}
    return out


def peak_windows(rows: list[dict], names: tuple[str, ...], before: int = 40) -> dict:
    """Where a run peaks and what the diagnostics did around it: the update at which the eval
    curve's EMA (alpha 0.2 per update, as CRITERIA) is highest, whether the run collapsed, and
    each diagnostic's mean over the `before` updates up to the peak ("rise") and after it
    ("fall")."""
    from megapkl.analysis.compare import series, smoothing

    xs, ys = series(rows, PRIMARY)
    smooth = st.ema(ys, smoothing(xs, CRITERIA.ema_alpha))
    peak = xs[int(np.argmax(smooth))]
    train = [r for r in rows if "step" in r]  # an evaluation's scalars share its update's row
    part = {"rise": [r for r in train if peak - before < r["step"] + 1 <= peak],
            "fall": [r for r in train if r["step"] + 1 > peak]}
    return {"peak": peak, "collapsed": st.collapsed(smooth, CRITERIA.collapse_drop),
            **{w: {n: _mean(rs, n) for n in names} for w, rs in part.items()}}


def collapse_windows(where: Path, s: Setting, names: tuple[str, ...]) -> dict:
    """method -> per-seed peak_windows."""
    return {label(m): [peak_windows(_rows(where, m, seed), names) for seed in finished_seeds(where, s)]
            for m in s.methods}


def pilot_fractions(out: Path) -> dict[float, float]:
    """eps_F -> the pilot's clipped fraction of moving tokens (mean over its runs), from the run
    directories under OUT or the copies (<setting>.json) there."""
    fracs = {}
    for e, s in zip(PILOT_EPS, FAMILIES["clip_pilot"].settings):
        if (out / s.name).is_dir() and len(finished_seeds(out / s.name, s)) >= 2:
            diag = diagnostic_means(out / s.name, s, (MOVING,))
        elif (out / f"{s.name}.json").exists():
            diag = json.loads((out / f"{s.name}.json").read_text())["summary"].get("diagnostics", {})
        else:
            continue
        if MOVING in diag.get("proximal_kl", {}):
            fracs[e] = float(np.mean(diag["proximal_kl"][MOVING]))
    return fracs


def eps_mid_choice(fracs: dict[float, float]) -> Optional[float]:
    """The declared rule: the smallest eps_F of the grid whose pilot runs clip at most
    CLIP_TARGET of the moving tokens, else the largest; None until every grid value has runs."""
    if set(fracs) != set(PILOT_EPS):
        return None
    return next((e for e in PILOT_EPS if fracs[e] <= CLIP_TARGET), PILOT_EPS[-1])


def check_eps_mid(out: Path) -> None:
    """The clip family runs only with the eps_F the pilot chose in configs/study/."""
    fracs = pilot_fractions(out)
    choice = eps_mid_choice(fracs)
    have = arm_configs(FAMILIES["clip"].settings[0])["proximal_kl_eps_mid"].objective.cost_clip
    if choice is None:
        raise SystemExit(f"[study] the clip family needs the pilot first: run --family clip_pilot "
                         f"--seeds 100-101 into {out} (have eps_F {sorted(fracs)} of {PILOT_EPS})")
    if have != choice:
        raise SystemExit(f"[study] the pilot chose eps_F = {choice} (clipped fraction of moving "
                         f"tokens {fracs}); set objective.cost_clip: {choice} in {EPS_MID} and "
                         f"commit it before the clip family runs (it holds {have})")


# ---------------------------------------------------------------- analyze

def label(method: str) -> str:
    return Path(method).stem


@functools.lru_cache(maxsize=None)
def arm_configs(s: Setting) -> dict:
    """Method label -> its arm's resolved run config in setting `s` (as `run` trains it)."""
    import tempfile

    from megapkl.analysis.compare import plan_arms
    from megapkl.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        return {a.method: load_config(BASE, a.overrides)
                for a in plan_arms(BASE, s.methods, [0], s.overrides, Path(tmp))}


def values(summaries: dict, setting: str, method: str, key: str = SUMMARY) -> list[float]:
    return summaries[setting]["metrics"][PRIMARY]["methods"][method][key]["values"]


def run_test(summaries: dict, t: Test, key: str = SUMMARY) -> st.PairedTest:
    v = functools.partial(values, summaries, key=key)
    if t.lo is None:
        return st.paired_t(v(t.setting, t.a), v(t.setting, t.b))
    return st.diff_in_diff(v(t.setting, t.a), v(t.lo, t.a), v(t.setting, t.b), v(t.lo, t.b))


KEYS = {"auc": "mean over the run", "final": "final value"}  # the summaries a test reads


def floor_of(t: Test, floor: Optional[dict], key: str) -> Optional[float]:
    """The noise floor of test `t`'s effect on summary `key` (see noise_floor): a difference of two
    arms, or with `lo` a difference in differences of four, each arm re-run independently."""
    if not floor or key not in floor:
        return None
    return floor[key]["arm"] * (2.0 if t.lo else math.sqrt(2.0))


def reading(r: st.PairedTest, fl: Optional[float]) -> str:
    """How the page may read an effect (the declared rule, "Noise floor")."""
    if r.low <= 0 <= r.high:
        return "interval holds 0"
    if fl is None:
        return "no floor measured"
    return "read" if abs(r.diff) > fl else "below the floor"


def test_lines(summaries: dict, tests: tuple[Test, ...], key: str = SUMMARY,
               floor: Optional[dict] = None) -> tuple[list[str], list[tuple]]:
    """The table of `tests` on summary `key`, Holm-adjusted as one family, each effect beside its
    noise floor, and (test, result, Holm p) of each."""
    done = [(t, run_test(summaries, t, key)) for t in tests
            if all(s in summaries for s in (t.setting, t.lo) if s)]
    adjusted = st.holm([r.p for _, r in done]) if done else []
    lines = ["| comparison | effect | 95% t interval | d_z | p | Holm p | BCa interval | n | "
             "noise floor | reading |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (t, r), p in zip(done, adjusted):
        fl = floor_of(t, floor, key)
        lines.append(f"| {t.label()} | {_fmt(r.diff)} | [{_fmt(r.low)}, {_fmt(r.high)}] | "
                     f"{_fmt(r.effect)} | {fmt_p(r.p)} | {fmt_p(p)} | [{_fmt(r.boot_low)}, "
                     f"{_fmt(r.boot_high)}] | {r.n} | {_fmt(fl)} | {reading(r, fl)} |")
    return lines, [(t, r, p) for (t, r), p in zip(done, adjusted)]


# ---------------------------------------------------------------- the noise floor

Pair = tuple[tuple[str, str], tuple[str, str]]  # ((setting, method), (setting, method)), per seed
POST_HOC_FLOORS = {  # the same config on two commits; SIS at N = 1, the identity up to rounding
    "the same configs on two commits (post hoc)": tuple(
        ((f"clip_k{k}", m), (f"pkl_k{k}", m)) for k in (4, 16) for m in ("pg", "grpo", "proximal_kl")),
    "SIS at N = 1 against GRPO (post hoc)": tuple(
        ((s, "sis_grpo"), (s, "grpo")) for s in ("sis_n1", "sis_full_n1")),
}


def pair_deltas(summaries: dict, pair: Pair, key: str) -> list[float]:
    """Per seed (the seeds both hold), the first's value minus the second's."""
    (sa, ma), (sb, mb) = pair
    if sa not in summaries or sb not in summaries:
        return []
    block = lambda s, m: summaries[s]["metrics"][PRIMARY]["methods"][m]  # noqa: E731
    a = dict(zip(block(sa, ma)["seeds"], block(sa, ma)[key]["values"]))
    b = dict(zip(block(sb, mb)["seeds"], block(sb, mb)[key]["values"]))
    return [a[seed] - b[seed] for seed in sorted(set(a) & set(b))]


def floor_stats(summaries: dict, pairs: tuple[Pair, ...], n: int = 10) -> dict:
    """key -> the floor measured by `pairs` (Delta: one run minus the other, per seed): the
    per-seed floor max |Delta|, and `arm` = 1.96 sd(Delta) / sqrt(n), how far the mean of one arm
    over n seeds moves when it is run again (an effect of two arms: sqrt(2) times it; a
    difference in differences of four: 2 times it)."""
    out = {}
    for key in KEYS:
        d = [x for pair in pairs for x in pair_deltas(summaries, pair, key)]
        if len(d) < 2:
            continue
        sd = float(np.std(d, ddof=1))
        arm = 1.96 * sd / math.sqrt(n)
        out[key] = {"pairs": len(d), "per_seed": float(np.max(np.abs(d))),
                    "mean_abs": float(np.mean(np.abs(d))), "sd": sd, "arm": arm,
                    "effect": arm * math.sqrt(2.0), "did": arm * 2.0}
    return out


def noise_floor(summaries: dict) -> dict:
    """The declared floor: each re-run setting (REPEATS) against the committed one, arm by arm."""
    pairs = tuple(((rerun, label(m)), (committed, label(m)))
                  for rerun, committed in REPEATS.items()
                  for m in next(s for f in FAMILIES.values() for s in f.settings
                                if s.name == rerun).methods)
    return floor_stats(summaries, pairs)


def floor_lines(summaries: dict, floor: dict) -> list[str]:
    rows = [("declared re-run: clip_k16's grpo and proximal_kl_eps_null (floor_k16)", floor)]
    rows += [(what, floor_stats(summaries, pairs)) for what, pairs in POST_HOC_FLOORS.items()]
    lines = ["| measured by | summary | pairs | per-seed floor (max abs) | mean abs | "
             "floor of an effect | of a difference in differences |", "|---|---|---|---|---|---|---|"]
    for what, f in rows:
        for key, name in KEYS.items():
            if key in f:
                x = f[key]
                lines.append(f"| {what} | {name} | {x['pairs']} | {_fmt(x['per_seed'])} | "
                             f"{_fmt(x['mean_abs'])} | {_fmt(x['effect'])} | {_fmt(x['did'])} |")
    if floor:
        a, b = FLOOR_EFFECT
        moved = {key: [x - y for x, y in zip(
            pair_deltas(summaries, (("floor_k16", a), ("clip_k16", a)), key),
            pair_deltas(summaries, (("floor_k16", b), ("clip_k16", b)), key))] for key in KEYS}
        lines += ["", f"Re-running both arms moved the effect {a} - {b} at k = 16 by "
                  + " and ".join(f"{_fmt(float(np.mean(v)))} ({KEYS[k]})" for k, v in moved.items()
                                 if v) + "."]
    return lines


def run_commits(out: Path, setting: str) -> dict[str, int]:
    """commit (short, '+' with local changes) -> runs, from each run's own record."""
    path = out / setting / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else \
        json.loads((out / f"{setting}.json").read_text()).get("runs", {}) \
        if (out / f"{setting}.json").exists() else {}
    commits: dict[str, int] = {}
    for r in runs.values():
        c = r.get("commit", "?")[:7] + ("+" if r.get("local_changes") else "")
        commits[c] = commits.get(c, 0) + 1
    return commits


def both_table(summaries: dict, floor: dict) -> list[str]:
    """Every test a verdict rests on, on the mean over the run (the declared summary) and on the
    final value (post hoc: no final-value test was declared), each Holm-adjusted within its own
    family and read against the noise floor."""
    groups = []
    for fam in FAMILIES.values():
        if fam.tests:
            groups.append(("declared", fam.tests))
        groups += [("added after the results", c.tests) for c in fam.added]
        groups += [("declared before the runs", c.tests) for c in fam.declared]
    lines = ["| test | declared as | mean over the run: effect [95% t] | Holm p | reading | "
             "final value (post hoc): effect [95% t] | Holm p | reading |",
             "|---|---|---|---|---|---|---|---|"]
    for how, tests in groups:
        per = {key: test_lines(summaries, tests, key, floor)[1] for key in KEYS}
        for (t, r, p), (_, f, q) in zip(per["auc"], per["final"]):
            lines.append(f"| {t.label()} | {how} | {_fmt(r.diff)} [{_fmt(r.low)}, {_fmt(r.high)}] | "
                         f"{fmt_p(p)} | {reading(r, floor_of(t, floor, 'auc'))} | {_fmt(f.diff)} "
                         f"[{_fmt(f.low)}, {_fmt(f.high)}] | {fmt_p(q)} | "
                         f"{reading(f, floor_of(t, floor, 'final'))} |")
    return lines


def per_setting(tests: tuple[Test, ...]) -> dict[str, tuple[Test, ...]]:
    """The descriptive tests grouped by setting: one Holm family each."""
    out: dict[str, tuple[Test, ...]] = {}
    for t in tests:
        out[t.setting] = out.get(t.setting, ()) + (t,)
    return out


def verdict(results: list[tuple], expected: int) -> str:
    if len(results) < expected:
        return f"not yet measured ({len(results)} of {expected} tests have data)"
    up = [r.diff > 0 and p <= 0.05 for _, r, p in results]
    down = [r.diff < 0 and p <= 0.05 for _, r, p in results]
    if all(up):
        return "supported: every declared test resolved in the claimed direction"
    if any(down):
        return "contradicted: a declared test resolved against the claim"
    return f"not resolved: {sum(up)} of {len(up)} tests resolved in the claimed direction"


def claim_verdicts(c: Claim, results: list[tuple]) -> list[str]:
    """The verdict of a claim (its tests one Holm family): one line, or with `per_arm` one per
    arm a from the Holm p of its own tests; two-sided claims say which way a test resolved."""
    def one(res: list[tuple], expected: int) -> str:
        if not c.two_sided or len(res) < expected:
            return verdict(res, expected)
        hit = [(t, r) for t, r, p in res if p <= 0.05]
        if not hit:
            return "not resolved: no test resolved in either direction"
        return "resolved: " + "; ".join(f"{t.a} {'above' if r.diff > 0 else 'below'} {t.b}"
                                        for t, r in hit)

    if not c.per_arm:
        return [one(results, len(c.tests))]
    arms = list(dict.fromkeys(t.a for t in c.tests))
    return [f"{a}: " + one([x for x in results if x[0].a == a], sum(t.a == a for t in c.tests))
            for a in arms]


def diagnostics_table(summary: dict, s: Setting) -> list[str]:
    """The follow-up's diagnostics (mean over each run's updates, mean over seeds)."""
    diag, methods = summary.get("diagnostics", {}), [label(m) for m in s.methods]
    names = list(dict.fromkeys(n for m in methods for n in diag.get(m, {})))
    if not names:
        return []
    lines = [f"Diagnostics at {s.name} (mean over each run's updates, mean over seeds; "
             f"{MOVING} over the updates in which tokens moved):", "",
             "| metric | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for n in names:
        cells = [float(np.mean(diag[m][n])) if n in diag.get(m, {}) else None for m in methods]
        lines.append(f"| {n} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines + [""]


def windows_table(summary: dict, s: Setting, names: tuple[str, ...]) -> list[str]:
    """Per method, collapsed runs and the others: each diagnostic's mean over the 40 updates up
    to the run's peak (rise) and after it (fall), mean over the runs of the group."""
    win = summary.get("windows", {})
    if not win:
        return []
    lines = [f"Before and after each run's peak at {s.name} (peak: the update where the EMA of "
             f"{PRIMARY} is highest; rise: the 40 updates up to it, fall: the updates after it):",
             "", "| method | runs | peak (median) | metric | rise | fall |", "|---|---|---|---|---|---|"]
    for m, runs in win.items():
        for collapsed in (True, False):
            group = [r for r in runs if r["collapsed"] == collapsed]
            if not group:
                continue
            what = f"{'collapsed' if collapsed else 'not collapsed'}, {len(group)} of {len(runs)}"
            peak = float(np.median([r["peak"] for r in group]))
            for n in names:
                cell = {w: [r[w][n] for r in group if r[w].get(n) is not None] for w in ("rise", "fall")}
                if not cell["rise"] and not cell["fall"]:
                    continue
                lines.append(f"| {m} | {what} | {_fmt(peak)} | {n} | "
                             + " | ".join(_fmt(float(np.mean(v))) if v else "-"
                                          for v in cell.values()) + " |")
    return lines + [""]


def method_table(summaries: dict, setting: str) -> list[str]:
    block = summaries[setting]["metrics"][PRIMARY]["methods"]
    lines = [f"**{setting}** (n = {len(summaries[setting]['seeds'])} seeds)", "",
             "| method | mean eval accuracy over the run | final | reached 0.9 | KM median updates "
             "| collapsed |",
             "|---|---|---|---|---|---|"]
    for m, t in block.items():
        a, f, r = t["auc"], t["final"], t["updates_to_threshold"]
        lines.append(f"| {m} | {_fmt(a['mean'])} [{_fmt(a['low'])}, {_fmt(a['high'])}] | "
                     f"{_fmt(f['mean'])} [{_fmt(f['low'])}, {_fmt(f['high'])}] | "
                     f"{r['reached']} of {r['n']} | {_fmt(r['median'])} | "
                     f"{t['collapsed']['count']} of {r['n']} |")
    return lines + [""]


def later_minibatches(mean_all: float, minibatches: int) -> float:
    """A proximal metric's mean over the updates after each batch's first minibatch, from its
    mean over all updates: the first of every M is 0 by construction (a per-batch reference is
    the weights the first minibatch trains from), so that mean is M / (M - 1) times the whole."""
    return mean_all * minibatches / (minibatches - 1)


def mechanism_rows(summary: dict, s: Setting, names: tuple[str, ...]) -> list[tuple[str, list]]:
    """(row label, per-method mean over seeds or None) for each of `names`, and NAME + LATER
    where the setting recomputes its reference per batch: logged (runs analysed by this code)
    or derived from the logged mean (`later_minibatches`; label marked *)."""
    mech, cfgs = summary.get("mechanisms", {}), arm_configs(s)
    methods = [label(m) for m in s.methods]
    mean = lambda m, k: float(np.mean(mech[m][k])) if k in mech.get(m, {}) else None  # noqa: E731
    split = {m: cfgs[m].rollout.minibatches_per_batch for m in methods
             if cfgs[m].reference.mode == "per_batch" and cfgs[m].rollout.minibatches_per_batch > 1}
    rows = []
    for name in names:
        rows.append((name, [mean(m, name) for m in methods]))
        if name not in PROXIMAL_METRICS or not split:
            continue
        derived, cells = False, []
        for m in methods:
            v = mean(m, name + LATER)
            if v is None and m in split and mean(m, name) is not None:
                v, derived = later_minibatches(mean(m, name), split[m]), True
            cells.append(v)
        rows.append((name + LATER + ("*" if derived else ""), cells))
    return rows


def mechanism_table(summaries: dict, s: Setting, names: tuple[str, ...]) -> list[str]:
    methods = [label(m) for m in s.methods]
    lines = [f"Mechanism metrics at {s.name} (mean over each run's updates, mean over seeds; "
             f"{LATER}: the updates after each batch's first minibatch; * derived from the logged "
             f"mean as M / (M - 1) times it, M minibatches per batch):", "",
             "| metric | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    missing = []
    for name, cells in mechanism_rows(summaries[s.name], s, names):
        if all(c is None for c in cells):
            missing.append(name)
            continue
        lines.append(f"| {name} | " + " | ".join(_fmt(c) for c in cells) + " |")
    if missing:
        lines += ["", f"Not in these summaries: {', '.join(missing)} (analysed before the study "
                      f"reported it; `analyze` on the run directories adds it)."]
    return lines + [""]


def refresh_reach(summary: dict, s: Setting) -> dict:
    """The summary with each method's Kaplan-Meier median recomputed by this code from its
    per-seed updates-to-threshold (censored at the run length), the per-seed values untouched."""
    cfgs = arm_configs(s)
    for block in summary["metrics"].values():
        for m, table in block["methods"].items():
            r = table["updates_to_threshold"]
            lengths = [float(cfgs[m].train.steps)] * len(r["values"])
            r.update(st.reach_summary(r["values"], lengths))
    return summary


def load_summaries(out: Path, docs: Optional[Path]) -> dict:
    """setting -> summary: recomputed from OUT's finished runs (copied to `docs` with the run
    records and the curve), or read from OUT's copies (<setting>.json) with the derived
    statistics refreshed (rewritten when `docs` is given)."""
    summaries = {}
    for fam in FAMILIES.values():
        for s in fam.settings:
            path = out / s.name / "summary.json"
            done = finished_seeds(out / s.name, s) if (out / s.name).is_dir() else []
            if len(done) >= 2:  # recompute from the runs with this code's analysis
                compare(BASE, s.methods, done, s.overrides, out=out / s.name, criteria=CRITERIA,
                        analyze_only=True)
            if path.exists():
                summaries[s.name] = json.loads(path.read_text())
                if len(done) >= 2 and fam.diagnostics:  # the follow-up's own means, from the runs
                    summaries[s.name]["diagnostics"] = diagnostic_means(out / s.name, s,
                                                                        fam.diagnostics)
                    if fam.windows:
                        summaries[s.name]["windows"] = collapse_windows(out / s.name, s,
                                                                        fam.diagnostics)
                runs = out / s.name / "runs.json"
                runs = json.loads(runs.read_text()) if runs.exists() else {}
                curve = out / s.name / f"curve_{PRIMARY.replace('/', '_')}.png"
            elif (out / f"{s.name}.json").exists():  # a copy under docs/study-cpu/
                copy = json.loads((out / f"{s.name}.json").read_text())
                summaries[s.name], runs, curve = refresh_reach(copy["summary"], s), copy["runs"], None
            else:
                continue
            if docs is not None:
                docs.mkdir(parents=True, exist_ok=True)
                (docs / f"{s.name}.json").write_text(json.dumps(
                    {"summary": summaries[s.name], "runs": runs}, indent=1) + "\n")
                if curve is not None and curve.exists():
                    shutil.copyfile(curve, docs / f"{s.name}.png")
    return summaries


def analyze(out: Path, docs: Optional[Path]) -> None:
    summaries = load_summaries(out, docs)
    floor = noise_floor(summaries)
    print("### Noise floor\n")
    print("\n".join(floor_lines(summaries, floor)) + "\n")
    print("### Every test of a verdict, on the mean over the run and on the final value\n")
    print("\n".join(both_table(summaries, floor)) + "\n")
    for key, fam in FAMILIES.items():
        print(f"### {key}: {fam.claim}\n")
        have = [s for s in fam.settings if s.name in summaries]
        if not have:
            print("(not run)\n")
            continue
        for s in have:
            commits = ", ".join(f"{c} ({n} runs)" for c, n in run_commits(out, s.name).items())
            print("\n".join(method_table(summaries, s.name)) + f"\nRuns by commit (each run's "
                  f"record): {commits or 'no records'}.\n")

        def tables(what: str, tests: tuple[Test, ...]) -> list[tuple]:
            lines, results = test_lines(summaries, tests, SUMMARY, floor)
            print(f"{what}, on the mean over the run:\n\n" + "\n".join(lines) + "\n")
            lines, _ = test_lines(summaries, tests, "final", floor)
            print(f"The same tests on the final value (post hoc, not declared):\n\n"
                  + "\n".join(lines) + "\n")
            return results

        if fam.tests:
            results = tables("Declared tests (one Holm family)", fam.tests)
            print(f"**Verdict: {verdict(results, len(fam.tests))}.**\n")
        for c in fam.added:
            results = tables(f"Added after the results were seen ({c.why}): {c.claim} (one Holm "
                             "family)", c.tests)
            print(f"**Verdict on the added claim: {verdict(results, len(c.tests))}.**\n")
        for c in fam.declared:  # the follow-up: declared before its runs
            results = tables(f"Declared before the runs ({c.why}): {c.claim} (one Holm family of "
                             f"{len(c.tests)})", c.tests)
            for v in claim_verdicts(c, results):
                print(f"**Verdict: {v}.**\n")
        if key == "clip_pilot":
            fracs = pilot_fractions(out)
            print(f"Clipped fraction of moving tokens by eps_F: {fracs}; the declared rule "
                  f"chooses eps_mid = {eps_mid_choice(fracs)}.\n")
        for setting, tests in per_setting(fam.described).items():
            lines, _ = test_lines(summaries, tests, SUMMARY, floor)
            print(f"Descriptive at {setting} (one Holm family of {len(tests)}, not part of the "
                  f"verdict):\n\n" + "\n".join(lines) + "\n")
        for s in have:
            if fam.mechanisms:
                print("\n".join(mechanism_table(summaries, s, fam.mechanisms)))
            extra = (diagnostics_table(summaries[s.name], s)
                     + windows_table(summaries[s.name], s, fam.diagnostics))
            if extra:
                print("\n".join(extra))


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the chosen families' settings (finished runs are kept)")
    r.add_argument("out", type=Path)
    r.add_argument("--family", default="pilot,pkl,sis,tetpo")
    r.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,1,2 (at least 2)")
    a = sub.add_parser("analyze", help="per-setting tables and the declared tests")
    a.add_argument("out", type=Path)
    a.add_argument("--docs", type=Path, default=None, help="copy per-seed summaries here")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        families = args.family.split(",")
        unknown = [f for f in families if f not in FAMILIES]
        if unknown:
            ap.error(f"unknown family {unknown}; known: {', '.join(FAMILIES)}")
        run(args.out, families, parse_seeds(args.seeds))
    else:
        analyze(args.out, args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
