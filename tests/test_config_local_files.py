"""The files a run reads from the machine it starts on are checked where the user asks for a
verdict (`config validate`, `plan`, `submit`, `train`), never by `config show` or a library
load: model.hf_checkpoint must be a checkpoint directory there (weights are never downloaded at
run time), a prompt file needs a tokenizer, the training and evaluation prompt files must exist
and parse, and a container job must see every path it reads through the profile's mounts."""
import json
from pathlib import Path

import pytest
from job_inputs import job_inputs, visible_profile

from megapkl.cli import main
from megapkl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
PKL = ROOT / "configs" / "experiments" / "pkl_periodic" / "qwen3_1p7b_pkl.yaml"
DEMO = ROOT / "configs" / "demo" / "cpu_demo.yaml"
TOY = "megapkl.launch.toy:run"
ROW = {"prompt": "What is 1 + 1?", "answer": "2"}
EVAL_SETS = ("math500", "olympiadbench", "minerva_math", "gaokao2023en", "aime24", "aime25",
             "amc23", "amc24")


def checkpoint(path: Path, *files: str) -> Path:
    """A directory holding `files` (empty: the checks look at names, the loader at contents)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in files:
        (path / f).write_text("{}\n" if f.endswith(".json") else "")
    return path


def workspace(root: Path) -> Path:
    """What PKL's job reads, where its config puts it relative to the start directory: the
    checkpoint ckpt/ (with its tokenizer), data/dapo_math_17k.jsonl and data/eval/<set>.jsonl."""
    checkpoint(root / "ckpt", "config.json", "model.safetensors", "tokenizer.json")
    (root / "data" / "eval").mkdir(parents=True, exist_ok=True)
    for rel in ["dapo_math_17k.jsonl", *(f"eval/{n}.jsonl" for n in EVAL_SETS)]:
        (root / "data" / rel).write_text(json.dumps(ROW) + "\n")
    return root / "ckpt"


def test_a_hub_id_is_refused_at_the_line_that_sets_it(tmp_path):
    load_config(PKL)  # a library load or `config show` checks no files
    with pytest.raises(ConfigError) as e:
        load_config(PKL, workdir=tmp_path)
    err = e.value
    assert (err.key, Path(err.source).name, err.line) == ("model.hf_checkpoint", "_qwen3_1p7b.yaml", 6)
    assert "'Qwen/Qwen3-1.7B-Base'" in str(err) and "never downloads" in str(err)
    assert "hf download Qwen/Qwen3-1.7B-Base --local-dir /models/Qwen3-1.7B-Base" in str(err)


def test_local_directories_relative_to_the_start_directory(tmp_path):
    workspace(tmp_path)
    cfg = load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    assert cfg.model.hf_checkpoint == "ckpt"
    with pytest.raises(ConfigError, match=r"<override>: model.hf_checkpoint: 'ckpt' is not a "
                                          r"directory here \(from .*\): megapkl never downloads"):
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path / "elsewhere")
    missing = tmp_path / "none"
    with pytest.raises(ConfigError, match=f"'{missing}' is not a directory here: "):
        load_config(PKL, [f"model.hf_checkpoint={missing}"], workdir=tmp_path)
    with pytest.raises(ConfigError, match=r"model.tokenizer: 'Qwen/Qwen3-1.7B' is not a directory "
                                          r"here but a Hugging Face Hub id"):
        load_config(PKL, ["model.hf_checkpoint=ckpt", "model.tokenizer=Qwen/Qwen3-1.7B"],
                    workdir=tmp_path)


def test_a_prompt_file_needs_a_tokenizer(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(PKL, ["model.hf_checkpoint=null"], workdir=tmp_path)
    assert e.value.key == "data.train_path" and Path(e.value.source).name == "default.yaml"
    assert "set model.hf_checkpoint or model.tokenizer" in str(e.value)
    workspace(tmp_path)
    checkpoint(tmp_path / "tok", "tokenizer_config.json")
    load_config(PKL, ["model.hf_checkpoint=null", f"model.tokenizer={tmp_path / 'tok'}"],
                workdir=tmp_path)
    load_config(DEMO, workdir=tmp_path)  # random init on a synthetic task: nothing to read


@pytest.mark.parametrize("argv", [["config", "validate", str(PKL)], ["plan", str(PKL)],
                                  ["plan", str(PKL), "--profile", "h100"],
                                  ["submit", str(PKL), "--profile", "h100", "--dry-run"],
                                  ["sweep", str(PKL), "--profile", "h100", "--dry-run",
                                   "--grid", "seed=1,2"],
                                  ["train", str(PKL)]],
                         ids=["validate", "plan", "plan-profile", "submit", "sweep", "train"])
def test_every_command_that_gives_a_verdict_refuses_it(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "_qwen3_1p7b.yaml:6: model.hf_checkpoint:" in err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


# ---- the checkpoint directory


def test_an_empty_checkpoint_directory_is_refused(tmp_path):
    workspace(tmp_path)
    checkpoint(tmp_path / "empty")
    with pytest.raises(ConfigError) as e:
        load_config(PKL, ["model.hf_checkpoint=empty"], workdir=tmp_path)
    assert (e.value.key, e.value.source) == ("model.hf_checkpoint", "<override>")
    assert "'empty' is not a Hugging Face checkpoint: no config.json; no *.safetensors weights" \
        in str(e.value)
    checkpoint(tmp_path / "bin", "config.json", "pytorch_model.bin", "tokenizer.json")
    with pytest.raises(ConfigError, match=r"'bin' is not a Hugging Face checkpoint: only "
                                          r"pytorch_model.bin \(megapkl reads safetensors"):
        load_config(PKL, ["model.hf_checkpoint=bin"], workdir=tmp_path)


def test_a_checkpoint_with_config_and_safetensors_is_accepted(tmp_path):
    workspace(tmp_path)
    for name, weights in (("single", "model.safetensors"),
                          ("sharded", "model.safetensors.index.json")):
        ckpt = checkpoint(tmp_path / name, "config.json", weights, "tokenizer.json")
        assert load_config(PKL, [f"model.hf_checkpoint={ckpt}"],
                           workdir=tmp_path).model.hf_checkpoint == str(ckpt)


def test_the_tokenizer_directory_must_hold_a_tokenizer(tmp_path):
    workspace(tmp_path)
    checkpoint(tmp_path / "notok", "config.json", "model.safetensors")
    with pytest.raises(ConfigError, match=r"<override>: model.hf_checkpoint: 'notok' holds no "
                                          r"tokenizer \(tokenizer.json or tokenizer_config.json\)"):
        load_config(PKL, ["model.hf_checkpoint=notok"], workdir=tmp_path)
    checkpoint(tmp_path / "tok")
    with pytest.raises(ConfigError, match=r"<override>: model.tokenizer: 'tok' holds no tokenizer"):
        load_config(PKL, ["model.hf_checkpoint=ckpt", "model.tokenizer=tok"], workdir=tmp_path)


def test_plan_needs_no_weights_and_no_data(tmp_path, monkeypatch, capsys):
    """`megapkl plan` sizes the job from the model preset: an empty checkpoint directory and
    prompt files not prepared yet pass; a prompt file that is there must still parse."""
    checkpoint(tmp_path / "empty")
    load_config(PKL, ["model.hf_checkpoint=empty"], workdir=tmp_path, tokenizes=False)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(PKL), "model.hf_checkpoint=null", "--profile", "h100"]) == 0
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dapo_math_17k.jsonl").write_text("{oops\n")
    assert main(["plan", str(PKL), "model.hf_checkpoint=null", "--profile", "h100"]) == 2
    assert "data/dapo_math_17k.jsonl:1: not JSON" in capsys.readouterr().err


# ---- the prompt files


def test_a_missing_training_file_is_refused(tmp_path, capsys):
    workspace(tmp_path)
    (tmp_path / "data" / "dapo_math_17k.jsonl").unlink()
    with pytest.raises(ConfigError) as e:
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    err = e.value
    assert (err.key, Path(err.source).name, err.line) == ("data.train_path", "default.yaml", 58)
    assert f"'data/dapo_math_17k.jsonl' is not a file here (from {tmp_path.resolve()}): " \
           "prepare it (`megapkl data prepare" in str(err)


def test_a_bad_jsonl_line_is_refused_with_its_file_and_line(tmp_path):
    workspace(tmp_path)
    train = tmp_path / "data" / "dapo_math_17k.jsonl"
    lines = [json.dumps(ROW), "", json.dumps(ROW), '{"prompt": "2 + 2?", "answer": 4']
    train.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    assert e.value.key == "data.train_path"
    assert "data/dapo_math_17k.jsonl:4: not JSON (Expecting ',' delimiter at column" in str(e.value)
    train.write_text(json.dumps(ROW) + "\n" + json.dumps({"prompt": "2 + 2?"}) + "\n")
    with pytest.raises(ConfigError, match=r"dapo_math_17k.jsonl:2: missing answer field 'answer'"):
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    # the reader's own fields: a nested prompt key walks the row, as megapkl.rollout.data does
    train.write_text(json.dumps({"q": {"text": "2 + 2?"}, "answer": 4}) + "\n")
    load_config(PKL, ["model.hf_checkpoint=ckpt", "data.prompt_key=q.text"], workdir=tmp_path)
    with pytest.raises(ConfigError, match=r"jsonl:1: missing prompt field 'prompt'"):
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    train.write_text("\n\n")
    with pytest.raises(ConfigError, match=r"dapo_math_17k.jsonl: holds no prompts"):
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)


def test_the_reader_refuses_what_the_check_refuses(tmp_path):
    """The check mirrors megapkl.rollout.data's reader (a lower layer cannot call it): the rows it
    refuses the reader refuses at the same line, and its synthetic task names are the reader's."""
    from megapkl.config.local_files import SYNTHETIC_TASK_NAMES, prompt_file_problem
    from megapkl.rollout.data import DataError, read_jsonl
    from megapkl.rollout.synthetic import SYNTHETIC_TASKS

    assert SYNTHETIC_TASK_NAMES == set(SYNTHETIC_TASKS)
    rows = ['[1, 2]', '{"prompt": "", "answer": "1"}', '{"prompt": "x", "answer": true}',
            '{"prompt": "x", "answer": [1]}', '{"answer": "1"}', '\xff', '{"prompt": 3}']
    for i, row in enumerate(rows):
        f = tmp_path / f"{i}.jsonl"
        f.write_bytes(json.dumps(ROW).encode() + b"\n" + row.encode("latin-1") + b"\n")
        problem = prompt_file_problem(f, str(f), "prompt", "answer")
        with pytest.raises(DataError) as e:
            read_jsonl(str(f))
        assert problem and problem.startswith(f"{f}:2: ") and str(e.value).startswith(f"{f}:2: ")


