"""DeepGEMM's first-launch compile of FP8 SGLang servers: how long a start may take, and the mark
that a node's kernel cache is warm.

SGLang 0.5.23 runs block-FP8 linear layers (the 128 x 128 blocks rollout.fp8 serves) with DeepGEMM
whenever DeepGEMM is enabled, i.e. on CUDA SM90+ with `deep_gemm` importable and
SGLANG_ENABLE_JIT_DEEPGEMM on (its default): `_dispatch_auto_backend` in
srt/layers/quantization/fp8_utils.py, `_compute_enable_deep_gemm` in
srt/layers/deep_gemm_wrapper/configurer.py. The first time a GEMM shape runs (the startup warmup),
SGLang compiles that shape's kernels for every M up to 16K (32K-128K with a larger chunked
prefill), ~3K of them with SGLANG_JIT_DEEPGEMM_FAST_WARMUP=1, and warns that this takes
"typically 10-20 mins" (`_maybe_compile_deep_gemm_one_type_all`, `update_deep_gemm_config` in
srt/layers/deep_gemm_wrapper/compile_utils.py); SGLANG_JIT_DEEPGEMM_PRECOMPILE=0 skips it (the
kernels are then compiled one M at a time, at serving). The kernels go to DeepGEMM's cache
(DG_JIT_CACHE_DIR, set to SGLANG_DG_CACHE_DIR, by default $SGLANG_CACHE_DIR/deep_gemm,
~/.cache/sglang/deep_gemm: srt/environ.py), which the servers of a node share: each shape is
compiled once, under a file lock, and a later start loads it (SGLang: "typically 1 sec").

So the first start of an FP8 fleet on a node whose cache is cold may wait up to
`rollout.sglang.compile_timeout_s` (default 3600 s, `sglang.compile_deep_gemm`'s own timeout)
instead of `startup_timeout_s`; once that fleet is healthy, megapkl marks the cache warm for this
model shape, TP/EP size, SGLang version and GPU, and every later start with that key (restarts,
the requeued or resumed job, other fleets launched afterwards) is held to `startup_timeout_s`.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

_SHAPE_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "num_hidden_layers",
               "num_experts", "moe_intermediate_size", "num_experts_per_tok")


def _off(env: Mapping[str, str], name: str) -> bool:
    """SGLang's EnvBool false (environ.py: false/0/no/n)."""
    return env.get(name, "").strip().lower() in ("false", "0", "no", "n")


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """DeepGEMM's kernel cache as SGLang sets it for the servers (which inherit `env`)."""
    if env.get("SGLANG_DG_CACHE_DIR"):
        return Path(env["SGLANG_DG_CACHE_DIR"]).expanduser()
    base = env.get("SGLANG_CACHE_DIR") or "~/.cache/sglang"
    return Path(base).expanduser() / "deep_gemm"


def precompiles(fp8: bool, env: Mapping[str, str] = os.environ) -> bool:
    """Will an SGLang server of this run precompile DeepGEMM kernels at its start, as far as the
    config and environment tell (a GPU without DeepGEMM simply starts sooner)?"""
    return bool(fp8) and not _off(env, "SGLANG_ENABLE_JIT_DEEPGEMM") \
        and not _off(env, "SGLANG_JIT_DEEPGEMM_PRECOMPILE")


def warm_key(hf_config: Mapping[str, Any], tp: int, ep: int) -> str:
    """What the compiled kernels depend on: the GEMM shapes (the model's dimensions, split by TP
    and EP), SGLang's version, the GPU."""
    try:
        from importlib.metadata import version

        sglang = version("sglang")
    except Exception:  # noqa: BLE001 - not installed here (a stand-in server)
        sglang = "none"
    gpu = "none"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001
        pass
    shape = {k: hf_config.get(k) for k in _SHAPE_KEYS if hf_config.get(k) is not None}
    text = json.dumps({"shape": shape, "tp": tp, "ep": ep, "sglang": sglang, "gpu": gpu},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def startup_deadline(sg: Any, fp8: bool, hf_config: Mapping[str, Any],
                     env: Mapping[str, str] = os.environ) -> tuple[float, Optional[Path]]:
    """(how long the fleet's first start may take, the mark to leave once it is healthy or None).
    `sg`: the rollout.sglang section."""
    if not precompiles(fp8, env):
        return sg.startup_timeout_s, None
    mark = cache_dir(env) / "megapkl-warm" / warm_key(hf_config, sg.tp, sg.ep)
    if mark.is_file():
        return sg.startup_timeout_s, None
    return max(sg.compile_timeout_s, sg.startup_timeout_s), mark


def mark_warm(mark: Optional[Path]) -> None:
    """The fleet started: its kernels are in the cache (best effort: a read-only cache stays cold,
    and every start then gets compile_timeout_s)."""
    if mark is None:
        return
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text("compiled by a healthy SGLang start\n")
    except OSError:
        pass
