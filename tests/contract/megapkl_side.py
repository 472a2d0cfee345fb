"""megapkl's side of the contract tests: the artefacts a run produces, made by megapkl's own code
paths (no SGLang import here).

`launched(...)` runs `build.launch_fleet` for a run config with process start and health waiting
left out, and returns what would have been started: each server's argument list and environment,
the router's argument list, and the served model directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

TINY = ["model.hf_checkpoint=null", "model.num_layers=null", "model.num_experts=null",
        "rollout.max_prompt_len=16", "rollout.max_response_len=16", "rollout.engine=sglang",
        "slurm.nodes=null", "slurm.gpus_per_node=null"]

# The variants users run (configs/base/default.yaml is FP8 + BF16 KV, colocated).
VARIANTS: dict[str, list[str]] = {
    "default_fp8_colocated": ["model.name=tiny-qwen3"],
    "bf16_separate_gpus": ["model.name=tiny-qwen3", "rollout.fp8=false",
                           "rollout.kv_cache_dtype=auto", "rollout.sglang.colocate=false"],
    "moe_r3_tp2_ep2": ["model.name=tiny-qwen3-moe", "model.routing_replay=true",
                       "rollout.sglang.tp=2", "rollout.sglang.ep=2",
                       "rollout.sglang.num_engines=2"],
    "moe_fp8_context": ["model.name=tiny-qwen3-moe", "rollout.sglang.context_length=256",
                        "rollout.sglang.colocate=false"],
}


@dataclass
class Launch:
    cfg: Any
    hf_config: dict
    servers: list[tuple[list[str], dict]] = field(default_factory=list)  # (argv, env) each
    router: list[str] = field(default_factory=list)

    def sglang_argv(self, i: int = 0) -> list[str]:
        """Server i's arguments after `python -m sglang.launch_server`."""
        argv = self.servers[i][0]
        k = argv.index("sglang.launch_server")
        assert argv[k - 1] == "-m", argv
        return argv[k + 1:]

    @property
    def model_dir(self) -> Path:
        argv = self.sglang_argv()
        return Path(argv[argv.index("--model-path") + 1])


def load_variant(name: str, run_dir: Path, extra: tuple[str, ...] = ()):
    from megapkl.config import load_config

    return load_config(REPO / "configs/base/default.yaml",
                       [*TINY, *VARIANTS[name], f"run_dir={run_dir}", *extra])


# The EOS id of the run's tokenizer, which the trainer hands to `launch_fleet` (a run without a
# checkpoint config.json declaring one and without a tokenizer is refused before any launch).
TOKENIZER_EOS = 2


def launched(name: str, run_dir: Path, monkeypatch: pytest.MonkeyPatch,
             extra: tuple[str, ...] = (), tokenizer_eos: Any = TOKENIZER_EOS) -> Launch:
    """What `launch_fleet` starts for variant `name` (nothing is started)."""
    from types import SimpleNamespace

    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.sglang import build
    from megapkl.rollout.sglang.launch import ServerProcess

    cfg = load_variant(name, run_dir, extra)
    hf_config = {**hf_config_dict(load_spec(cfg.model.name), dtype="bfloat16")}
    started: list[ServerProcess] = []

    def start(self: ServerProcess) -> ServerProcess:
        started.append(self)
        return self

    monkeypatch.setattr(ServerProcess, "start", start)
    monkeypatch.setattr(ServerProcess, "alive", lambda self: True)
    monkeypatch.setattr(build, "_wait_all", lambda *a, **k: None)
    tokenizer = None if tokenizer_eos is None else SimpleNamespace(eos_token_id=tokenizer_eos)
    fleet = build.launch_fleet(cfg, hf_config, Path(run_dir) / "sglang", tokenizer=tokenizer)
    out = Launch(cfg, hf_config)
    for p in started:
        if p.name == "router":
            out.router = list(p.cmd)
        else:
            out.servers.append((list(p.cmd), dict(p.env)))
    fleet.router = None  # nothing was started: nothing to stop
    for w in fleet.workers:
        w.process = None
    fleet.close()
    return out


def model_config_json(launch: Launch) -> dict:
    return json.loads((launch.model_dir / "config.json").read_text())
