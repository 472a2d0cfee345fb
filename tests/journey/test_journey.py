"""docs/experiments.md followed the way a user follows it, on two real paper configs scaled to CPU.

The PKL Table 4 run (`pkl_periodic/qwen3_1p7b_pkl.yaml`, periodic refresh, FP8 rollouts) goes
through the local Slurm cluster: submitted with the documented command, watched with `status` and
`logs`, refused when submitted again, a pending resubmission cancelled, then continued with
`--if-exists resume`; evaluation runs during training. The SIS run on Qwen3-30B-A3B with routing
replay (`sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml`) trains with `megapkl train` on its configured
engine kind, SGLang, here `megapkl serve` workers launched from `rollout.sglang.server_command`.
Then every documented `eval`, `plot` and `diagnose` command runs on those run directories.

What changes from the documented commands is only what names the user's cluster and what scales
the run to a CPU: the model becomes its tiny twin (`/models/...` holds tiny Hugging Face checkpoints
with a tokenizer), SGLang servers `megapkl serve` workers (FP8 where the config says so, as an
FP8 SGLang server: it takes FP8 weights only), the parallel sizes, batch and lengths shrink,
`--profile h100` becomes the local cluster's `local_cpu`, step numbers scale down. Data comes
from the test fixtures in each source's layout (`--from-file`). Every command of
docs/experiments.md is in COVERAGE: run by a test here, or not testable here and why.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from .workspace import REPO, argv_of, doc_commands, megapkl, write_checkpoint

DOC = REPO / "docs" / "experiments.md"
FIXTURES = REPO / "tests" / "data" / "fixtures"
PKL = "configs/experiments/pkl_periodic/qwen3_1p7b_pkl.yaml"
PKL_RUN = "runs/pkl_t4_qwen3_1p7b_pkl"
SIS = "configs/experiments/sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml"
SIS_RUN = "runs/sis_t4_qwen3_30b_a3b_dapo_sis_r3"
EVAL_SETS = ("math500", "aime24", "aime25", "amc23", "amc24", "olympiadbench", "minerva_math",
             "gaokao2023en")
HUB = "needs the Hugging Face Hub (no network here); the same conversion runs with --from-file"

# Every megapkl command of docs/experiments.md: the test that runs it, or why it cannot run here.
COVERAGE = {
    "megapkl smoke configs/experiments/sis_math/qwen3_30b_a3b_dapo_sis_r3.yaml":
        "tests/launch/test_smoke.py::test_smoke_sglang_moe_with_routing_replay",
    "megapkl smoke configs/experiments/pkl_staleness/qwen3_1p7b_pkl_s4.yaml rollout.engine=embedded":
        "tests/launch/test_smoke.py::test_smoke_embedded_dense",
    "megapkl data list": "test_prepare_data",
    "megapkl data prepare dapo_math_17k --out data": "test_prepare_data",
    "megapkl data prepare simplelr_qwen_level3to5 --out data": "test_prepare_data",
    "megapkl data prepare eval --out data/eval": "test_prepare_data (one --from-file per set)",
    "megapkl data prepare math500 --out data/eval --revision <commit>": f"not testable: {HUB}",
    "megapkl data prepare dapo_math_17k --out data --keep-ids frpo_ids.txt --as "
    "dapo_math_frpo_9453": "test_prepare_data",
    f"megapkl config show {PKL}": "test_config_show_validate_and_dry_runs",
    f"megapkl config validate {PKL} model.hf_checkpoint=/models/Qwen3-1.7B-Base":
        "test_config_show_validate_and_dry_runs",
    f"megapkl submit {PKL} --profile h100 model.hf_checkpoint=/models/Qwen3-1.7B-Base --dry-run":
        "test_config_show_validate_and_dry_runs",
    f"megapkl submit {PKL} --profile h100 model.hf_checkpoint=/models/Qwen3-1.7B-Base":
        "test_slurm_run_status_logs_cancel_resume (profile local_cpu)",
    "megapkl status JOB": "test_slurm_run_status_logs_cancel_resume",
    "megapkl logs JOB": "test_slurm_run_status_logs_cancel_resume",
    "megapkl cancel JOB": "test_slurm_run_status_logs_cancel_resume",
    f"megapkl submit {PKL} --profile h100 model.hf_checkpoint=/models/Qwen3-1.7B-Base "
    "--if-exists resume": "test_slurm_run_status_logs_cancel_resume (profile local_cpu)",
    "megapkl sweep configs/experiments/pkl_staleness/qwen3_1p7b_pkl_s4.yaml --profile h100 "
    "model.hf_checkpoint=/models/Qwen3-1.7B-Base --grid seed=1,2,3":
        "test_config_show_validate_and_dry_runs (--dry-run: h100 nodes are not here; "
        "tests/launch/test_slurm.py runs sweeps on the local cluster)",
    f"megapkl eval {PKL_RUN}": "test_eval_latest_checkpoint_as_in_training",
    f"megapkl eval {PKL_RUN} --step 1400 --benchmarks math500 aime24 eval.n_samples=32":
        "test_eval_step_benchmarks_and_n_samples",
    f"megapkl eval {PKL_RUN}/checkpoints/step_00001500 --out results/pkl_1500":
        "test_eval_checkpoint_directory_to_out",
    f"megapkl plot {PKL_RUN} runs/pkl_t4_qwen3_1p7b_grpo --out plots/pkl_vs_grpo --ema 0.2":
        "test_plot (the SIS run in place of GRPO)",
    f"megapkl diagnose correction-variance {PKL_RUN} --out results/pkl_c3.json":
        "test_diagnose",
    "megapkl demo": "test_laptop_section",
    "megapkl eval runs/cpu_demo_proximal_kl --benchmarks next_mod10 --out results/demo":
        "test_laptop_section",
    'megapkl demo eval.every=50 eval.at_start=true "eval.benchmarks=[{name: next_mod10, '
    'greedy: true}]"': "test_laptop_section",
    "megapkl plot runs/cpu_demo_proximal_kl --out plots/demo": "test_laptop_section",
    "megapkl demo reward.type=python reward.function=my_rewards:first_digit": "test_own_reward",
    # the search agent (section 6)
    "megapkl data prepare nq_hotpotqa_train --out data/search":
        f"not testable: {HUB} (tests/data/test_prepare_qa.py::test_merged_training_set)",
    "megapkl data prepare qa_eval --out data/eval":
        f"not testable: {HUB} (tests/data/test_prepare_qa.py)",
    "megapkl data prepare wiki18 --out data/corpus":
        f"not testable: {HUB} (tests/data/test_prepare_qa.py prepares a corpus in its layout)",
    "megapkl data prepare wiki18_e5_flat --out data/corpus": f"not testable: {HUB}",
    "megapkl retriever index --corpus data/corpus/wiki18.jsonl --out indexes/wiki18-e5 --backend "
    "e5 --faiss-index data/corpus/e5_Flat.index":
        "not testable: the 65 GB index and e5-base-v2 need the Hub (tests/retriever/test_dense.py "
        "indexes with a prebuilt FAISS index and a tiny encoder made by the test)",
    "megapkl smoke configs/experiments/sis_agent/qwen3_8b_grpo_sis.yaml rollout.engine=embedded":
        "tests/launch/test_smoke.py::test_smoke_search_agent_on_the_embedded_engine",
    "megapkl plan configs/experiments/sis_agent/qwen3_8b_grpo_sis.yaml --profile h100 "
    "model.hf_checkpoint=/models/Qwen3-8B-Base":
        "tests/launch/test_plan.py::test_plan_sizes_the_retriever_and_says_where_it_runs",
    "megapkl submit configs/experiments/sis_agent/qwen3_8b_grpo_sis.yaml --profile h100 "
    "model.hf_checkpoint=/models/Qwen3-8B-Base":
        "tests/launch/test_experiments.py::test_experiments_dry_run_on_gpu_profiles (--dry-run: "
        "H100 nodes are not here)",
    "megapkl eval runs/sis_agent_qwen3_8b_grpo_sis":
        "tests/launch/test_smoke.py::test_smoke_search_agent_on_the_embedded_engine (its eval "
        "stage: the run's retriever started and stopped)",
}

# The paper runs scaled to CPU. The PKL run: 2 Slurm tasks (data parallel 2 over gloo), its
# configured engine (SGLang, FP8 rollouts) as one block-FP8 `megapkl serve` worker per replica;
# evaluation on the paper's eight benchmarks every 2 updates. A tiny random model
# solves no math problem: every reward is -1, so the papers' group-relative advantages would all be
# 0 and the weights would never move; raw advantages (-1) move them at every update, so resume,
# checkpoints, evaluation and the diagnostic see a changing policy.
CPU = ["advantage.mode=raw", "model.num_layers=null", "model.dtype=fp32", "model.recompute=none", "parallel.context=1",
       "parallel.micro_batch_size=4", "slurm.nodes=null", "slurm.gpus_per_node=null",
       "rollout.prompts_per_batch=4", "rollout.responses_per_prompt=4",
       "rollout.max_prompt_len=256", "rollout.max_response_len=8", "eval.every=2",
       "checkpoint.every=1", "logging.progress_bar=false"]
# An FP8 run's servers start from a config-only model directory (the trainer pushes every weight
# first): the FP8 worker starts from the tiny model's seeded random weights instead.
SERVE_FP8 = ["{python}", "-m", "megapkl.serve.serve", "--model-config", "tiny-qwen3",
             "--quantization", "fp8", "--host", "{host}", "--port", "{port}"]
PKL_CPU = [*CPU, "model.name=tiny-qwen3", "parallel.data=2",
           f"rollout.sglang.server_command={json.dumps(SERVE_FP8)}", "rollout.sglang.num_engines=1",
           "rollout.sglang.startup_timeout_s=300"]
SERVE = ["{python}", "-m", "megapkl.serve.serve", "--hf-checkpoint", "{model_path}", "--host",
         "{host}", "--port", "{port}", "--enable-return-routed-experts"]
SIS_CPU = [*CPU, "reward.incorrect=-1", "advantage.filter_constant_groups=false",  # SIS: 1/0
           "model.name=tiny-qwen3-moe", "model.num_experts=null", "parallel.tensor=1",
           "parallel.sequence_parallel=false", "parallel.expert=1", "parallel.data=1",
           f"rollout.sglang.server_command={json.dumps(SERVE)}", "rollout.sglang.num_engines=1",
           "rollout.sglang.tp=1", "rollout.sglang.ep=1", "rollout.sglang.use_router=false",
           "rollout.sglang.startup_timeout_s=300", "train.steps=4", "eval.every=4"]


def doc(command: str, **subst: str) -> list[str]:
    """The argv of a command of docs/experiments.md (it must be there, and in COVERAGE)."""
    assert command in COVERAGE and command in doc_commands(DOC), command
    return argv_of(command, subst)


@pytest.fixture(scope="module")
def work(tmp_path_factory, megatron_loaded):
    """The user's working directory: the repository's configs, /models/... as tiny checkpoints."""
    w = tmp_path_factory.mktemp("journey")
    (w / "configs").symlink_to(REPO / "configs")
    write_checkpoint(w / "models" / "Qwen3-1.7B-Base", moe=False)
    write_checkpoint(w / "models" / "Qwen3-30B-A3B-Base", moe=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(w)
        mp.setenv("MEGAPKL_JOB_INDEX", str(w / "jobs.jsonl"))
        yield w


def models(w: Path) -> dict[str, str]:
    return {"/models/": f"{w}/models/"}


@pytest.fixture(scope="module")
def data(work):
    """The documented data commands, from the fixtures in each source's own layout."""
    results = {"list": megapkl(*doc("megapkl data list")).ok()}
    for name in ("dapo_math_17k", "simplelr_qwen_level3to5"):
        src = next(FIXTURES.glob(f"{name}.*"))
        results[name] = megapkl(*doc(f"megapkl data prepare {name} --out data"),
                                "--from-file", src).ok()
    doc("megapkl data prepare eval --out data/eval")
    for name in EVAL_SETS:
        results[name] = megapkl("data", "prepare", name, "--out", "data/eval", "--from-file",
                                FIXTURES / f"{name}.jsonl").ok()
    (work / "frpo_ids.txt").write_text("fixture-0-0\nfixture-2-0\n")
    results["frpo"] = megapkl(*doc("megapkl data prepare dapo_math_17k --out data --keep-ids "
                                   "frpo_ids.txt --as dapo_math_frpo_9453"),
                              "--from-file", FIXTURES / "dapo_math_17k.jsonl").ok()
    results["frpo_alone"] = megapkl("data", "prepare", "dapo_math_frpo_9453", "--out", "data")
    return results


