"""Metrics every objective reports (docs/spec.md section 9), kept as reducible parts.

A loss call on a shard reports sums and counts (token means, response means), maxima, minima,
totals (the loss), already-global values (TETPO group statistics) and samples: the values whose
per-update distribution is reported as quantiles `<name>_p10/_p50/_p90` (PKL credit per token, SIS
acceptance per response), gathered from every shard before the quantiles are taken. `MetricParts.merge` combines
micro-batches; `megapkl.parallel` all-reduces the parts across ranks; `finalize` gives the floats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from megapkl.objectives.stats import Stats, Terms


@dataclass
class MetricParts:
    sums: dict[str, float] = field(default_factory=dict)     # mean = sums / counts
    counts: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)   # summed over shards, not averaged
    values: dict[str, float] = field(default_factory=dict)   # identical on every shard
    samples: dict[str, Tensor] = field(default_factory=dict)  # float64 [n]: quantiles at finalize

    def merge(self, other: "MetricParts") -> "MetricParts":
        out = MetricParts(dict(self.sums), dict(self.counts), dict(self.maxes), dict(self.mins),
                          dict(self.totals), dict(self.values), dict(self.samples))
        for k, v in other.sums.items():
            out.sums[k] = out.sums.get(k, 0.0) + v
            out.counts[k] = out.counts.get(k, 0.0) + other.counts[k]
        for k, v in other.maxes.items():
            out.maxes[k] = max(out.maxes.get(k, -float("inf")), v)
        for k, v in other.mins.items():
            out.mins[k] = min(out.mins.get(k, float("inf")), v)
        for k, v in other.totals.items():
            out.totals[k] = out.totals.get(k, 0.0) + v
        out.values.update(other.values)
        for k, v in other.samples.items():
            out.samples[k] = torch.cat([out.samples[k], v]) if k in out.samples else v
        return out

    def finalize(self) -> dict[str, float]:
        out = {k: (v / self.counts[k] if self.counts[k] else 0.0) for k, v in self.sums.items()}
        out.update(self.maxes)
        out.update(self.mins)
        out.update(self.totals)
        out.update(self.values)
        for k, v in self.samples.items():
            out.update(quantile_metrics(k, v))
        return out


QUANTILES = (0.1, 0.5, 0.9)


def quantile_metrics(name: str, values: Tensor) -> dict[str, float]:
    """{name_p10, name_p50, name_p90} (linear interpolation); {} for no values."""
    if values.numel() == 0:
        return {}
    q = torch.quantile(values.to(torch.float64),
                       torch.tensor(QUANTILES, dtype=torch.float64, device=values.device))
    return {f"{name}_p{round(p * 100):02d}": float(x) for p, x in zip(QUANTILES, q.tolist())}


class _Builder:
    """Collects 0-d float64 tensors on the loss's device, then converts them to floats in one
    stack and one host transfer. A loss call adds a dozen items per micro-batch, so each item
    costs at most a float64 cast (sums are float64 already) and counts known on the host stay
    Python floats."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.items: list[tuple[str, str, Tensor | float]] = []
        self.samples: dict[str, Tensor] = {}

    def sample(self, name: str, values: Tensor) -> None:
        self.samples[name] = values.detach().to(torch.float64).reshape(-1)

    def add(self, kind: str, name: str, value: Tensor | float) -> None:
        # a Python number (an objective's scalar metric) joins the loss's device, where every
        # other item lives: one stack, one transfer (a GPU refuses a stack across devices)
        if not isinstance(value, Tensor) or value.device != self.device:
            value = torch.as_tensor(value, device=self.device)
        if value.dim():
            value = value.reshape(())
        if value.dtype != torch.float64:
            value = value.to(torch.float64)
        self.items.append((kind, name, value))

    def add_float(self, kind: str, name: str, value: float) -> None:
        """A value already on the host (no tensor, no transfer)."""
        self.items.append((kind, name, float(value)))

    def mean(self, name: str, values: Tensor, mask: Tensor | None = None) -> None:
        v = values.to(torch.float64)
        if mask is None:
            self.add("sum", name, v.sum())
            # the count as a float32 tensor would hold it (exact below 2^24 elements)
            self.add_float("count", name, float(np.float32(v.numel())))
        else:
            self.add("sum", name, v[mask].sum())
            self.add("count", name, mask.sum())

    def build(self) -> MetricParts:
        parts = MetricParts(samples=dict(self.samples))
        if not self.items:
            return parts
        tensors = [t for _, _, t in self.items if isinstance(t, Tensor)]
        floats = iter(torch.stack(tensors).tolist() if tensors else ())
        target = {"sum": parts.sums, "count": parts.counts, "max": parts.maxes, "min": parts.mins,
                  "total": parts.totals, "value": parts.values}
        for kind, name, t in self.items:
            target[kind][name] = next(floats) if isinstance(t, Tensor) else t
        return parts


