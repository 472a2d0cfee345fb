"""`megapkl diagnose correction-variance` on every paper run config as configured, the way
tests/eval/test_one_process.py walks `megapkl eval`: diagnose's own reshaping to one process
(placement on a CPU machine and on an 8 x H200 node), then its weight push into the server that
config starts.

The server is `megapkl serve`'s own state (what its weight routes call, HTTP aside) built from the
model directory the launcher hands SGLang for that config (`served_model_dir`: under rollout.fp8
its config.json carries the block-FP8 quantization_config, and the server then takes FP8 weights
only, as SGLang's FP8 parameters do). The model is the config's family's tiny twin (configs/models/
tiny-qwen3*.yaml, tiny-llama.yaml): every other key is the config's own. Diagnose once pushed the learner's weights
unquantized, which every FP8 server refused (HTTP 400, 'expects float8_e4m3fn')."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megapkl.analysis import diagnose, eval_cli
from megapkl.eval.runner import EvalError

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(p for p in (REPO / "configs" / "experiments").rglob("*.yaml")
              if not p.name.startswith("_"))
MACHINES = {"cpu": (0, None), "8xh200": (8, 141.0)}
# a Learner with its optimizer on one 141 GB GPU
LEARNER_FITS = ("qwen3-1.7b", "qwen3-4b", "llama3.2-3b-instruct")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (checkpoint directory, its weights as the learner exports them: HF names)."""
    sys.path.insert(0, str(REPO / "tests" / "models"))
    try:
        from tiny_models import make_checkpoint, make_llama_checkpoint
    finally:
        sys.path.remove(str(REPO / "tests" / "models"))
    from megapkl.rollout.embedded import iter_safetensors

    out = {}
    for family in ("qwen3", "qwen3_moe", "llama"):
        path = tmp_path_factory.mktemp(family)
        if family == "llama":
            make_llama_checkpoint(str(path))
        else:
            make_checkpoint(str(path), moe=family == "qwen3_moe", seed=0, eos_token_id=2)
        out[family] = path, list(iter_safetensors(path))
    return out


def placed(path: Path, machine: str, monkeypatch):
    """diagnose's config of run config `path` on `machine` (the command's defaults: 16 x 16)."""
    monkeypatch.setattr(eval_cli, "this_machine", lambda: MACHINES[machine])
    return diagnose._config(path, [], 16, 16, None)


class Server:
    """The engine of the placed config as `megapkl serve` holds it; update_weights is its load."""

    def __init__(self, cfg, checkpoint: Path, work: Path):
        from megapkl.rollout.sglang.build import served_model_dir
        from megapkl.serve.serve_state import InterruptibleEngine, ServeState

        hf = json.loads((checkpoint / "config.json").read_text())
        model, _ = served_model_dir(cfg.rollout, SimpleNamespace(hf_checkpoint=str(checkpoint)),
                                    hf, work)
        self.fp8 = "quantization_config" in json.loads((Path(model) / "config.json").read_text())
        engine = InterruptibleEngine(model, dtype=__import__("torch").float32)
        self.state = ServeState(engine, model_path=model, served_model_name=model)
        self.version = None

    def update_weights(self, named, version: int) -> None:
        self.state.load(named)
        self.version = version


@pytest.mark.parametrize("path", RUNS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_diagnose_places_and_pushes_every_paper_run(path, tiny, tmp_path, monkeypatch):
    cfg = placed(path, "cpu", monkeypatch)
    assert cfg.parallel.data == 1 and cfg.rollout.prompts_per_batch == 16
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang.num_engines == 1
    name = cfg.model.name
    if name in LEARNER_FITS:
        placed(path, "8xh200", monkeypatch)
    else:
        with pytest.raises(EvalError, match=f"diagnose: {name} needs about"):
            placed(path, "8xh200", monkeypatch)
    from megapkl.models.spec import load_spec

    checkpoint, weights = tiny[load_spec(name).family]
    server = Server(cfg, checkpoint, tmp_path)
    assert server.fp8 == cfg.rollout.fp8  # the server runs what the config says
    eval_cli.push_weights(server, cfg, iter(weights), 1)  # diagnose's push (and eval's)
    assert server.version == 1


def test_the_walk_covers_both_weight_formats():
    from megapkl.config import load_config

    fp8 = sum(load_config(p).rollout.fp8 for p in RUNS)
    assert len(RUNS) == 107 and 0 < fp8 < len(RUNS)

