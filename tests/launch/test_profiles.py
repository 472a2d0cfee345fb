"""Cluster profiles, job shapes, sbatch parameters, grids and the CLI: no Slurm needed."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from job_inputs import job_inputs, visible_profile

from megapkl.config import ConfigError
from megapkl.launch.profile import (ClusterProfile, list_profiles, load_profile, loads_profile,
                                    time_to_minutes)
from megapkl.launch.submit import sbatch_parameters, submit
from megapkl.launch.sweep import grid_elements, parse_grid, sweep

from .conftest import TINY, TOY

GOOD = """\
partition: gpu
node_gpus: 8
node_cpus: 96
nodes: 2
gpus_per_node: 8
cpus_per_task: 12
time: "04:00:00"
"""


def bad(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        loads_profile(text, source="slurm/profiles/site.yaml")
    return info.value


# ---- the shipped profiles

@pytest.mark.parametrize("name", ["local_cpu", "h100", "h200", "h100_apptainer"])
def test_shipped_profiles_load(name: str) -> None:
    assert name in list_profiles()
    prof = load_profile(name)
    assert prof.partition
    params = sbatch_parameters(prof, "job")
    assert params["ntasks_per_node"] * prof.nodes == prof.world_size
    if prof.uses_gpus:
        assert params["gpus_per_node"] == 8 == prof.job_tasks_per_node


def test_local_cpu_profile_is_the_ci_cluster() -> None:
    prof = load_profile("local_cpu")
    assert (prof.partition, prof.node_gpus, prof.world_size, prof.cpus_per_task) == ("cpu", 0, 2, 1)
    assert "gpus_per_node" not in sbatch_parameters(prof, "x")


# ---- bad profiles: clear errors naming the file, the line and the key

def test_unknown_key_suggests() -> None:
    err = bad(GOOD + "gpu_per_node: 8\n")
    msg = str(err)
    assert msg.startswith("slurm/profiles/site.yaml:8: gpu_per_node: unknown key")
    assert "did you mean 'gpus_per_node'?" in msg


def test_missing_partition() -> None:
    err = bad(GOOD.replace("partition: gpu\n", ""))
    assert err.key == "partition" and err.source == "slurm/profiles/site.yaml"
    assert "required" in str(err) and "sinfo" in str(err)


@pytest.mark.parametrize("line,key,words", [
    ("nodes: two", "nodes", "expected an integer"),
    ("exclusive: 1", "exclusive", "expected a boolean"),
    ("setup: module load cuda", "setup", "expected a list"),
    ("time: 4h", "time", "Slurm time"),
    ("mem: 64GB", "mem", "Slurm memory size"),
    ("cpus_per_task: 0", "cpus_per_task", ">= 1"),
    ("container: {runtime: docker, image: x}", "container.runtime", "'pyxis', 'apptainer'"),
    ("container: {runtime: pyxis}", "container.image", "needs an image"),
    ("env: {1BAD: x}", "env.1BAD", "not an environment variable"),
    ("gpu_decode_tokens_per_s: 0", "gpu_decode_tokens_per_s", "> 0"),
])
def test_wrong_types_and_values(line: str, key: str, words: str) -> None:
    name = line.split(":")[0]
    text = "\n".join(ln for ln in GOOD.splitlines() if not ln.startswith(name + ":")) + "\n" + line
    err = bad(text + "\n")
    assert err.key == key, str(err)
    assert words in str(err)
    assert str(err).startswith("slurm/profiles/site.yaml:")


def test_more_gpus_than_the_nodes_have() -> None:
    err = bad(GOOD.replace("gpus_per_node: 8", "gpus_per_node: 16"))
    assert err.key == "gpus_per_node"
    assert "16 GPUs per node" in str(err) and "node_gpus=8" in str(err)
    assert str(err).startswith("slurm/profiles/site.yaml:5: ")


def test_gpu_task_layout_rules() -> None:
    err = bad(GOOD + "tasks_per_node: 3\n")
    assert err.key == "tasks_per_node" and "split evenly" in str(err)
    err = bad(GOOD + "tasks_per_node: 16\n")
    assert err.key == "tasks_per_node" and "own GPU" in str(err)
    err = bad(GOOD.replace("cpus_per_task: 12", "cpus_per_task: 16"))
    assert err.key == "cpus_per_task" and "node_cpus=96" in str(err)
    err = bad(GOOD + "max_nodes: 1\n")
    assert err.key == "nodes" and "max_nodes=1" in str(err)


def test_managed_sbatch_flags_are_refused() -> None:
    err = bad(GOOD + "sbatch: {ntasks-per-node: 4}\n")
    assert err.key == "sbatch.ntasks-per-node" and "tasks_per_node" in str(err)


def test_unknown_profile_name_suggests() -> None:
    with pytest.raises(ConfigError, match="did you mean 'h100'"):
        load_profile("h10")


def test_defaults_one_task_per_gpu() -> None:
    prof = loads_profile("partition: p\nnode_gpus: 8\n")
    assert (prof.job_gpus_per_node, prof.job_tasks_per_node, prof.world_size) == (8, 8, 8)
    prof = loads_profile("partition: p\n")
    assert (prof.job_gpus_per_node, prof.job_tasks_per_node, prof.uses_gpus) == (0, 1, False)


@pytest.mark.parametrize("text,minutes", [("90", 90), ("10:30", 11), ("04:00:00", 240),
                                          ("1-00:00:00", 1440), ("2-12", 3600),
                                          ("0-00:00:30", 1)])
def test_time_to_minutes(text: str, minutes: int) -> None:
    assert time_to_minutes(text) == minutes


# ---- run config slurm: keys over the profile

def test_run_config_overrides_are_checked_against_the_profile(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        submit(TINY, "h100", ["slurm.nodes=1", "slurm.gpus_per_node=16", "parallel.data=16",
                              "parallel.micro_batch_size=1"], entry=TOY, dry_run=True)
    err = info.value
    assert err.key == "slurm.gpus_per_node" and err.source.endswith("tiny.yaml")
    assert "node_gpus=8" in str(err) and "slurm/profiles/h100.yaml" in str(err)


def test_gpu_profile_checks_the_parallel_layout() -> None:
    # The CPU demo asks for data=2; on one 8-GPU node the world is 8: the run config's own rule.
    with pytest.raises(ConfigError) as info:
        submit(TINY, "h100", [], entry=TOY, dry_run=True)
    assert "parallel.data" in str(info.value) and "8" in str(info.value)
    sub = submit(TINY, "h100", ["parallel.data=8", "parallel.micro_batch_size=1"], entry=TOY,
                 dry_run=True)
    assert "#SBATCH --gpus-per-node=8" in sub.script and "#SBATCH --exclusive" in sub.script
    assert "#SBATCH --time=2880" in sub.script and "--cpu-bind=cores" in sub.script
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in sub.script


def test_dry_run_local_cpu(tmp_path: Path) -> None:
    sub = submit(TINY, "local_cpu", [f"run_dir={tmp_path}/r", "slurm.time=00:05:00"], entry=TOY,
                 dry_run=True)
    assert sub.job is None and not (tmp_path / "r").exists()
    for line in ("#SBATCH --partition=cpu", "#SBATCH --ntasks-per-node=2", "#SBATCH --time=5",
                 "#SBATCH --signal=USR2@30", "#SBATCH --job-name=launch_tiny"):
        assert line in sub.script
    assert f"{tmp_path}/r/submitit/%j_%t_log.out" in sub.script
    assert sub.spec.config_file == f"{tmp_path}/r/config.yaml" and not sub.spec.use_gpus


def test_missing_profile_and_bad_entry() -> None:
    with pytest.raises(ConfigError, match="--profile"):
        submit(TINY, None, [], entry=TOY, dry_run=True)
    with pytest.raises(ValueError, match="not importable"):
        submit(TINY, "local_cpu", [], entry="megapkl.no_such_module:run", dry_run=True)


# ---- sweeps

def test_grid_parsing_and_labels() -> None:
    axes = parse_grid(["objective.name=proximal_kl,grpo,pg", "seed=1,2,3",
                       "objective.is_clip=[0,5],[0,10]"])
    assert axes[2] == ("objective.is_clip", ["[0,5]", "[0,10]"])
    els = grid_elements(axes[:2])
    assert len(els) == 9
    assert els[0] == ("name-proximal_kl_seed-1", ["objective.name=proximal_kl", "seed=1"])
    with pytest.raises(ConfigError, match="cannot vary"):
        parse_grid(["slurm.nodes=1,2"])
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        parse_grid(["seed"])


def test_sweep_dry_run_validates_every_element(tmp_path: Path) -> None:
    out = sweep(TINY, "local_cpu", ["objective.name=proximal_kl,grpo,pg", "seed=1,2,3"],
                [f"run_dir={tmp_path}/s"], entry=TOY, parallelism=4, dry_run=True)
    assert len(out.elements) == 9
    assert "#SBATCH --array=0-8%4" in out.script
    assert out.elements[4].run_dir == tmp_path / "s" / "name-grpo_seed-2"
    with pytest.raises(ConfigError, match="objective.name"):
        sweep(TINY, "local_cpu", ["objective.name=proximal_kl,nope"], [f"run_dir={tmp_path}/t"],
              entry=TOY, dry_run=True)


# ---- CLI and imports

def test_add_subcommands_registers_the_launch_commands() -> None:
    from megapkl.launch.cli import add_subcommands
    parser = argparse.ArgumentParser(prog="megapkl")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sweep", "c.yaml", "train.steps=3", "--profile", "local_cpu",
                              "--grid", "objective.name=pkl,grpo", "seed=1,2", "--parallelism",
                              "2"])
    assert args.grid == ["objective.name=pkl,grpo", "seed=1,2"] and args.overrides == ["train.steps=3"]
    for argv in (["submit", "c.yaml", "-p", "h100", "seed=1", "--dry-run"], ["status"],
                 ["cancel", "12"], ["logs", "12", "--task", "1", "-n", "5"]):
        assert callable(parser.parse_args(argv).func)


def test_cli_dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from megapkl.launch.cli import main
    rc = main(["submit", str(TINY), f"run_dir={tmp_path}/c", "-p", "local_cpu", "--entry", TOY,
               "--dry-run"])
    assert rc == 0 and "#SBATCH --partition=cpu" in capsys.readouterr().out
    rc = main(["submit", str(TINY), "-p", "local_cpu", "--entry", TOY, "--dry-run",
               "train.stepz=3"])
    assert rc == 2 and "did you mean 'steps'" in capsys.readouterr().err


def test_launch_imports_neither_torch_nor_submitit() -> None:
    code = ("import sys, megapkl.launch, megapkl.launch.cli, megapkl.launch.profile, "
            "megapkl.launch.runtime, megapkl.launch.toy, megapkl.launch.jobs; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "import megapkl.launch.submit, megapkl.launch.sweep; "
            "assert 'torch' not in sys.modules, 'torch (submit)'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_profile_is_a_dataclass_with_the_documented_keys() -> None:
    import dataclasses
    keys = {f.name for f in dataclasses.fields(ClusterProfile)}
    for k in ("partition", "account", "qos", "nodes", "gpus_per_node", "tasks_per_node",
              "cpus_per_task", "mem", "time", "constraint", "exclusive", "container", "setup",
              "env", "sbatch", "srun_args", "gpu_mem_gib", "gpu_tflops", "gpu_decode_tokens_per_s"):
        assert k in keys


def test_required_cluster_fails_instead_of_skipping(tmp_path: Path) -> None:
    """Without Slurm on PATH the Slurm tests skip, but fail under MEGAPKL_REQUIRE_SLURM=1 (CI)."""
    import os
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "MEGAPKL_REQUIRE_SLURM"}
    env["PATH"] = str(tmp_path)  # no sinfo, no sbatch
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/launch/test_slurm.py::test_cancel"]
    skipped = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    failed = subprocess.run(cmd, cwd=repo, env={**env, "MEGAPKL_REQUIRE_SLURM": "1"},
                            capture_output=True, text=True)
    assert failed.returncode == 1, failed.stdout[-2000:]
    assert "MEGAPKL_REQUIRE_SLURM=1 but the local Slurm cluster is not usable" in failed.stdout
    assert "Slurm is not installed" in failed.stdout


def test_run_config_extra_sbatch_flags_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        submit(TINY, "local_cpu", [f"run_dir={tmp_path}/x", "slurm.extra={partition: gpu}"],
               entry=TOY, dry_run=True)
    assert info.value.key == "slurm.extra.partition" and "profile key partition" in str(info.value)
    sub = submit(TINY, "local_cpu", [f"run_dir={tmp_path}/y", "slurm.extra={mail-type: FAIL}",
                                     "slurm.time=00:07:00"], entry=TOY, dry_run=True)
    assert "#SBATCH --mail-type=FAIL" in sub.script and "#SBATCH --time=7" in sub.script


def test_existing_run_directory(tmp_path: Path) -> None:
    from megapkl.launch.submit import LaunchError, prepare_run_dir, resume_overrides
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text('{"jobs": [{"job_id": "42"}]}')
    with pytest.raises(LaunchError, match=r"already holds a run \(last job 42\)"):
        prepare_run_dir(run_dir, "error")
    prepare_run_dir(run_dir, "resume")
    assert (run_dir / "launch.json").exists()
    prepare_run_dir(run_dir, "overwrite")
    assert not (run_dir / "launch.json").exists()
    assert resume_overrides(["seed=1"], "resume") == ["seed=1", "checkpoint.resume=true"]
    assert resume_overrides(["checkpoint.resume=false"], "resume") == ["checkpoint.resume=false"]


# ---- the GPU stack and Slurm inside containers

def test_the_container_profile_runs_the_pinned_stack() -> None:
    """The h200 image is SGLang's CUDA 13 release image of the version pyproject's [gpu] pins
    (it ships torch 2.14.1, which an NGC PyTorch image of another torch cannot host)."""
    import re

    pins = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    version = re.search(r'"sglang==([\d.]+)"', pins).group(1)
    prof = load_profile("h200")
    assert prof.container is not None and prof.container.runtime == "pyxis"
    assert prof.container.image == f"lmsysorg/sglang:v{version}-cu130"
    assert "nvidia/pytorch" not in prof.container.image
    for name in ("h100", "h200"):  # CUDA 13 wheels: no CUDA 12 module for them
        assert "cuda/12" not in "".join(load_profile(name).setup)


def test_jobs_requeue_from_the_host(tmp_path: Path) -> None:
    """The batch script exports the request folder, ends every task when one fails, and requeues
    from the host after srun; a task asks for it without any Slurm client."""
    h200 = visible_profile("h200", tmp_path)  # its container also sees what the test lays out
    sub = submit("configs/experiments/tetpo/qwen3_1p7b_grpo.yaml", h200,
                 [f"run_dir={tmp_path / 'r'}", *job_inputs(tmp_path)], entry=TOY,
                 dry_run=True, force=True)
    script = sub.script
    folder = str(tmp_path / "r" / "submitit")
    assert f"export MEGAPKL_REQUEUE_DIR={folder}" in script
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "--container-image=" in srun
    after = script[script.index(srun) + len(srun):]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in after  # on the host, after the tasks
    env = {"PATH": "/nonexistent", "SLURM_JOB_ID": "4242", "MEGAPKL_REQUEUE_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    code = ("from megapkl.launch.runtime import requeue_job; "
            "requeue_job('4242', restart_count=0, max_requeues=3)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert (tmp_path / "requeue.4242").read_text().strip() == "4242"


def test_dedicated_servers_on_several_nodes_need_a_slurm_client(tmp_path: Path) -> None:
    h200, inputs = visible_profile("h200", tmp_path), job_inputs(tmp_path)
    with pytest.raises(ConfigError, match="rollout.sglang.colocate: false starts the SGLang"):
        submit("configs/experiments/tetpo/qwen3_1p7b_grpo.yaml", h200,
               ["rollout.sglang.colocate=false", "slurm.nodes=2", f"run_dir={tmp_path / 'r'}",
                *inputs], entry=TOY, dry_run=True, force=True)
    submit("configs/experiments/tetpo/qwen3_1p7b_grpo.yaml", h200,  # one node: no srun needed
           ["rollout.sglang.colocate=false", f"run_dir={tmp_path / 's'}", *inputs], entry=TOY,
           dry_run=True, force=True)


def test_the_rendezvous_port_is_the_same_in_every_task_and_new_at_each_requeue() -> None:
    """Every task derives MASTER_PORT from the job id and restart count alone (the Slurm run of
    it: test_slurm_async.py), below the ephemeral port range and the servers' base_port."""
    from megapkl.launch.runtime import rendezvous_port

    ports = [[rendezvous_port(str(job), r) for r in range(4)] for job in (7, 1234, 987654)]
    assert all(20000 <= p < 30000 for row in ports for p in row), ports
    assert all(len(set(row)) == 4 for row in ports), ports
    assert [rendezvous_port("1234", r) for r in range(4)] == ports[1]
    assert len({rendezvous_port(str(job), 0) for job in range(1000, 1100)}) == 100  # neighbours
