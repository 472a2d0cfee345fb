"""Glue between the naive reference and the library under test (library imported lazily)."""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from .gen import to_token_batch
from .naive import naive_policy_loss, resolve_cfg

RTOL = 1e-6
ATOL = 1e-12


def lib():
    import megapkl.objectives as objectives  # noqa: WPS433
    return objectives


def lib_draws(cfg_dict: Mapping[str, Any], d: dict) -> torch.Tensor:
    """The library's counter-based SIS draws for the tokens of batch dict `d`."""
    from megapkl.objectives.sis import uniform_draws  # noqa: WPS433
    M = len(d["group_index"])
    uid = d["response_uid"] if d.get("response_uid") is not None else torch.arange(M, dtype=torch.int64)
    uid_tok = uid.to(torch.int64)[d["response_index"]]
    seed = int(resolve_cfg(cfg_dict)["seed"])
    return uniform_draws(seed, int(d.get("step") or 0), uid_tok, d["positions"].to(torch.int64))


def run_reference(cfg_dict: Mapping[str, Any], d: dict, u=None):
    cfg = resolve_cfg(cfg_dict)
    if cfg["sis"]["enabled"] and u is None:
        u = lib_draws(cfg_dict, d)
    return naive_policy_loss(cfg_dict, d, u=u)


def run_library(cfg_dict: Mapping[str, Any], d: dict, requires_grad=("logp",)):
    L = lib()
    cfg = L.PolicyLossConfig.from_dict(dict(cfg_dict))
    batch, leaves = to_token_batch(d, requires_grad=requires_grad)
    out = L.policy_loss(cfg, batch)
    return out, batch, leaves


def close(a: float, b: float, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return False
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def compare(cfg_dict, d, *, check_loss: bool = True, check_metrics: bool = True, rtol: float = RTOL,
            atol: float = ATOL) -> list[str]:
    """Library vs reference; returns a list of mismatch descriptions (empty == agree)."""
    ref_loss, ref_coef, ref_Z, ref_metrics = run_reference(cfg_dict, d)
    out, batch, _ = run_library(cfg_dict, d)
    problems = []
    coef = out.coef.detach()
    if coef.dtype != torch.float64:
        problems.append(f"coef dtype {coef.dtype} (input float64 not preserved)")
    if out.loss.dtype != torch.float64:
        problems.append(f"loss dtype {out.loss.dtype} (input float64 not preserved)")
    if tuple(coef.shape) != (len(ref_coef),):
        problems.append(f"coef shape {tuple(coef.shape)} != ({len(ref_coef)},)")
        return problems
    bad = [i for i, (a, b) in enumerate(zip(coef.tolist(), ref_coef)) if not close(a, b, rtol, atol)]
    if bad:
        i = bad[0]
        problems.append(f"coef: {len(bad)}/{len(ref_coef)} tokens differ, first at token {i}: "
                        f"lib {coef[i].item()!r} ref {ref_coef[i]!r}")
    if not close(float(out.normalizer), ref_Z, 1e-12, 0.0):
        problems.append(f"normalizer: lib {out.normalizer!r} ref {ref_Z!r}")
    if check_loss and not close(float(out.loss.detach()), ref_loss, rtol, atol):
        problems.append(f"loss: lib {float(out.loss.detach())!r} ref {ref_loss!r}")
    if check_metrics:
        for k, v in ref_metrics.items():
            if k == "loss" and not check_loss:
                continue
            if k in out.metrics and not close(float(out.metrics[k]), v, rtol, 1e-10):
                problems.append(f"metric {k}: lib {out.metrics[k]!r} ref {v!r}")
    return problems