def test_evaluation_files_are_checked_only_when_evaluation_runs(tmp_path):
    workspace(tmp_path)
    (tmp_path / "data" / "eval" / "aime24.jsonl").write_text(json.dumps(ROW) + "\n[]\n")
    with pytest.raises(ConfigError) as e:
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    assert e.value.key == "eval.benchmarks[4]"  # attributed to eval.every, which turns it on
    assert (Path(e.value.source).name, e.value.line) == ("default.yaml", 69)
    assert "data/eval/aime24.jsonl:2: expected a JSON object, got list" in str(e.value)
    (tmp_path / "data" / "eval" / "aime24.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"'data/eval/aime24.jsonl' is not a file here .*"
                                          r"`megapkl data prepare aime24 --out data/eval`"):
        load_config(PKL, ["model.hf_checkpoint=ckpt"], workdir=tmp_path)
    load_config(PKL, ["model.hf_checkpoint=ckpt", "eval.every=0"], workdir=tmp_path)
    own = tmp_path / "mine.jsonl"
    mine = f"eval.benchmarks=[{{name: x, path: {own}}}]"
    with pytest.raises(ConfigError) as e:
        load_config(PKL, ["model.hf_checkpoint=ckpt", mine], workdir=tmp_path)
    assert (e.value.key, e.value.source) == ("eval.benchmarks[0].path", "<override>")
    own.write_text(json.dumps(ROW) + "\n")
    load_config(PKL, ["model.hf_checkpoint=ckpt", mine], workdir=tmp_path)
    load_config(PKL, ["model.hf_checkpoint=ckpt", "eval.benchmarks=[next_mod10]"],
                workdir=tmp_path)  # a synthetic task: no file


