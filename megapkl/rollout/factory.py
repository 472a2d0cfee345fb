"""Builders of the rollout side from config sections: the tokenizer (one loader for training,
evaluation and diagnostics), the prompt data, and the run's engine (rollout.engine).

Each builder takes its own section(s) and a small context, never the whole run config."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megapkl.config.layout import Layout
from megapkl.rollout.engine import RolloutEngine, RolloutError
# engine_owners (where the run's engines sit) is read by the trainer beside the builders here
from megapkl.rollout.sglang.placement import (check_nodes, engine_owners,  # noqa: F401
                                              releases_memory)


def load_tokenizer(model: Any, data: Any, *, required: bool = True) -> Any:
    """The synthetic task's tokenizer (data.synthetic), else the model's Hugging Face tokenizer
    (model.tokenizer or model.hf_checkpoint, a local directory). Without a source: RolloutError
    when `required`, else None."""
    if data.synthetic:
        from megapkl.rollout.synthetic import make_synthetic_task

        return make_synthetic_task(data.synthetic).tokenizer
    source = model.tokenizer or model.hf_checkpoint
    if not source:
        if not required:
            return None
        raise RolloutError("data.train_path needs a tokenizer: set model.tokenizer or "
                           "model.hf_checkpoint to a local directory")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def run_token_ids(model: Any, spec: Any, tokenizer: Any) -> dict:
    """The stop, pad and BOS ids of the run (megapkl.rollout.tokens) as config.json keys, for
    the engines' model config; {} without a Hugging Face tokenizer (a synthetic task's own)."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return {}
    from megapkl.rollout.tokens import special_ids

    return special_ids(tokenizer, spec.vocab_size,
                       [model.hf_checkpoint, model.tokenizer]).hf_config()


def build_tokenizer_and_data(model: Any, data: Any, max_prompt_len: Optional[int]):
    """(tokenizer, prompt dataset, synthetic task or None) for the data section."""
    from megapkl.rollout.data import build_prompt_dataset

    task = None
    if data.synthetic:
        from megapkl.rollout.synthetic import make_synthetic_task

        task = make_synthetic_task(data.synthetic)
    tokenizer = task.tokenizer if task is not None else load_tokenizer(model, data)
    return tokenizer, build_prompt_dataset(data, tokenizer, max_prompt_len=max_prompt_len), task


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What an engine needs besides the rollout section: the model it serves and where it runs.
    `replica` of `layout.dp`: which trainer replica (data-parallel leader) builds it; launched
    SGLang fleets of different replicas get their own ports, logs and exports under `work_dir`."""
    hf_config: dict                  # the trainer model's HF config (megapkl.models.spec.hf_config_dict)
    work_dir: Path                   # the run directory
    seed: int
    model_dtype: str = "bf16"        # model.dtype: the servers' dtype
    hf_checkpoint: Optional[str] = None   # model.hf_checkpoint: what launched servers load first
    routing_replay: bool = False     # model.routing_replay: servers return routed experts
    device: Any = "cpu"              # the embedded engine's device and dtype
    dtype: Any = None
    replica: int = 0
    # the trainer's layout, its ranks per node included: where launched servers go on the GPUs
    # beside it (rollout/sglang/placement.py)
    layout: Layout = Layout()
    rank: Optional[int] = None       # the global trainer rank building it (None: the replica's
                                     # leader): a colocated fleet is its node's (placement.py)
    # True once the run is stopping (a stop signal or a preemption on this rank): launched servers
    # may have received the same signal, so nobody waits for them any more
    stopping: Callable[[], bool] = lambda: False
    # the environment's stop strings (env section): launched SGLang servers then hold the
    # model's tokenizer (`tokenizer_path`: model.tokenizer or model.hf_checkpoint) to match them
    stop: tuple[str, ...] = ()
    tokenizer_path: Optional[str] = None


def build_engine(rollout: Any, ctx: EngineContext, tokenizer: Any = None,
                 transform: Optional[Callable] = None) -> RolloutEngine:
    """The engine `rollout.engine` names. `transform`: per-bucket weight transform of SGLang syncs
    (identity if None: the trainer already stores and pushes FP8-quantized versions when
    rollout.fp8 is on)."""
    if rollout.engine == "embedded":
        import torch

        from megapkl.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(ctx.hf_config, tokenizer=tokenizer, seed=ctx.seed, device=ctx.device,
                              dtype=ctx.dtype or torch.float32, fp8=rollout.fp8,
                              kv_cache_dtype=rollout.kv_cache_dtype)
    if rollout.engine == "sglang":
        from megapkl.rollout.sglang.build import build_sglang_engine

        return build_sglang_engine(rollout, ctx, tokenizer=tokenizer, transform=transform)
    raise ValueError(f"rollout.engine: unknown engine {rollout.engine!r} (embedded | sglang)")


def check_engine_hosts(rollout: Any, hosts: list[str], per_node: int) -> None:
    """Colocated SGLang servers megapkl launches: the placement's nodes must be the ranks' hosts
    (placement.check_nodes); `hosts[r]`: global rank r's host."""
    sg = rollout.sglang
    if rollout.engine == "sglang" and releases_memory(sg):
        check_nodes(hosts, per_node, gpus=not sg.server_command)


def engine_context(model: Any, hf_config: dict, *, work_dir: Any, seed: int, layout: Layout,
                   device: Any = "cpu", dtype: Any = None, replica: int = 0,
                   rank: Optional[int] = None,
                   stopping: Callable[[], bool] = lambda: False,
                   stop: Sequence[str] = ()) -> EngineContext:
    """The engine context of the model section for a model's HF config mapping; `stop`: the
    environment's stop strings (megapkl.envs.stop_strings)."""
    return EngineContext(hf_config=hf_config, work_dir=Path(work_dir), seed=seed,
                         model_dtype=model.dtype, hf_checkpoint=model.hf_checkpoint,
                         routing_replay=model.routing_replay, device=device, dtype=dtype,
                         replica=replica, layout=layout, rank=rank, stopping=stopping,
                         stop=tuple(stop), tokenizer_path=model.tokenizer or model.hf_checkpoint)


def build_run_engine(rollout: Any, model: Any, spec: Any, tokenizer: Any, *, work_dir: Any,
                     seed: int, layout: Layout, replica: int = 0,
                     stopping: Callable[[], bool] = lambda: False,
                     rank: Optional[int] = None, stop: Sequence[str] = ()) -> RolloutEngine:
    """The run's rollout engine (the rollout section's) for the trainer model `spec` (the model
    section's), on the device and in the dtype the model dtype calls for
    (`megapkl.models.provider.engine_placement`); empty: weights come through update_weights.
    Its model config carries the run's stop, pad and BOS ids (`run_token_ids`); `stop`: the
    environment's stop strings (megapkl.envs.stop_strings), which SGLang servers need the
    tokenizer for."""
    from megapkl.models.provider import engine_placement
    from megapkl.models.spec import hf_config_dict

    device, dtype = engine_placement(model.dtype)
    hf = hf_config_dict(spec, dtype=str(dtype).split(".")[-1],
                        **run_token_ids(model, spec, tokenizer))
    ctx = engine_context(model, hf, work_dir=work_dir, seed=seed, layout=layout, device=device,
                         dtype=dtype, replica=replica, rank=rank, stopping=stopping, stop=stop)
    return build_engine(rollout, ctx, tokenizer)