def wait_for(job: str, timeout: float = 600.0) -> str:
    """`megapkl status JOB` until Slurm says the job ended; its last output."""
    deadline = time.time() + timeout
    while True:
        out = megapkl(*doc("megapkl status JOB", JOB=job)).ok().out
        if any(f"State={s}" in out for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")):
            return out
        assert time.time() < deadline, f"job {job} still not done after {timeout:.0f} s:\n{out}"
        time.sleep(1.0)


def job_id(submitted: str) -> str:
    assert submitted.startswith("submitted job "), submitted
    return submitted.split()[2].rstrip(":")


@pytest.fixture(scope="module")
def pkl_run(work, data):
    """The PKL run on the local Slurm cluster: 2 updates, then resumed to 4 (see the test)."""
    pytest.importorskip("submitit")
    from launch.conftest import cluster_problem  # tests/launch: is the local cluster up?

    problem = cluster_problem()
    if problem is not None:
        import os
        if os.environ.get("MEGAPKL_REQUIRE_SLURM") == "1":
            pytest.fail(f"MEGAPKL_REQUIRE_SLURM=1 but the local Slurm cluster is not usable: "
                        f"{problem}", pytrace=False)
        pytest.skip(f"local Slurm cluster not usable: {problem}")
    subst = {**models(work), "--profile h100": "--profile local_cpu"}
    submit = f"megapkl submit {PKL} --profile h100 model.hf_checkpoint=/models/Qwen3-1.7B-Base"
    resume = submit + " --if-exists resume"
    steps: dict = {}
    first = megapkl(*doc(submit, **subst), *PKL_CPU, "train.steps=2").ok()
    steps["first"] = job_id(first.out)
    steps["first_status"] = wait_for(steps["first"])
    steps["logs"] = megapkl(*doc("megapkl logs JOB", JOB=steps["first"])).ok()
    steps["again"] = megapkl(*doc(submit, **subst), *PKL_CPU, "train.steps=2")
    # a resubmission that would start in an hour: cancelled while it waits
    pending = megapkl(*doc(resume, **subst), *PKL_CPU, "train.steps=4",
                      "slurm.extra={begin: now+1hour}").ok()
    steps["pending"] = job_id(pending.out)
    steps["cancel"] = megapkl(*doc("megapkl cancel JOB", JOB=steps["pending"])).ok()
    steps["pending_status"] = wait_for(steps["pending"], timeout=120)
    resumed = megapkl(*doc(resume, **subst), *PKL_CPU, "train.steps=4").ok()
    steps["resumed"] = job_id(resumed.out)
    steps["resumed_status"] = wait_for(steps["resumed"])
    steps["in_training_eval"] = {  # before `megapkl eval` writes its own files there
        p.name: p.read_text() for p in sorted((work / PKL_RUN / "eval").iterdir())}
    return work / PKL_RUN, steps


@pytest.fixture(scope="module")
def sis_run(work, data):
    """The SIS R3 run trained here with `megapkl train` through a launched `megapkl serve`."""
    result = megapkl("train", SIS, f"model.hf_checkpoint={work}/models/Qwen3-30B-A3B-Base",
                     *SIS_CPU).ok()
    return work / SIS_RUN, result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def samples(run_dir: Path, name: str, greedy_only: bool = False) -> list[dict]:
    rows = read_jsonl(run_dir / name)
    return [r for r in rows if not greedy_only or r["benchmark"] in GREEDY]


GREEDY = ("math500", "olympiadbench", "minerva_math", "gaokao2023en")  # the PKL protocol


# ---------------------------------------------------------------------------------- the doc


def test_every_documented_command_is_covered():
    """Each `megapkl` command of docs/experiments.md is run here or said not testable; the run
    directories the commands name are the `name:` of the configs they come from."""
    commands = doc_commands(DOC)
    assert sorted(set(commands)) == sorted(COVERAGE), \
        "docs/experiments.md and COVERAGE differ: add the new command to COVERAGE and run it"
    from megapkl.config.yamlio import parse_mapping

    names = {parse_mapping(p.read_text(), str(p), "")[0].get("name")
             for p in (REPO / "configs" / "experiments").rglob("*.yaml")}
    for command in commands:
        for word in command.split():
            if word.startswith("runs/") and not word.startswith("runs/cpu_demo"):
                assert word.split("/")[1] in names, f"no paper config is named like {word}"
            if word.startswith("configs/"):
                assert (REPO / word).is_file(), word


def test_prepare_data(data, work):
    assert "dapo_math_17k" in data["list"].out and "aime24" in data["list"].out
    for name, rows in (("dapo_math_17k", 3), ("simplelr_qwen_level3to5", 2)):
        manifest = json.loads((work / "data" / f"{name}.manifest.json").read_text())
        assert manifest["rows"] == rows and len(read_jsonl(work / "data" / f"{name}.jsonl")) == rows
    assert sorted(p.stem for p in (work / "data" / "eval").glob("*.jsonl")) == sorted(EVAL_SETS)
    kept = read_jsonl(work / "data" / "dapo_math_frpo_9453.jsonl")
    assert sorted(r["id"] for r in kept) == ["fixture-0-0", "fixture-2-0"]
    assert data["frpo_alone"].rc == 2 and "dapo_math_frpo_9453" in data["frpo_alone"].err


def test_config_show_validate_and_dry_runs(work):
    show = megapkl(*doc(f"megapkl config show {PKL}")).ok().out
    assert "name: pkl_t4_qwen3_1p7b_pkl" in show and "tensorboard: true" in show
    validate = f"megapkl config validate {PKL} model.hf_checkpoint=/models/Qwen3-1.7B-Base"
    assert megapkl(*doc(validate, **models(work))).ok().out.startswith(f"ok: {PKL}")
    # as the paper config ships (a Hub id) and as the doc reads (/models is not on this machine)
    hub = megapkl("config", "validate", PKL)
    assert hub.rc == 2 and "_qwen3_1p7b.yaml:6: model.hf_checkpoint: 'Qwen/Qwen3-1.7B-Base'" \
        in hub.err and "hf download Qwen/Qwen3-1.7B-Base" in hub.err
    dry = f"megapkl submit {PKL} --profile h100 model.hf_checkpoint=/models/Qwen3-1.7B-Base --dry-run"
    missing = megapkl(*doc(dry))
    assert missing.rc == 2 and "model.hf_checkpoint: '/models/Qwen3-1.7B-Base' is not a " \
        "directory here" in missing.err
    script = megapkl(*doc(dry, **models(work))).ok().out
    assert f"# run_dir: {work / PKL_RUN}" in script
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --constraint=h100" in script
    sweep = ("megapkl sweep configs/experiments/pkl_staleness/qwen3_1p7b_pkl_s4.yaml --profile h100 "
             "model.hf_checkpoint=/models/Qwen3-1.7B-Base --grid seed=1,2,3")
    listing = megapkl(*doc(sweep, **models(work)), "--dry-run").ok().out
    for seed in (1, 2, 3):  # the run directories the doc promises
        assert f"-> {work}/runs/pkl_t5_qwen3_1p7b_pkl_s4/seed-{seed}\n" in listing


def test_slurm_run_status_logs_cancel_resume(pkl_run):
    run, steps = pkl_run
    assert "State=COMPLETED" in steps["first_status"] and "last step: step=1" in \
        steps["first_status"]
    log = steps["logs"].out  # task 0's stdout
    assert f"JobEnvironment(job_id={steps['first']}," in log and "Job completed successfully" in log
    assert steps["again"].rc == 1 and "--if-exists resume" in steps["again"].err
    assert "State=CANCELLED" in steps["pending_status"]
    assert "State=COMPLETED" in steps["resumed_status"]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the first job's 2 updates, then 2 more
    launch = json.loads((run / "launch.json").read_text())
    assert [j["job_id"] for j in launch["jobs"]] == [steps["first"], steps["pending"],
                                                     steps["resumed"]]
    events = [json.loads(x)["event"] for x in (run / "events.jsonl").read_text().splitlines()]
    assert events == ["start", "done", "start", "done"]
    # evaluation during training, on the paper's eight benchmarks, into metrics and files
    evals = {r["step"]: r for r in rows if "eval/version" in r}
    assert {s: r["eval/version"] for s, r in evals.items()} == {1: 2, 3: 4}
    summary = json.loads((run / "eval" / "step_000004.json").read_text())
    assert sorted(summary["benchmarks"]) == sorted(EVAL_SETS)
    assert summary["benchmarks"]["aime24"]["num_samples"] == 2 * 16  # mean@16 on 2 prompts
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))  # paper runs log to TB
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        f"step_{s:08d}" for s in (2, 3, 4)]  # checkpoint.keep: 3


