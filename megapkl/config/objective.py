"""The `objective:` section: which policy objective, and its hyper-parameters (docs/objectives.md).

Fields left at `None` are filled with the selected objective's paper default by `resolve()`, so a
resolved config always shows concrete numbers. `ObjectiveConfig` is re-exported as
`megapkl.objectives.PolicyLossConfig`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Union

from megapkl.config.typed import build, rng

ObjectiveName = Literal["pg", "grpo", "dapo", "cispo", "proximal_kl", "seq_is", "is_free", "gspo",
                        "tetpo", "gepo", "m2po", "dppo_tv", "clip_cov"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean", "token_sum_norm"]

OBJECTIVE_NAMES: tuple[str, ...] = ObjectiveName.__args__  # type: ignore[attr-defined]

# Per-objective defaults for the fields left unset (papers: PKL B.2/C.2, SIS Table 5, TETPO App. B).
DEFAULT_AGGREGATION = {"gspo": "seq_mean_token_mean", "gepo": "seq_mean_token_mean", "tetpo": "seq_mean"}
DEFAULT_EPS = {  # (eps_clip_low, eps_clip_high)
    "grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "tetpo": (0.2, 0.2),
    "gepo": (0.2, 0.2), "dppo_tv": (0.2, 0.2), "clip_cov": (0.2, 0.2),
}
# Objectives whose coefficient contains the token weight w_t, so SIS can replace it.
SIS_OBJECTIVES = ("pg", "grpo", "dapo", "cispo", "proximal_kl", "gspo")
# Objectives with GRPO's per-token PPO clip, where the dual clip (clip_ratio_c) applies.
DUAL_CLIP_OBJECTIVES = ("grpo", "dapo", "dppo_tv", "clip_cov")
# Objectives whose weight is one per sequence; their surrogate value counts once per response.
SEQUENCE_OBJECTIVES = ("gspo", "tetpo", "gepo")
# Objectives that use the future-KL credit C_t (PKL eq. 5).
CREDIT_OBJECTIVES = ("proximal_kl", "seq_is", "is_free")


@dataclass
class SISConfig:
    """Selective importance sampling (SIS paper Alg. 1): top-K envelope rejection test."""

    # SIS on the objective's token weight (pg, grpo, dapo, cispo, proximal_kl, gspo)
    enabled: bool = False
    top_k: int = field(default=10, metadata=rng(1))  # K behavior log-probs per token in the test


@dataclass
class ObjectiveConfig:
    """Policy objective and its hyper-parameters (docs/objectives.md: each objective's formula,
    defaults and paper equation). Unset fields take the selected objective's paper default."""

    name: ObjectiveName = "proximal_kl"  # docs/objectives.md
    # how per-token terms are averaged; unset: the objective's (token_mean; gspo, gepo:
    # seq_mean_token_mean; tetpo: seq_mean)
    aggregation: Optional[Aggregation] = None
    beta: float = field(default=0.30, metadata=rng(0.0))  # future-KL credit scale (PKL eq. 5)
    horizon: Union[int, Literal["full"]] = "full"  # H: tokens summed into the credit
    # eps_F; null: none
    cost_clip: Optional[float] = field(default=0.05, metadata=rng(0.0, lo_open=True))
    tail: Literal["none", "linear"] = "none"  # linear: weights after H fall to 0 (PKL C.2)
    # PPO clip widths; unset: the objective's (0.2/0.2; dapo 0.2/0.28; gspo 3e-4/4e-4)
    eps_clip_low: Optional[float] = field(default=None, metadata=rng(0.0, 1.0))
    eps_clip_high: Optional[float] = field(default=None, metadata=rng(0.0))  # see eps_clip_low
    # dual clip c > 1 (verl clip_ratio_c, slime --eps-clip-c): where A < 0 the surrogate is at
    # least c A, so a token with ratio above c gets no gradient; null: off
    clip_ratio_c: Optional[float] = field(default=None, metadata=rng(1.0, lo_open=True))
    is_clip: tuple[float, float] = (0.0, 5.0)  # cispo: [c_lo, c_hi] of the clipped weight
    # tetpo: target ESS / G
    kappa: float = field(default=0.85, metadata=rng(0.0, 1.0, lo_open=True))
    bisection_steps: int = field(default=24, metadata=rng(1, 64))  # tetpo: alpha* search steps
    m2_threshold: float = field(default=0.04, metadata=rng(0.0, lo_open=True))  # m2po: tau
    # assumption: the SIS paper states neither threshold. delta 0.15 is the TV threshold of DPPO's
    # public example script; omega 1.0 is the lower covariance bound of Clip-Cov's public recipe.
    tv_delta: float = field(default=0.15, metadata=rng(0.0, 1.0, lo_open=True))  # dppo_tv: delta
    cov_omega: float = field(default=1.0)  # clip_cov: omega
    sis: SISConfig = field(default_factory=SISConfig)
    kl_init_coef: float = field(default=0.0, metadata=rng(0.0))  # KL-to-initial-model penalty
    entropy_coef: float = field(default=0.0)  # entropy bonus
    seed: int = field(default=0, metadata=rng(0))  # the loss's own random draws (SIS)
    # Z of token_sum_norm
    norm_constant: Optional[float] = field(default=None, metadata=rng(0.0, lo_open=True))

    def check(self, err) -> None:
        if isinstance(self.horizon, int) and self.horizon < 1:
            err(f"must be an integer >= 1 or 'full', got {self.horizon}", "horizon")
        if self.tail == "linear" and self.horizon == "full":
            err("tail: linear needs an integer horizon (the unit-weight prefix); "
                "with horizon: full there is no tail to decay", "tail")
        lo, hi = self.is_clip
        if not 0.0 <= lo <= hi:
            err(f"must satisfy 0 <= c_lo <= c_hi, got {list(self.is_clip)}", "is_clip")
        if self.sis.enabled and self.name not in SIS_OBJECTIVES:
            err(f"SIS replaces the token weight w_t of {', '.join(SIS_OBJECTIVES)} "
                f"it is not defined for objective '{self.name}'", "sis.enabled")
        if self.clip_ratio_c is not None and self.name not in DUAL_CLIP_OBJECTIVES:
            err(f"the dual clip acts on the per-token PPO clip of {', '.join(DUAL_CLIP_OBJECTIVES)}; "
                f"objective '{self.name}' has none", "clip_ratio_c")
        agg = self.aggregation or DEFAULT_AGGREGATION.get(self.name, "token_mean")
        if agg == "token_sum_norm" and self.norm_constant is None:
            err("aggregation token_sum_norm needs norm_constant (e.g. max response length x responses)",
                "norm_constant")
        if self.name in SEQUENCE_OBJECTIVES and agg not in ("seq_mean", "seq_mean_token_mean"):
            err(f"{self.name} weights whole sequences: use seq_mean or seq_mean_token_mean, not {agg}",
                "aggregation")
        if self.name == "gspo" and agg == "seq_mean":
            # s_m is length-normalized: grad of the per-response surrogate carries 1/T_m, which only
            # seq_mean_token_mean's per-token weight reproduces (seq_mean would apply T_m times it).
            err("gspo's per-response surrogate min(s A, clip(s) A) has the gradient of "
                "seq_mean_token_mean; seq_mean would apply T_m times that gradient", "aggregation")

    @property
    def needs_topk(self) -> bool:
        """The behavior top-K log-probs and pi_theta on the same ids are needed (SIS, DPPO-TV)."""
        return self.sis.enabled or self.name == "dppo_tv"

    def resolve(self) -> "ObjectiveConfig":
        """Return a copy with every per-objective default filled in."""
        lo, hi = DEFAULT_EPS.get(self.name, (0.2, 0.2))
        return dataclasses.replace(
            self,
            aggregation=self.aggregation or DEFAULT_AGGREGATION.get(self.name, "token_mean"),
            eps_clip_low=lo if self.eps_clip_low is None else self.eps_clip_low,
            eps_clip_high=hi if self.eps_clip_high is None else self.eps_clip_high,
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None = None, *, source: str = "<dict>",
                  key: str = "objective") -> "ObjectiveConfig":
        """Strictly validated construction from the run config's `objective:` mapping."""
        return build(cls, dict(mapping or {}), key=key, source=source).resolve()

    @property
    def uses_credit(self) -> bool:
        return self.name in CREDIT_OBJECTIVES