def _max(b: _Builder, name: str, x: Tensor, default: float = -float("inf")) -> None:
    if x.numel():
        b.add("max", name, x.max())
    else:
        b.add_float("max", name, default)


def _min(b: _Builder, name: str, x: Tensor, default: float = float("inf")) -> None:
    if x.numel():
        b.add("min", name, x.min())
    else:
        b.add_float("min", name, default)


def collect_metrics(s: Stats, terms: Terms, coef: Tensor, loss_value: Tensor) -> MetricParts:
    """Loss, coefficient, IS, proximal-KL, clip, SIS and objective-specific statistics."""
    b = _Builder(s.logp.device)
    d = s.logp_prox - s.logp
    abs_delta = s.delta.abs()
    b.add("total", "loss", loss_value)
    b.mean("coef/mean", coef)
    _max(b, "coef/abs_max", coef.abs())
    b.mean("is/w_mean", s.w)
    _max(b, "is/w_max", s.w)
    _min(b, "is/w_min", s.w)
    b.mean("is/log_dev", s.seq_sum(abs_delta), s.owned)
    b.mean("kl/prox_k3", torch.exp(d) - d - 1)
    if terms.clipped is not None:
        b.mean("clip/frac", terms.clipped)
    if s.cfg.uses_credit:
        eps = s.cfg.cost_clip
        clipped = s.l.abs() > eps if eps is not None else torch.zeros_like(s.l, dtype=torch.bool)
        b.mean("pkl/cost_clip_frac", clipped)
        # over the tokens whose log-ratio moved: a minibatch whose reference is the current
        # policy (l = 0 exactly) would dilute the all-token figure
        b.mean("pkl/cost_clip_frac_moving", clipped, s.l != 0)
        b.mean("pkl/moving_frac", s.l != 0)
        b.mean("pkl/credit_mean", s.credit)
        b.sample("pkl/credit", s.credit)
        _max(b, "pkl/credit_abs_max", s.credit.abs())
        b.mean("pkl/adv_abs_mean", s.adv.abs())  # the scale the credit competes with
    if s.sis is not None:
        z = s.sis.accepted
        b.mean("sis/accept_rate", z)
        b.mean("sis/log_dev", s.seq_sum(torch.where(z, torch.zeros_like(abs_delta), abs_delta)), s.owned)
        b.mean("sis/xi_k", s.sis.xi_k)
        b.mean("sis/reject_outside_topk", ~s.sis.in_topk, ~z)  # of the rejected tokens
        per_response = s.seq_sum(z.to(s.dtype)) / s.lengths   # accepted fraction of each response
        b.sample("sis/accept_rate", per_response[s.owned])
    if s.cfg.kl_init_coef > 0:
        di = s.batch.logp_init.detach() - s.logp
        b.mean("kl/init_k3", torch.exp(di) - di - 1)
    if s.batch.entropy is not None:
        b.mean("entropy", s.batch.entropy.detach())
    for name, x in terms.token_metrics.items():
        b.mean(name, x)
    for name, x in terms.metrics.items():
        b.add("value", name, x)
    return b.build()