def test_eval_latest_checkpoint_as_in_training(pkl_run):
    """The default eval: the latest checkpoint (update 4), the run's benchmarks, its greedy
    answers those of the in-training evaluation of the same weights (2 ranks there, 1 here)."""
    run, steps = pkl_run
    in_training = steps["in_training_eval"]
    own = (run / "eval" / "step_000004.samples.jsonl").read_bytes()
    out = megapkl(*doc(f"megapkl eval {PKL_RUN}")).ok().out
    assert "(update 4)" in out and "rollouts: one SGLang server on this process's CPU" in out
    assert (run / "eval" / "step_000004.samples.jsonl").read_bytes() == own  # the run's record
    summary = json.loads((run / "eval-cli" / "step_000004.json").read_text())
    assert summary["step"] == 4 and sorted(summary["benchmarks"]) == sorted(EVAL_SETS)
    key = lambda r: (r["benchmark"], r["prompt_id"])  # noqa: E731
    before = sorted((r for r in map(json.loads, in_training["step_000004.samples.jsonl"]
                                    .splitlines()) if r["benchmark"] in GREEDY), key=key)
    assert before and sorted(samples(run / "eval-cli", "step_000004.samples.jsonl", True),
                             key=key) == before


def test_eval_step_benchmarks_and_n_samples(pkl_run):
    run, _ = pkl_run
    cmd = f"megapkl eval {PKL_RUN} --step 1400 --benchmarks math500 aime24 eval.n_samples=32"
    out = megapkl(*doc(cmd, **{"--step 1400": "--step 3"})).ok().out
    assert "(update 3)" in out
    summary = json.loads((run / "eval-cli" / "step_000003.json").read_text())
    assert summary["checkpoint"].endswith("step_00000003")
    assert sorted(summary["benchmarks"]) == ["aime24", "math500"]
    assert summary["settings"]["benchmarks"]["aime24"]["n_samples"] == 32  # the override
    assert summary["benchmarks"]["aime24"]["num_samples"] == 2 * 32
    assert summary["benchmarks"]["math500"]["num_samples"] == 2  # greedy: one each
    per_prompt = {}
    for r in samples(run / "eval-cli", "step_000003.samples.jsonl"):
        per_prompt.setdefault((r["benchmark"], r["prompt_id"]), []).append(r["sample"])
    assert sorted(map(len, per_prompt.values())) == [1, 1, 32, 32]