# ---- what a container job sees


def test_a_container_job_must_see_every_path_it_reads(tmp_path, tmp_path_factory, capsys):
    """The h200 profile's container sees only its mounts: a checkpoint the host check finds but
    the container does not is refused by submit, naming the key, the path, profile and mounts."""
    from megapkl.launch.submit import LaunchError, container_paths, submit

    inputs = job_inputs(tmp_path)
    h200 = visible_profile("h200", tmp_path)  # mounts /shared, /home, tmp_path and the repo
    run = [f"run_dir={tmp_path / 'run'}"]
    sub = submit(PKL, h200, [*inputs, *run], entry=TOY, dry_run=True, force=True)
    assert "--container-mounts=/shared:/shared,/home:/home," in sub.script
    outside = checkpoint(tmp_path_factory.mktemp("models") / "Qwen3-1.7B-Base", "config.json",
                         "model.safetensors", "tokenizer.json")
    with pytest.raises(ConfigError) as e:
        submit(PKL, h200, [*inputs, *run, f"model.hf_checkpoint={outside}"], entry=TOY,
               dry_run=True, force=True)
    assert (e.value.key, e.value.source) == ("model.hf_checkpoint", "<override>")
    assert f"'{outside}' is not visible to the job: profile h200 runs the job in a container " \
           f"that sees only its mounts (/shared:/shared, /home:/home, {tmp_path}, " in str(e.value)
    for key, value in (("run_dir", outside.parent / "run"),
                       ("checkpoint.resume", outside.parent / "step_00000010")):
        with pytest.raises(ConfigError) as e:
            submit(PKL, h200, [*inputs, *run, f"{key}={value}"], entry=TOY, dry_run=True,
                   force=True)
        assert e.value.key == key and f"'{value}' is not visible to the job" in str(e.value)
    argv = ["submit", str(PKL), "--profile", h200, *inputs, *run,
            f"model.hf_checkpoint={outside}", "--dry-run", "--force"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "<override>: model.hf_checkpoint: " in err
    with pytest.raises(LaunchError, match=r"the submit directory .* is not visible to the job"):
        submit(PKL, h200, [*inputs, *run], entry=TOY, dry_run=True, force=True,
               cwd=outside.parent)
    from megapkl.launch.sweep import sweep  # a sweep's elements are checked as submit's job
    with pytest.raises(ConfigError) as e:
        sweep(PKL, h200, ["seed=1,2"], [*inputs, *run, f"model.hf_checkpoint={outside}"],
              entry=TOY, dry_run=True)
    assert e.value.key == "model.hf_checkpoint" and "is not visible to the job" in str(e.value)
    sweep(PKL, h200, ["seed=1,2"], [*inputs, *run], entry=TOY, dry_run=True)
    submit(PKL, "h100", [*inputs, *run, f"model.hf_checkpoint={outside}"], entry=TOY,
           dry_run=True, force=True)  # no container: the nodes see the host's paths
    assert container_paths(_container_profile(["/a:/b:ro", "/c", "/d:/e"])) == \
        [Path("/b"), Path("/c"), Path("/e")]


def _container_profile(mounts):
    from megapkl.launch.profile import ClusterProfile, ContainerConfig

    return ClusterProfile(partition="p", container=ContainerConfig(image="i", mounts=mounts))
