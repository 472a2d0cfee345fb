"""`build_engine`: the rollout engine a run config asks for (rollout.engine)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from megapkl.rollout.engine import RolloutEngine


def build_engine(cfg: Any, hf_config: dict, tokenizer: Any = None,
                 transform: Optional[Callable] = None, *, device: Any = "cpu",
                 dtype: Any = None, replica: int = 0, replicas: int = 1) -> RolloutEngine:
    """`hf_config`: the trainer model's HF config mapping (`megapkl.models.spec.hf_config_dict`).
    `transform`: per-bucket weight transform for SGLang syncs (the FP8 seam; identity if None:
    the trainer already stores and pushes FP8-quantized versions when rollout.fp8 is on).
    `device`/`dtype`: where the embedded engine computes (megapkl.models.provider.engine_placement).
    `replica` of `replicas`: which trainer replica (data-parallel leader) builds it; launched SGLang
    fleets of different replicas get their own ports, logs and exports."""
    engine = cfg.rollout.engine
    if engine == "embedded":
        from megapkl.rollout.embedded import EmbeddedEngine

        import torch

        return EmbeddedEngine(hf_config, tokenizer=tokenizer, seed=cfg.seed, device=device,
                              dtype=dtype or torch.float32, fp8=cfg.rollout.fp8,
                              kv_cache_dtype=cfg.rollout.kv_cache_dtype)
    if engine == "sglang":
        from megapkl.rollout.sglang.build import build_sglang_engine

        return build_sglang_engine(cfg, hf_config, tokenizer=tokenizer, transform=transform,
                                   replica=replica, replicas=replicas)
    raise ValueError(f"rollout.engine: unknown engine {engine!r} (embedded | sglang)")