def test_eval_checkpoint_directory_to_out(pkl_run, work):
    run, _ = pkl_run
    cmd = f"megapkl eval {PKL_RUN}/checkpoints/step_00001500 --out results/pkl_1500"
    megapkl(*doc(cmd, **{"step_00001500": "step_00000004"})).ok()
    summary = json.loads((work / "results" / "pkl_1500" / "step_000004.json").read_text())
    assert summary["checkpoint"] == str(run / "checkpoints" / "step_00000004")
    assert (work / "results" / "pkl_1500" / "step_000004.samples.jsonl").is_file()


def test_sis_r3_run_trained_here(sis_run):
    """`megapkl train` of the SIS R3 run: on-policy batches of N = 4 minibatches generated by the
    launched `megapkl serve` worker, SIS on its top-30 log-probs, the routed experts replayed."""
    run, _ = sis_run
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["staleness/max"] for r in rows] == [0, 1, 2, 3]
    assert all(r["grad_norm"] > 0 and 0.0 <= r["sis/accept_rate"] <= 1.0 for r in rows)
    assert rows[0]["mismatch/routing_tokens"] > 0  # every sample came with its experts
    assert rows[0]["mismatch/abs_log_ratio_max"] < 1e-4  # replayed: the server's log-probs
    assert [r["eval/version"] for r in rows if "eval/version" in r] == [4]
    assert (run / "sglang" / "logs" / "engine0.log").is_file()


