"""The one explicit registry of policy objectives: name -> coefficient function (docs/spec.md
section 4)."""
from __future__ import annotations

from typing import Callable

from megapkl.objectives.cispo import cispo
from megapkl.objectives.clip_cov import clip_cov
from megapkl.objectives.dppo_tv import dppo_tv
from megapkl.objectives.gepo import gepo
from megapkl.objectives.grpo import grpo
from megapkl.objectives.gspo import gspo
from megapkl.objectives.is_free import is_free
from megapkl.objectives.m2po import m2po
from megapkl.objectives.pg import pg
from megapkl.objectives.proximal_kl import proximal_kl
from megapkl.objectives.seq_is import seq_is
from megapkl.objectives.stats import Stats, Terms
from megapkl.objectives.tetpo import tetpo

ObjectiveFn = Callable[[Stats], Terms]

OBJECTIVES: dict[str, ObjectiveFn] = {
    "pg": pg,                    # PKL eq. 10
    "grpo": grpo,                # PKL eq. 8 (decoupled clip)
    "dapo": grpo,                # SIS eq. 34: grpo with eps_clip_high 0.28 (+ dynamic sampling)
    "cispo": cispo,              # PKL eq. 9, SIS eq. 36
    "proximal_kl": proximal_kl,  # PKL eq. 6-7
    "seq_is": seq_is,            # PKL eq. 11
    "is_free": is_free,          # PKL eq. 12
    "gspo": gspo,                # SIS eq. 35, 40-41
    "tetpo": tetpo,              # TETPO eq. 7
    "gepo": gepo,                # TETPO sec. 1 (GEPO)
    "m2po": m2po,                # TETPO sec. 1 (M2PO, greedy_all)
    "dppo_tv": dppo_tv,          # SIS eq. 37 (GRPO + top-K total-variation mask)
    "clip_cov": clip_cov,        # SIS eq. 38 (GRPO + log-prob x advantage covariance mask)
}


def get_objective(name: str) -> ObjectiveFn:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise KeyError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}") from None
