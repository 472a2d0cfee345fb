"""Is a server someone else started (`rollout.sglang.urls`) serving what this run expects?

megapkl launches its own servers with the flags the config asks for; servers named by `urls` were
started by hand, and a mismatch there fails late and obscurely: a `--tp-size` other than
`rollout.sglang.tp` makes the distributed weight-update group wait for ranks that never come (it
counts 1 + tp ranks per server) until `sync_timeout_s`; a server without
`--enable-return-routed-experts` gives an R3 run no routing to replay; another model fails at the
first weight push, or worse, loads. So before the first request each server's `/server_info` (its
resolved launch arguments) and `/model_info` are read and compared with the run's config, and a
mismatch is refused in one line naming the URL's key and the config key to change.

Not checked: FP8 weights (SGLang resolves block-FP8 from the served model's config.json and
reports `quantization: null` either way), the expert-parallel size (weights go to every rank
whatever it is), and anything a server does not report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.launch import ServerLaunchError


@dataclass(frozen=True)
class Expected:
    """What the run's config asks of every server."""

    tp: int                          # rollout.sglang.tp
    kv_cache_dtype: str              # rollout.kv_cache_dtype
    routed_experts: bool             # model.routing_replay
    context_length: Optional[int]    # rollout.sglang.context_length (None: the model's)
    architectures: tuple[str, ...]   # the trainer model's HF `architectures`
    tokenizer: bool = False          # the environment's stop strings (env.stop) need one


def expected(rollout: Any, ctx: Any) -> Expected:
    """From the rollout section and the engine context (megapkl.rollout.factory.EngineContext)."""
    return Expected(tp=rollout.sglang.tp, kv_cache_dtype=rollout.kv_cache_dtype,
                    routed_experts=bool(ctx.routing_replay),
                    context_length=rollout.sglang.context_length,
                    architectures=tuple(ctx.hf_config.get("architectures") or ()),
                    tokenizer=bool(ctx.stop))


def _kv(dtype: Any) -> str:
    """auto, bf16 and bfloat16 all mean the model's 16-bit dtype; FP8 kinds stay distinct."""
    return "16-bit" if str(dtype) in ("auto", "bf16", "bfloat16") else str(dtype)


def mismatches(server_info: dict, model_info: dict, want: Expected) -> list[str]:
    """What the server reports that the config does not ask for (empty: it matches)."""
    out = []
    tp = server_info.get("tp_size")
    if tp is not None and int(tp) != want.tp:
        out.append(f"--tp-size {tp}, rollout.sglang.tp is {want.tp} (the weight-update group "
                   f"counts 1 + tp ranks per server)")
    kv = server_info.get("kv_cache_dtype")
    if kv is not None and _kv(kv) != _kv(want.kv_cache_dtype):
        out.append(f"--kv-cache-dtype {kv}, rollout.kv_cache_dtype is {want.kv_cache_dtype}")
    if want.routed_experts and server_info.get("enable_return_routed_experts") is False:
        out.append("no --enable-return-routed-experts, which model.routing_replay needs")
    if want.context_length is not None and "context_length" in server_info \
            and server_info["context_length"] != want.context_length:
        out.append(f"--context-length {server_info['context_length']}, "
                   f"rollout.sglang.context_length is {want.context_length}")
    if want.tokenizer and server_info.get("skip_tokenizer_init") is True:
        out.append("--skip-tokenizer-init, under which SGLang refuses stop strings (env.stop: "
                   "they are matched in decoded text); start it with the model's tokenizer")
    arch = model_info.get("architectures")
    if arch and want.architectures and tuple(arch) != want.architectures:
        out.append(f"model {list(arch)}, the trainer's is {list(want.architectures)} (model.*)")
    return out


DETERMINISTIC = "--enable-deterministic-inference"  # SGLang reads sampling_seed only then


def draws_from_seed(server_info: dict) -> bool:
    """Was the server started with DETERMINISTIC (its /server_info says so)?"""
    return server_info.get("enable_deterministic_inference") is True


def check_served(key: str, url: str, want: Expected, *, timeout_s: float) -> dict:
    """The server's /server_info; ServerLaunchError in one line when the server at `url` (config
    key `key`) does not serve what `want` asks, or does not say what it serves."""
    try:
        info = http.request(url, "server_info", timeout=timeout_s)
        model = http.request(url, "model_info", timeout=timeout_s)
    except (http.ServerUnreachable, http.ServerError) as exc:
        raise ServerLaunchError(f"{key}: {url} did not report its launch arguments "
                                f"(/server_info, /model_info): {exc}") from None
    if not isinstance(info, dict) or not isinstance(model, dict):
        raise ServerLaunchError(f"{key}: {url} answered /server_info or /model_info with "
                                f"something other than a JSON object: is it an SGLang server?")
    found = mismatches(info, model, want)
    if found:
        raise ServerLaunchError(f"{key}: {url} was started with " + "; ".join(found)
                                + ": restart it with the run's flags or change the config")
    return info
