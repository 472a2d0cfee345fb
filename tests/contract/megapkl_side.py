"""megapkl's side of the contract tests: the artefacts a run produces, made by megapkl's own code
paths (no SGLang import here).

`launched(...)` runs `build.launch_fleet` for a run config with process start and health waiting
left out, in the environment the cluster launcher gives a data-parallel leader of the job, and
returns what would have been started: each server's argument list and environment, the router's
argument list, and the served model directory. `launched_node(...)` does so for every replica.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

# Every variant runs as a one-node job of NODE_GPUS GPUs, the trainer one process per GPU it trains
# on (as configs/experiments/ fragments set slurm.nodes x slurm.gpus_per_node).
NODE = "gpu-node-001"
NODE_GPUS = 8
TINY = ["model.hf_checkpoint=null", "model.num_layers=null", "model.num_experts=null",
        "rollout.max_prompt_len=16", "rollout.max_response_len=16", "rollout.engine=sglang",
        "slurm.nodes=1", f"slurm.gpus_per_node={NODE_GPUS}"]

# The variants users run (configs/base/default.yaml is FP8 + BF16 KV, colocated), each with the
# trainer layout and fleet of a real job on that node.
VARIANTS: dict[str, list[str]] = {
    # 4 replicas of context-parallel 2, two 1-GPU servers on each replica's 2 GPUs (the 1.7B runs)
    "default_fp8_colocated": ["model.name=tiny-qwen3", "parallel.context=2",
                              "rollout.sglang.num_engines=2"],
    # 2 replicas of TP 2 on GPUs 0-3, two 1-GPU servers each on GPUs of their own (4-7)
    "bf16_separate_gpus": ["model.name=tiny-qwen3", "rollout.fp8=false",
                           "rollout.kv_cache_dtype=auto", "rollout.sglang.colocate=false",
                           "parallel.tensor=2", "rollout.sglang.num_engines=2"],
    # 2 replicas of TP 2 x PP 2 (a replica's GPUs are not consecutive: {0,1,4,5} and {2,3,6,7}),
    # two TP 2 / EP 2 servers on each
    "moe_r3_tp2_ep2": ["model.name=tiny-qwen3-moe", "model.routing_replay=true",
                       "parallel.tensor=2", "parallel.sequence_parallel=true",
                       "parallel.pipeline=2", "parallel.expert=2",
                       "rollout.sglang.tp=2", "rollout.sglang.ep=2",
                       "rollout.sglang.num_engines=2"],
    # 4 data-parallel replicas (expert parallel 4) on GPUs 0-3, one server each on GPUs 4-7
    "moe_fp8_context": ["model.name=tiny-qwen3-moe", "parallel.expert=4",
                        "rollout.sglang.context_length=256", "rollout.sglang.colocate=false"],
    # Llama (tied embeddings, llama3 RoPE): 8 replicas, one FP8 server each, colocated
    "llama_fp8_colocated": ["model.name=tiny-llama"],
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


def leader_env(cfg: Any, rank: int) -> dict[str, str]:
    """What the cluster launcher (submitit under sbatch, as `megapkl submit` runs a job) exports
    in trainer rank `rank` of the one-node job: Slurm's job variables, then torch.distributed's."""
    world = cfg.world_size
    assert world is not None and 0 <= rank < world, (world, rank)
    return {"SLURM_JOB_NODELIST": NODE, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
            "SLURM_NTASKS": str(world), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": str(NODE_GPUS),
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": NODE, "MASTER_PORT": "29500"}


def launched(name: str, run_dir: Path, monkeypatch: pytest.MonkeyPatch,
             extra: tuple[str, ...] = (), tokenizer_eos: Any = TOKENIZER_EOS,
             replica: int = 0, leader_rank: int = 0, token_ids: Any = None) -> Launch:
    """What `launch_fleet` starts for variant `name` in data-parallel replica `replica`, whose
    leader is trainer rank `leader_rank` (nothing is started). `token_ids`: the run's special
    ids as the trainer puts them into the model's HF config (`rollout.factory.run_token_ids`)."""
    from types import SimpleNamespace

    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.sglang import build
    from megapkl.rollout.sglang.launch import ServerProcess

    cfg = load_variant(name, run_dir, extra)
    for key, value in leader_env(cfg, leader_rank).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the job sees its node's GPUs
    hf_config = hf_config_dict(load_spec(cfg.model.name), dtype="bfloat16", **(token_ids or {}))
    started: list[ServerProcess] = []

    def start(self: ServerProcess) -> ServerProcess:
        started.append(self)
        return self

    monkeypatch.setattr(ServerProcess, "start", start)
    monkeypatch.setattr(ServerProcess, "alive", lambda self: True)
    monkeypatch.setattr(build, "_wait_all", lambda *a, **k: {})  # every one healthy, none moved
    tokenizer = None if tokenizer_eos is None else SimpleNamespace(eos_token_id=tokenizer_eos)
    replicas = cfg.parallel.data
    work = Path(run_dir) / "sglang" / (f"replica{replica}" if replicas > 1 else "")
    from engine_contexts import context_of

    ctx = context_of(cfg, hf_config, replica=replica, replicas=replicas)
    fleet = build.launch_fleet(cfg.rollout, ctx, hf_config, work, tokenizer=tokenizer)
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


def replica_ranks(cfg: Any) -> list[list[int]]:
    """The trainer ranks of each data-parallel replica, as megatron-core's own rank generator
    orders them for the layout (megapkl's order, tp-cp-ep-dp-pp)."""
    import warnings

    with warnings.catch_warnings():  # megatron-core's notes on missing Transformer Engine / Apex
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator
    par = cfg.parallel
    gen = RankGenerator(tp=par.tensor, ep=1, dp=par.data, pp=par.pipeline, cp=par.context,
                        order="tp-cp-ep-dp-pp")
    return gen.get_ranks("tp-cp-pp")


def launched_node(name: str, run_dir: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> list[tuple[list[int], Launch]]:
    """(trainer ranks of replica d, what replica d's leader launches) for every replica of the
    job, each in its leader's environment (its first rank: tensor, context and pipeline rank 0)."""
    cfg = load_variant(name, run_dir)
    return [(ranks, launched(name, run_dir, monkeypatch, replica=d, leader_rank=min(ranks)))
            for d, ranks in enumerate(replica_ranks(cfg))]


def model_config_json(launch: Launch) -> dict:
    return json.loads((launch.model_dir / "config.json").read_text())