def test_eval_of_an_sglang_run_uses_its_servers(sis_run):
    """A run configured for SGLang is evaluated on SGLang servers of its own config (here the
    `megapkl serve` workers it trained with), and answers as during training."""
    run, _ = sis_run
    during = read_jsonl(run / "eval" / "step_000004.samples.jsonl")
    shutil.rmtree(run / "sglang" / "logs")
    out = megapkl("eval", SIS_RUN, "--out", "results/sis").ok().out
    assert "(update 4)" in out
    assert list((run / "sglang" / "logs").glob("*.log"))  # its server was launched again
    summary = json.loads(Path("results/sis/step_000004.json").read_text())
    assert summary["benchmarks"]["amc23"]["num_samples"] == 2 * 32  # SIS: Avg@32
    assert read_jsonl(Path("results/sis/step_000004.samples.jsonl")) == during


def test_eval_of_an_sglang_run_with_its_paper_fleet(sis_run, work):
    """The SIS run as its paper config places it (2 servers of 2 GPUs each behind a router, no
    such GPUs here): evaluated on the one server this process can place, and saying so."""
    from megapkl.config import dump_config, load_config

    run, _ = sis_run
    shaped = work / "runs" / "sis_t4_qwen3_30b_a3b_dapo_sis_r3_cluster"
    shaped.mkdir()
    fleet = ["rollout.sglang.num_engines=2", "rollout.sglang.tp=2", "rollout.sglang.ep=2",
             "rollout.sglang.use_router=true", f"run_dir={shaped}"]
    (shaped / "config.yaml").write_text(dump_config(load_config(run / "config.yaml", fleet)))
    out = megapkl("eval", shaped, "--benchmarks", "amc23", "eval.n_samples=2").ok().out
    assert "rollouts: one SGLang server on this process's CPU (the run's fleet, 2 x 2 GPU(s)" in out
    summary = json.loads((shaped / "eval-cli" / "step_000004.json").read_text())
    assert summary["benchmarks"]["amc23"]["num_samples"] == 2 * 2
    assert sorted(p.name for p in (shaped / "sglang" / "logs").glob("*.log")) == ["engine0.log"]


