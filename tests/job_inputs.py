"""What a run config's job reads, laid out under a test's directory so that `config validate`,
`submit` and `sweep` accept it: a Hugging Face checkpoint directory (config.json, safetensors
file, tokenizer file: the files the checks look for, not a loadable model), a training prompt file
and the prompt file of every prepared eval set.

    overrides = job_inputs(tmp_path)            # model.hf_checkpoint=..., data.train_path=..., ...
    job_inputs(tmp_path, "dapo_math_17k.jsonl")  # the shipped configs' paths from tmp_path
    profile = visible_profile("h200", tmp_path)  # the profile, its container also mounting tmp_path
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def job_inputs(root: Path, train: str = "train.jsonl") -> list[str]:
    """Overrides pointing a run config at checkpoint, prompts (root/data/<train>) and eval sets
    (root/data/eval/, where the shipped configs look for them from the start directory root)
    written under root."""
    from megapkl.data.registry import SOURCES

    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text("{}\n")
    (ckpt / "model.safetensors").write_bytes(b"")
    (ckpt / "tokenizer.json").write_text("{}\n")
    row = json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n"
    train = root / "data" / train
    (root / "data" / "eval").mkdir(parents=True, exist_ok=True)
    train.write_text(row)
    for name, src in SOURCES.items():
        if src.kind == "eval":
            (root / "data" / "eval" / f"{name}.jsonl").write_text(row)
    return [f"model.hf_checkpoint={ckpt}", f"data.train_path={train}",
            f"eval.data_dir={root / 'data' / 'eval'}"]


def visible_profile(name: str, root: Path) -> str:
    """A copy of slurm/profiles/<name>.yaml (same name) whose container also mounts root and the
    repository (the submit directory of the tests), so that the job sees what they lay out."""
    data = yaml.safe_load((REPO / "slurm" / "profiles" / f"{name}.yaml").read_text())
    data["container"]["mounts"] = [*data["container"]["mounts"], str(root), str(REPO)]
    out = root / "profiles" / f"{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data))
    return str(out)
