"""The files a run reads from the machine it starts on are checked where the user asks for a
verdict (`config validate`, `plan`, `submit`, `train`), never by `config show` or a library
load: model.hf_checkpoint / model.tokenizer must be directories there (weights are never
downloaded at run time), and a prompt file needs one of them for its tokenizer."""
from pathlib import Path

import pytest

from megapkl.cli import main
from megapkl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
PKL = ROOT / "configs" / "experiments" / "pkl_periodic" / "qwen3_1p7b_pkl.yaml"
DEMO = ROOT / "configs" / "demo" / "cpu_demo.yaml"


def test_a_hub_id_is_refused_at_the_line_that_sets_it(tmp_path):
    load_config(PKL)  # a library load or `config show` checks no files
    with pytest.raises(ConfigError) as e:
        load_config(PKL, workdir=tmp_path)
    err = e.value
    assert (err.key, Path(err.source).name, err.line) == ("model.hf_checkpoint", "_qwen3_1p7b.yaml", 6)
    assert "'Qwen/Qwen3-1.7B-Base'" in str(err) and "never downloads" in str(err)
    assert "hf download Qwen/Qwen3-1.7B-Base --local-dir /models/Qwen3-1.7B-Base" in str(err)


def test_local_directories_relative_to_the_start_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
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
    (tmp_path / "tok").mkdir()
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