def test_plot(pkl_run, sis_run, work):
    cmd = f"megapkl plot {PKL_RUN} runs/pkl_t4_qwen3_1p7b_grpo --out plots/pkl_vs_grpo --ema 0.2"
    megapkl(*doc(cmd, **{"runs/pkl_t4_qwen3_1p7b_grpo": SIS_RUN})).ok()
    drawn = {p.name for p in (work / "plots" / "pkl_vs_grpo").glob("*.png")}
    assert {"overview.png", "eval_overview.png", "eval_micro_avg_accuracy.png",
            "eval_math500_pass@1_greedy.png", "eval_amc23_mean@32.png"} <= drawn


def test_diagnose(pkl_run, work):
    run, _ = pkl_run
    cmd = f"megapkl diagnose correction-variance {PKL_RUN} --out results/pkl_c3.json"
    out = megapkl(*doc(cmd), "--prompts", "2", "--responses", "4").ok().out
    assert "rollouts: one SGLang server on this process's CPU" in out
    result = json.loads((work / "results" / "pkl_c3.json").read_text())
    assert result["current"] == str(run / "checkpoints" / "step_00000004")
    assert result["reference"] == "init" and (result["prompts"], result["responses"]) == (2, 4)
    assert list(result["V"]) == ["1", "2", "4", "8", "16", "32", "64", "full"]
    assert all(r["grad_norm"] > 0 for r in read_jsonl(run / "metrics.jsonl"))
    assert all(v >= 0.0 for v in result["V"].values()) and result["V"]["full"] > 0.0
    # as configured: FP8 rollouts on SGLang, here a block-FP8 `megapkl serve` worker, which
    # refuses anything but FP8 weights (diagnose once pushed them unquantized: HTTP 400)
    cfg = (run / "config.yaml").read_text()
    assert "engine: sglang" in cfg and "fp8: true" in cfg


