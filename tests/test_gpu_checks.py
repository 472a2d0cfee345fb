"""The GPU checks' own logic, on CPU (they cannot run here; tools/gpu_checks/run_all.sh --cpu
runs them in full): the FP8 check imports only torch, numpy and the repository; the SGLang smoke
test never puts its server on the GPU of its own NCCL rank; the failure notice's check and the
per-thread device check run their code paths on gloo; the TE check fails rather than check the
local spec under TE's name; the shell scripts parse; the summary fails a run when a step
failed."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tools" / "gpu_checks"

# Run a script where only the standard library, torch (with what torch itself imports) and numpy
# are installed: every other top-level import fails as if absent, and megapkl imports only from a
# repository the script put on sys.path itself (not from an installed copy).
ONLY_TORCH = r"""
import importlib.abc, importlib.machinery, os, runpy, sys
OK = {"torch", "torchgen", "functorch", "numpy", "typing_extensions", "sympy", "mpmath",
      "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "triton", "packaging", "yaml",
      "nvidia", "cuda", "optree"}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in OK or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        if name == "megapkl":
            repos = [p for p in sys.path if os.path.isfile(os.path.join(p, "megapkl", "rollout",
                                                                        "fp8.py"))
                     and "site-packages" not in p]
            spec = importlib.machinery.PathFinder.find_spec(name, repos) if repos else None
            if spec is not None:
                return spec
        elif top == "megapkl":
            return None
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_fp8_check_needs_only_torch_and_the_repository(tmp_path):
    out = subprocess.run([sys.executable, "-c", ONLY_TORCH, str(CHECKS / "fp8_gpu.py"),
                          "--device", "cpu", "--small", "--repeats", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["check"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert rows["error_bound"]["ok"] and "export_plus_quantize_s" in rows["export_quantize"]


def _smoke():
    spec = importlib.util.spec_from_file_location("sglang_smoke", CHECKS / "sglang_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gpus,dedicated,base", [(2, True, 1), (1, False, 0)])
def test_the_sglang_smoke_server_never_shares_the_trainers_nccl_gpu(monkeypatch, tmp_path, gpus,
                                                                      dedicated, base):
    """This process is rank 0 of the weight-update group on GPU 0; the server's ranks must be on
    other GPUs for the distributed sync (NCCL: 'Duplicate GPU detected'), which runs only then."""
    from engine_contexts import context_of
    from megapkl.rollout.sglang.build import engine_slots

    monkeypatch.setenv("SLURM_GPUS_ON_NODE", str(gpus))
    for var in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    args = SimpleNamespace(model=str(tmp_path), out=str(tmp_path), port=31000)
    cfg = _smoke().config(args, dedicated)
    (slot,) = engine_slots(cfg.rollout, context_of(cfg, {}))
    assert slot.base_gpu == base
    assert cfg.rollout.sglang.colocate is (not dedicated)


def test_the_scripts_parse():
    import py_compile

    for script in ("run_all.sh", "prep_wheels.sh"):
        subprocess.run(["bash", "-n", str(CHECKS / script)], check=True)
    for script in CHECKS.glob("*.py"):
        py_compile.compile(str(script), doraise=True)
    out = subprocess.run([sys.executable, str(CHECKS / "launch_gpu.py"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-500:]


def test_the_summary_fails_the_run_when_a_step_failed(tmp_path):
    (tmp_path / "status.txt").write_text("train 0\nlaunch 1\nfp8 0\nlifecycle 1\nnotice 1\n"
                                         "threads 0\n")
    (tmp_path / "train.json").write_text(json.dumps(
        {"ok": True, "device": "X", "tokens_per_s": 10.0, "mfu": 0.3, "peak_memory_gib": 40.0,
         "weight_export_s": 1.5, "update_s": 0.9, "update_split_s": {"train": 0.5},
         "checks": {"a": {"ok": True}}}) + "\n")
    (tmp_path / "launch.json").write_text(json.dumps(
        {"ok": False, "checks": {"sigterm_checkpoints_and_stops": {"ok": False}}}) + "\n")
    (tmp_path / "launch.log").write_text("No backend type associated with device type cpu\n")
    (tmp_path / "fp8.json").write_text(
        json.dumps({"check": "export_quantize", "export_plus_quantize_s": 0.4,
                    "goal_export_plus_quantize_le_1s": True}) + "\n"
        + json.dumps({"check": "error_bound", "ok": True}) + "\n")
    (tmp_path / "lifecycle.json").write_text(
        json.dumps({"check": "update_group", "ok": True, "split_count_before": 0,
                    "split_count_after_update_group": 0,
                    "split_count_after_control_new_group": 1}) + "\n"
        + json.dumps({"check": "free_before_resume", "ok": False}) + "\n")
    (tmp_path / "notice.json").write_text(json.dumps(
        {"check": "notice_abort", "ok": False, "mode": "one-gpu-two-nccl-hosts",
         "left_after_fault_s": [61.0, 1.2],
         "checks": {"same_line_on_both_ranks": True, "rank0_left_within": False}}) + "\n")
    (tmp_path / "threads.json").write_text(json.dumps(
        {"check": "thread_devices", "ok": True, "gpus": 1, "skipped": True, "seen": {}}) + "\n")
    out = subprocess.run([sys.executable, str(CHECKS / "summary.py"), str(tmp_path), "gpu"],
                         capture_output=True, text=True, timeout=60)
    summary = json.loads(out.stdout.splitlines()[-1])
    assert out.returncode == 1 and not summary["ok"]
    assert summary["verdicts"] == {"train": True, "launch": False, "fp8": True,
                                   "lifecycle": False, "notice": False, "threads": True}
    assert summary["failed"]["notice"]["checks"] == ["rank0_left_within"]
    assert summary["notice_left_after_fault_s"] == [61.0, 1.2]
    assert summary["failed"]["lifecycle"]["checks"] == ["free_before_resume"]
    assert summary["update_group_splits"]["split_count_after_control_new_group"] == 1
    assert summary["failed"]["launch"]["checks"] == ["sigterm_checkpoints_and_stops"]
    assert "device type cpu" in summary["failed"]["launch"]["log_tail"][0]
    assert (summary["tokens_per_s"], summary["fp8_export_plus_quantize_s"]) == (10.0, 0.4)
    assert (summary["update_s"], summary["update_split_s"]) == (0.9, {"train": 0.5})


def test_the_lifecycle_check_runs_its_code_paths_on_cpu():
    """The same script as on the GPU: the update group is opened and broadcast on over gloo, the
    cache freeing runs; the GPU-only assertions say they were skipped, and nothing else."""
    out = subprocess.run([sys.executable, str(CHECKS / "lifecycle_gpu.py"), "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["check"] for r in rows] == ["update_group", "free_before_resume"]
    assert all(r["ok"] and r["skipped"] for r in rows), rows


def test_the_train_checks_probes_take_what_the_learner_is_called_with():
    """train_gpu.py wraps `Learner.pack` and `Learner.train_step` to time and count them: every
    argument the learner's own signature accepts must pass through the wrappers, or the check dies
    on its first GPU step (as it did when `train_step` gained `record=`)."""
    import inspect

    from megapkl.train.learner import Learner

    spec = importlib.util.spec_from_file_location("train_gpu", CHECKS / "train_gpu.py")
    train_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpu)
    for method, wrapper in (("train_step", train_gpu.Probe._timed_step),
                            ("pack", train_gpu.Probe._counted_pack)):
        wanted = list(inspect.signature(getattr(Learner, method)).parameters.values())[1:]
        taken = inspect.signature(wrapper).parameters
        rest = list(taken.values())[2:]  # after (self, inner)
        if any(p.kind is p.VAR_KEYWORD for p in rest):
            rest_names = {p.name for p in rest}
            assert all(p.name in rest_names or p.kind is p.KEYWORD_ONLY
                       or p.default is not p.empty for p in wanted), (method, wanted, rest)
        else:
            assert [p.name for p in rest] == [p.name for p in wanted], (method, wanted, rest)


def test_the_failure_notice_check_runs_its_code_path_on_gloo():
    """The same two processes as on the GPU: rank 1 fails outside an agreement while rank 0
    waits in a collective; both leave with the same line, rank 0 within seconds."""
    out = subprocess.run([sys.executable, str(CHECKS / "notice_gpu.py"), "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and rows and rows[-1]["ok"], (out.stdout[-2000:],
                                                             out.stderr[-2000:])
    assert rows[-1]["mode"] == "gloo" and set(rows[-1]["checks"]) == {
        "same_line_on_both_ranks", "rank0_left_within", "rank0_collective_raised",
        "exit_status_0"}


def test_the_thread_device_check_runs_its_code_paths_on_cpu():
    out = subprocess.run([sys.executable, str(CHECKS / "threads_gpu.py"), "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and rows and rows[-1]["ok"] and rows[-1]["skipped"], \
        (out.stdout[-2000:], out.stderr[-2000:])
    assert set(rows[-1]["seen"]) == {"main", "producer", "heartbeat_resync", "sync_layout"}


def test_the_te_check_fails_when_transformer_engine_cannot_run():
    """Without Transformer Engine (here: without a GPU) the TE check fails at once, naming the
    cause, instead of checking the local spec under TE's name and exiting 0."""
    out = subprocess.run([sys.executable, str(CHECKS / "models_te_bf16.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    assert rows == [{"check": "transformer_engine", "ok": False, "error": rows[0]["error"]}]
    assert "Transformer Engine cannot run here (no CUDA device)" in rows[0]["error"]