def test_eval_and_diagnose_whatever_the_job_shape(pkl_run, work):
    """The run as a cluster records it: its config.yaml says 1 node x 8 GPUs, tensor 2 with
    sequence parallelism, context 2, data 2. `eval` and `diagnose` still run in one process."""
    from megapkl.config import dump_config, load_config

    run, _ = pkl_run
    shaped = work / "runs" / "pkl_t4_qwen3_1p7b_pkl_cluster"
    shaped.mkdir()
    cluster = ["slurm.nodes=1", "slurm.gpus_per_node=8", "parallel.tensor=2",
               "parallel.sequence_parallel=true", "parallel.context=2", "parallel.data=2",
               f"run_dir={shaped}"]
    (shaped / "config.yaml").write_text(dump_config(load_config(run / "config.yaml", cluster)))
    out = megapkl("eval", shaped, "--benchmarks", "math500").ok().out
    assert "(update 4)" in out and (shaped / "eval-cli" / "step_000004.json").is_file()
    megapkl("diagnose", "correction-variance", shaped, "--prompts", "2", "--responses", "2",
            "--horizons", "1,full").ok()


def test_laptop_section(work):
    """`megapkl demo` and what the doc does with its run, two updates instead of 300."""
    short = "train.steps=2"
    megapkl(*doc("megapkl demo"), short).ok()
    demo = work / "runs" / "cpu_demo_proximal_kl"
    assert len(read_jsonl(demo / "metrics.jsonl")) == 2
    out = megapkl(*doc("megapkl eval runs/cpu_demo_proximal_kl --benchmarks next_mod10 --out "
                       "results/demo")).ok().out
    assert "(update 2)" in out and "next_mod10" in out
    (demo / "eval-cli").mkdir()  # what an eval without --out would have written
    megapkl(*doc("megapkl plot runs/cpu_demo_proximal_kl --out plots/demo")).ok()
    assert (work / "plots" / "demo" / "overview.png").is_file()
    megapkl(*doc('megapkl demo eval.every=50 eval.at_start=true "eval.benchmarks=[{name: '
                 'next_mod10, greedy: true}]"'), short).ok()
    assert sorted(p.name for p in (demo / "eval").glob("*.json")) == ["step_000000.json"]
    # as the doc says: the second demo deleted the run directory, the eval under --out is kept
    assert not (demo / "eval-cli").exists()
    assert (work / "results" / "demo" / "step_000002.json").is_file()


def test_own_reward(work):
    """Section 5: the doc's reward function, written to my_rewards.py as the doc shows it, scores
    the demo's responses in the reward worker (two updates instead of 300)."""
    import re

    code = re.search(r"```python\n(# my_rewards.py.*?)```", DOC.read_text(), flags=re.S).group(1)
    (work / "my_rewards.py").write_text(code)
    run = work / "runs" / "cpu_demo_proximal_kl"
    shutil.rmtree(run, ignore_errors=True)
    megapkl(*doc("megapkl demo reward.type=python reward.function=my_rewards:first_digit"),
            "train.steps=2", "checkpoint.resume=false").ok()
    assert "function: my_rewards:first_digit" in (run / "config.yaml").read_text()
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 2 and all(r["reward/errors"] == 0 for r in rows), rows
    # first_digit gives +1 or -1 only: the mean reward is 2 * accuracy - 1
    assert all(abs(r["reward/mean"] - (2 * r["train/accuracy"] - 1)) < 1e-6 for r in rows), rows


def test_the_docs_list_every_command():
    """The command list of docs/getting-started.md names every subcommand of the CLI, and nothing
    else."""
    import argparse
    import re

    from megapkl.cli import build_parser

    def commands(parser, prefix=""):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    nested = list(commands(sub, f"{prefix}{name} "))
                    yield from nested or [f"{prefix}{name}"]

    block = re.search(r"## Commands\n\n```bash\n(.*?)```",
                      (REPO / "docs" / "getting-started.md").read_text(), flags=re.S).group(1)
    lines = []
    for line in block.splitlines():
        words = line.split()
        if words[:1] == ["megapkl"]:  # `megapkl status|cancel|logs JOB`: three commands
            lines += [" ".join(["megapkl", w, *words[2:]]) + " " for w in words[1].split("|")]
    cli = set(commands(build_parser()))
    missing = [c for c in cli if not any(line.startswith(f"megapkl {c} ") for line in lines)]
    assert not missing, f"docs/getting-started.md's command list lacks {sorted(missing)}"
    top = {c.split()[0] for c in cli}
    assert all(line.split()[1] in top for line in lines), lines
