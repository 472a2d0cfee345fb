"""Naive float64 reference of the policy objectives of docs/spec.md.

Written from docs/spec.md alone, deliberately slow: explicit Python loops per token, per response
and per group, plain `math` in float64 (Python floats). It must NOT import anything from
`megapkl.objectives`; the only shared piece with the library is the SIS uniform draws, which callers
pass in as `u` (one float in [0, 1) per token).

Reading of docs/spec.md points that are not spelled out verbatim (see also the README-like notes in
`naive_policy_loss`):

* per-token aggregation factor f_t: 1/T_m for `seq_mean_token_mean`, 1 otherwise; Z = N (token_mean),
  M (seq_mean_token_mean, seq_mean) or norm_constant (token_sum_norm). coef_t already contains f_t, so
  grad(loss) w.r.t. logp_t == -coef_t / Z.
* loss value: token-level objectives: -(1/Z) sum_t f_t * term_t with term_t the (negated) paper
  surrogate per token. Sequence-level objectives (gspo, tetpo, gepo): -(1/Z) sum_m F_m * term_m with
  term_m = min(x_m A_m, clip(x_m) A_m) and F_m = 1 for seq_mean / seq_mean_token_mean, T_m otherwise.
* SIS accepted tokens: weight 1, no clip gate: pg/grpo/dapo term = A, coef = A; cispo term = A*logp,
  coef = A; proximal_kl term = A - C, coef = A - C. gspo: s_m uses only rejected tokens' Delta (sum
  divided by the full T_m, SIS eq. 40), and all tokens of the response get coef s_m A_m active / T_m.
* clip/frac: fraction of ALL tokens whose gradient the clip gate zeroes (sequence objectives: every
  token of a gated response counts; SIS-accepted tokens never count); cispo: fraction of tokens
  (rejected ones when SIS is on) with w outside [c_lo, c_hi].
* m2po ("greedy_all"): m2po/mask_frac is the fraction of tokens zeroed by the mask.
* entropy metric: token mean of the given entropy.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

OBJECTIVES = ("pg", "grpo", "dapo", "cispo", "proximal_kl", "seq_is", "is_free", "gspo", "tetpo",
              "gepo", "m2po", "dppo_tv", "clip_cov")
TOKEN_OBJECTIVES = ("pg", "grpo", "dapo", "cispo", "proximal_kl", "seq_is", "is_free", "m2po",
                    "dppo_tv", "clip_cov")
SEQ_OBJECTIVES = ("gspo", "tetpo", "gepo")
CREDIT_OBJECTIVES = ("proximal_kl", "seq_is", "is_free")
CLIP_OBJECTIVES = ("grpo", "dapo", "gspo", "tetpo", "gepo", "cispo", "dppo_tv", "clip_cov")

DEFAULT_AGG = {"gspo": "seq_mean_token_mean", "gepo": "seq_mean_token_mean", "tetpo": "seq_mean"}
DEFAULT_EPS = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "tetpo": (0.2, 0.2),
               "gepo": (0.2, 0.2)}

# Metrics docs/spec.md section 9 lists, per objective family (the ones this reference computes).
COMMON_METRICS = ("loss", "coef/mean", "coef/abs_max", "is/w_mean", "is/w_max", "is/w_min",
                  "is/log_dev", "kl/prox_k3")


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------
def _list(x) -> Optional[list]:
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().cpu().tolist()
    elif hasattr(x, "tolist"):
        x = x.tolist()
    return list(x)


def _lse(values: Sequence[float]) -> float:
    mx = max(values)
    if mx == -math.inf:
        return -math.inf
    s = 0.0
    for v in values:
        s += math.exp(v - mx)
    return mx + math.log(s)


def clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else (hi if x > hi else x)


def active(x: float, a: float, eps_lo: float, eps_hi: float) -> bool:
    """docs/spec.md section 4: the branch of min(x A, clip(x, 1-lo, 1+hi) A) whose gradient is
    nonzero."""
    return not ((a > 0 and x > 1.0 + eps_hi) or (a < 0 and x < 1.0 - eps_lo))


def clipped_term(x: float, a: float, eps_lo: float, eps_hi: float) -> float:
    return min(x * a, clip(x, 1.0 - eps_lo, 1.0 + eps_hi) * a)


def resolve_cfg(cfg: Mapping[str, Any]) -> dict:
    """docs/spec.md section 8 defaults plus the per-objective defaults."""
    out = {
        "name": "proximal_kl", "aggregation": None, "beta": 0.30, "horizon": "full",
        "cost_clip": 0.05, "tail": "none", "eps_clip_low": None, "eps_clip_high": None, "clip_ratio_c": None,
        "is_clip": (0.0, 5.0), "kappa": 0.85, "bisection_steps": 24, "m2_threshold": 0.04,
        "tv_delta": 0.15, "cov_omega": 1.0, "sis": {"enabled": False, "top_k": 10}, "kl_init_coef": 0.0, "entropy_coef": 0.0, "seed": 0,
        "norm_constant": None,
    }
    for k, v in dict(cfg).items():
        if k not in out:
            raise KeyError(f"unknown objective key {k!r}")
        if k == "sis":
            s = dict(out["sis"])
            s.update(v or {})
            v = s
        out[k] = v
    name = out["name"]
    if name not in OBJECTIVES:
        raise ValueError(name)
    if out["aggregation"] is None:
        out["aggregation"] = DEFAULT_AGG.get(name, "token_mean")
    lo, hi = DEFAULT_EPS.get(name, (0.2, 0.2))
    if out["eps_clip_low"] is None:
        out["eps_clip_low"] = lo
    if out["eps_clip_high"] is None:
        out["eps_clip_high"] = hi
    return out


def responses_of(response_index: Sequence[int]) -> list[list[int]]:
    """Token indices of each response, in order (response_index nondecreasing 0..M-1)."""
    resp: list[list[int]] = []
    for t, m in enumerate(response_index):
        m = int(m)
        while len(resp) <= m:
            resp.append([])
        resp[m].append(t)
    return resp


def groups_of(group_index: Sequence[int]) -> dict:
    """group id -> list of member response indices (in batch order)."""
    g: dict = {}
    for m, gid in enumerate(group_index):
        g.setdefault(int(gid), []).append(m)
    return g


# --------------------------------------------------------------------------------------------------
# advantages (docs/spec.md section 3)
# --------------------------------------------------------------------------------------------------
def naive_advantages(rewards, group_index, mode: str = "group_mean", perturb_baseline: bool = False,
                     std_eps: float = 1e-5) -> list[float]:
    """Per-response advantages. G=1 with group_std: the sample std is undefined, advantage := 0."""
    r = [float(x) for x in _list(rewards)]
    out = [0.0] * len(r)
    for gid, members in groups_of(_list(group_index)).items():
        vals = [r[m] for m in members]
        g = len(vals)
        mean = 0.0
        for v in vals:
            mean += v
        mean /= g
        if mode == "raw":
            adv = list(vals)
        elif mode == "group_mean":
            adv = [v - mean for v in vals]
        elif mode == "group_std":
            if g < 2:
                adv = [0.0 for _ in vals]
            else:
                ss = 0.0
                for v in vals:
                    ss += (v - mean) ** 2
                s = math.sqrt(ss / (g - 1))
                adv = [(v - mean) / (s + std_eps) for v in vals]
        else:
            raise ValueError(mode)
        if perturb_baseline and max(vals) > min(vals):
            adv = [a + 1.0 for a in adv]
        for m, a in zip(members, adv):
            out[m] = a
    return out


# --------------------------------------------------------------------------------------------------
# future-KL credit (docs/spec.md section 4.1), O(T*H) on purpose: independent of the library's
# prefix sums
# --------------------------------------------------------------------------------------------------
def naive_credit_response(l: Sequence[float], beta: float, horizon, cost_clip, tail: str = "none"
                          ) -> list[float]:
    T = len(l)
    c = [float(x) if cost_clip is None else clip(float(x), -cost_clip, cost_clip) for x in l]
    out = []
    for t in range(1, T + 1):
        total = 0.0
        if horizon == "full":
            for j in range(t, T + 1):
                total += c[j - 1]
        else:
            H = int(horizon)
            for j in range(t, min(T, t + H - 1) + 1):
                total += c[j - 1]
            if tail == "linear":
                n = T - t - H + 1
                for j in range(t + H, T + 1):
                    total += c[j - 1] * (T + 1 - j) / (n + 1)
        out.append(beta * total)
    return out


def naive_credit(l, response_index, beta, horizon, cost_clip, tail="none") -> list[float]:
    lv = [float(x) for x in _list(l)]
    out = [0.0] * len(lv)
    for toks in responses_of(_list(response_index)):
        cr = naive_credit_response([lv[t] for t in toks], beta, horizon, cost_clip, tail)
        for t, v in zip(toks, cr):
            out[t] = v
    return out


# --------------------------------------------------------------------------------------------------
# TETPO (docs/spec.md section 4.2)
# --------------------------------------------------------------------------------------------------
def naive_ess(L: Sequence[float], alpha: float) -> float:
    """(sum e^{aL})^2 / sum e^{2aL}, shifted by the max for stability."""
    a = [alpha * x for x in L]
    mx = max(a)
    s1 = 0.0
    s2 = 0.0
    for v in a:
        e = math.exp(v - mx)
        s1 += e
        s2 += e * e
    return s1 * s1 / s2


def naive_alpha(L: Sequence[float], kappa: float, n_iter: int = 24) -> float:
    G = len(L)
    if G <= 1 or naive_ess(L, 1.0) >= kappa * G:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(n_iter):
        mid = 0.5 * (lo + hi)
        if naive_ess(L, mid) >= kappa * G:
            lo = mid
        else:
            hi = mid
    return lo


def naive_tempered_weights(L: Sequence[float], alpha: float) -> list[float]:
    G = len(L)
    a = [alpha * x for x in L]
    z = _lse(a)
    return [G * math.exp(v - z) for v in a]


def naive_temper(L, group_index, kappa=0.85, n_iter=24):
    """-> (alpha per response, weights per response, {gid: (alpha, ess1/G, ess*/G)})."""
    Lv = [float(x) for x in _list(L)]
    alpha = [1.0] * len(Lv)
    wts = [1.0] * len(Lv)
    per_group = {}
    for gid, members in groups_of(_list(group_index)).items():
        Lg = [Lv[m] for m in members]
        G = len(Lg)
        a = naive_alpha(Lg, kappa, n_iter)
        w = naive_tempered_weights(Lg, a)
        for m, wi in zip(members, w):
            alpha[m] = a
            wts[m] = wi
        per_group[gid] = (a, naive_ess(Lg, 1.0) / G, naive_ess(Lg, a) / G)
    return alpha, wts, per_group


# --------------------------------------------------------------------------------------------------
# GEPO (docs/spec.md section 4.4)
# --------------------------------------------------------------------------------------------------
def naive_gepo_weights(Lpi, Lmu, group_index) -> list[float]:
    """weight_i = pi(y_i) / sum_j q_j mu(y_j), q_j = mu_j / sum_k mu_k, in log space."""
    Lpi = [float(x) for x in _list(Lpi)]
    Lmu = [float(x) for x in _list(Lmu)]
    out = [0.0] * len(Lpi)
    for gid, members in groups_of(_list(group_index)).items():
        log_den = _lse([2.0 * Lmu[j] for j in members]) - _lse([Lmu[k] for k in members])
        for i in members:
            out[i] = math.exp(Lpi[i] - log_den)
    return out


# --------------------------------------------------------------------------------------------------
# M2PO greedy_all (docs/spec.md section 4.4)
# --------------------------------------------------------------------------------------------------
def naive_m2po_mask(delta, tau: float) -> list[float]:
    d = [float(x) for x in _list(delta)]
    m2 = [x * x for x in d]
    order = sorted(range(len(m2)), key=lambda i: -m2[i])
    mask = [1.0] * len(m2)
    kept_sum = 0.0
    for v in m2:
        kept_sum += v
    kept_n = len(m2)
    k = 0
    while kept_n > 0 and kept_sum / kept_n > tau:
        i = order[k]
        mask[i] = 0.0
        kept_sum -= m2[i]
        kept_n -= 1
        k += 1
        if kept_n > 0:  # recompute the sum exactly to avoid cancellation drift
            kept_sum = 0.0
            for j in range(len(m2)):
                if mask[j]:
                    kept_sum += m2[j]
    return mask


def naive_quantiles(name: str, values) -> dict:
    """p10 / p50 / p90 with linear interpolation between order statistics."""
    v = sorted(float(x) for x in values)
    out = {}
    for q, tag in ((0.1, "p10"), (0.5, "p50"), (0.9, "p90")):
        pos = q * (len(v) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(v) - 1)
        out[f"{name}_{tag}"] = v[lo] + (pos - lo) * (v[hi] - v[lo])
    return out


# --------------------------------------------------------------------------------------------------
# Table 2 masks of the SIS paper (eq. 37, 38)
# --------------------------------------------------------------------------------------------------
def naive_tv(topk_logp_row, topk_logp_behav_row) -> float:
    """Eq. 37 on the behavior top-K ids, the rest of the vocabulary merged into one extra bin."""
    pi = [math.exp(float(x)) for x in topk_logp_row]
    mu = [math.exp(float(x)) for x in topk_logp_behav_row]
    dist = 0.0
    for a, b in zip(pi, mu):
        dist += abs(a - b)
    pi_rest, mu_rest = 1.0 - sum(pi), 1.0 - sum(mu)
    dist += abs(pi_rest - mu_rest)
    return dist / 2.0


def naive_cov(logp, adv_tok) -> list[float]:
    """Eq. 38: (log pi - batch mean log pi)(A - batch mean A), means over all tokens."""
    n = len(logp)
    mean_lp = sum(logp) / n
    mean_a = sum(adv_tok) / n
    return [(logp[t] - mean_lp) * (adv_tok[t] - mean_a) for t in range(n)]


# --------------------------------------------------------------------------------------------------
# SIS (docs/spec.md section 4.3)
# --------------------------------------------------------------------------------------------------
def naive_sis_accept(logp, logp_behav, token_ids, topk_ids, topk_logp_behav, topk_logp, u) -> list[int]:
    lp, lb = _list(logp), _list(logp_behav)
    ids, tk, tkb, tkp, uu = (_list(token_ids), _list(topk_ids), _list(topk_logp_behav),
                             _list(topk_logp), _list(u))
    z = []
    for t in range(len(lp)):
        if int(ids[t]) not in [int(v) for v in tk[t]]:
            z.append(0)
            continue
        Mt = max(math.exp(float(a) - float(b)) for a, b in zip(tkp[t], tkb[t]))
        w = math.exp(float(lp[t]) - float(lb[t]))
        z.append(1 if float(uu[t]) < w / Mt else 0)
    return z


# --------------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------------
def naive_policy_loss(cfg_dict: Mapping[str, Any], batch: Mapping[str, Any], u=None):
    """-> (loss: float, coef: list[float], Z: float, metrics: dict[str, float]).

    `batch` is a mapping with the TokenBatch field names (tensors or lists). `u`: SIS uniform draws
    per token (required when sis.enabled).
    """
    cfg = resolve_cfg(cfg_dict)
    name = cfg["name"]
    agg = cfg["aggregation"]
    lo, hi = float(cfg["eps_clip_low"]), float(cfg["eps_clip_high"])

    logp = [float(x) for x in _list(batch["logp"])]
    behav = [float(x) for x in _list(batch["logp_behav"])]
    prox = _list(batch.get("logp_prox"))
    prox = behav if prox is None else [float(x) for x in prox]
    init = _list(batch.get("logp_init"))
    adv_tok = [float(x) for x in _list(batch["advantages"])]
    ridx = [int(x) for x in _list(batch["response_index"])]
    gidx = [int(x) for x in _list(batch["group_index"])]
    ent = _list(batch.get("entropy"))

    N = len(logp)
    resp = responses_of(ridx)
    M = len(resp)
    assert M == len(gidx), "group_index must have one entry per response"
    T = [len(r) for r in resp]
    A = []
    for toks in resp:
        a0 = adv_tok[toks[0]]
        for t in toks:
            assert adv_tok[t] == a0, "advantages must be constant within a response"
        A.append(a0)

    delta = [logp[t] - behav[t] for t in range(N)]
    w = [math.exp(d) for d in delta]
    lvec = [logp[t] - prox[t] for t in range(N)]
    rho = [math.exp(x) for x in lvec]
    rfac = [math.exp(prox[t] - behav[t]) for t in range(N)]

    # aggregation
    f = [1.0] * N
    if agg == "token_mean":
        Z = float(N)
    elif agg == "seq_mean_token_mean":
        Z = float(M)
        for m, toks in enumerate(resp):
            for t in toks:
                f[t] = 1.0 / T[m]
    elif agg == "seq_mean":
        Z = float(M)
    elif agg == "token_sum_norm":
        Z = float(cfg["norm_constant"])
    else:
        raise ValueError(agg)

    # SIS
    sis_on = bool(cfg["sis"]["enabled"])
    z = [0] * N
    if sis_on:
        assert u is not None, "SIS needs the uniform draws u"
        z = naive_sis_accept(logp, behav, batch["token_ids"], batch["topk_ids"],
                             batch["topk_logp_behav"], batch["topk_logp"], u)

    # credit
    C = [0.0] * N
    if name in CREDIT_OBJECTIVES:
        C = naive_credit(lvec, ridx, float(cfg["beta"]), cfg["horizon"], cfg["cost_clip"], cfg["tail"])

    coef = [0.0] * N
    term = [0.0] * N          # per-token surrogate (token objectives)
    seq_term = [0.0] * M      # per-response surrogate (sequence objectives)
    clipped = [0] * N
    dual = [0] * N            # tokens where the dual clip binds
    metrics: dict[str, float] = {}

    if name in TOKEN_OBJECTIVES:
        m2mask = naive_m2po_mask(delta, float(cfg["m2_threshold"])) if name == "m2po" else None
        keep = [1.0] * N   # Table 2 masks (1 = the token keeps its gradient)
        if name == "dppo_tv":
            tkp, tkb = _list(batch["topk_logp"]), _list(batch["topk_logp_behav"])
            tvs = [naive_tv(tkp[t], tkb[t]) for t in range(N)]
            keep = [1.0 if tvs[t] <= float(cfg["tv_delta"]) else 0.0 for t in range(N)]
            metrics["dppo/tv"] = sum(tvs) / N
            metrics["dppo/mask_frac"] = sum(1 for k in keep if k == 0.0) / N
        if name == "clip_cov":
            covs = naive_cov(logp, adv_tok)
            keep = [1.0 if covs[t] <= float(cfg["cov_omega"]) else 0.0 for t in range(N)]
            metrics["clip_cov/mask_frac"] = sum(1 for k in keep if k == 0.0) / N
        gm = [0.0] * M
        if name == "seq_is":
            for m, toks in enumerate(resp):
                s = 0.0
                for t in toks:
                    s += delta[t]
                gm[m] = math.exp(s / T[m])
        for m, toks in enumerate(resp):
            a = A[m]
            for t in toks:
                if name == "pg":
                    wt = 1.0 if z[t] else w[t]
                    c, val = wt * a, wt * a
                elif name in ("grpo", "dapo", "dppo_tv", "clip_cov"):
                    if z[t]:
                        c, val = a, a
                    else:
                        act = active(rho[t], a, lo, hi)
                        surr = clipped_term(rho[t], a, lo, hi)
                        cc = cfg["clip_ratio_c"]
                        # dual clip (verl clip_ratio_c): for A < 0 the surrogate is max(c A, surr)
                        if cc is not None and a < 0 and cc * a > surr:
                            act, surr = False, cc * a
                            dual[t] = 1
                        clipped[t] = 0 if act else 1
                        c = keep[t] * w[t] * a * (1.0 if act else 0.0)
                        val = keep[t] * rfac[t] * surr
                elif name == "cispo":
                    clo, chi = float(cfg["is_clip"][0]), float(cfg["is_clip"][1])
                    if z[t]:
                        c = a
                    else:
                        cw = clip(w[t], clo, chi)
                        clipped[t] = 1 if (w[t] < clo or w[t] > chi) else 0
                        c = cw * a
                    val = c * logp[t]
                elif name == "proximal_kl":
                    wt = 1.0 if z[t] else w[t]
                    c = wt * (a - C[t])
                    val = c
                elif name == "seq_is":
                    c = gm[m] * (a - C[t])
                    val = c * logp[t]
                elif name == "is_free":
                    c = a - C[t]
                    val = c * logp[t]
                elif name == "m2po":
                    c = m2mask[t] * w[t] * a
                    val = c
                coef[t] = c * f[t]
                term[t] = val
        loss_main = 0.0
        for t in range(N):
            loss_main += f[t] * term[t]
        loss_main = -loss_main / Z
        if cfg["clip_ratio_c"] is not None:
            metrics["clip/dual_frac"] = sum(dual) / N
        if name == "m2po":
            nz = 0
            for v in m2mask:
                if v == 0.0:
                    nz += 1
            metrics["m2po/mask_frac"] = nz / N
    else:  # sequence-level objectives
        x = [0.0] * M
        if name == "gspo":
            for m, toks in enumerate(resp):
                s = 0.0
                for t in toks:
                    if not z[t]:
                        s += delta[t]
                x[m] = math.exp(s / T[m])
        elif name == "tetpo":
            L = []
            for toks in resp:
                s = 0.0
                for t in toks:
                    s += delta[t]
                L.append(s)
            alpha, wts, per_group = naive_temper(L, gidx, float(cfg["kappa"]), int(cfg["bisection_steps"]))
            x = wts
            alphas = [v[0] for v in per_group.values()]
            metrics["tetpo/alpha_mean"] = sum(alphas) / len(alphas)
            metrics["tetpo/alpha_min"] = min(alphas)
            metrics["tetpo/tempered_frac"] = sum(1 for a in alphas if a < 1.0) / len(alphas)
            metrics["tetpo/ess_frac_before"] = sum(v[1] for v in per_group.values()) / len(alphas)
            metrics["tetpo/ess_frac_after"] = sum(v[2] for v in per_group.values()) / len(alphas)
            metrics.update(naive_quantiles("tetpo/alpha", alphas))
            metrics.update(naive_quantiles("tetpo/ess_frac_before", [v[1] for v in per_group.values()]))
            metrics.update(naive_quantiles("tetpo/ess_frac_after", [v[2] for v in per_group.values()]))
        elif name == "gepo":
            Lpi, Lmu = [], []
            for toks in resp:
                s1 = 0.0
                s2 = 0.0
                for t in toks:
                    s1 += logp[t]
                    s2 += behav[t]
                Lpi.append(s1)
                Lmu.append(s2)
            x = naive_gepo_weights(Lpi, Lmu, gidx)
        seq_F = [1.0 if agg in ("seq_mean", "seq_mean_token_mean") else float(T[m]) for m in range(M)]
        loss_main = 0.0
        for m, toks in enumerate(resp):
            a = A[m]
            act = active(x[m], a, lo, hi)
            for t in toks:
                coef[t] = x[m] * a * (1.0 if act else 0.0) * f[t]
                clipped[t] = 0 if act else 1
            seq_term[m] = clipped_term(x[m], a, lo, hi)
            loss_main += seq_F[m] * seq_term[m]
        loss_main = -loss_main / Z

    loss = loss_main

    # KL to the initial model (k3), folded into coef
    kl_coef = float(cfg["kl_init_coef"])
    if kl_coef > 0.0:
        assert init is not None
        s = 0.0
        for t in range(N):
            d = float(init[t]) - logp[t]
            k3 = math.exp(d) - d - 1.0
            s += f[t] * k3
            coef[t] -= kl_coef * (1.0 - math.exp(d)) * f[t]
        loss += kl_coef * s / Z

    # entropy bonus (not in coef)
    ent_coef = float(cfg["entropy_coef"])
    if ent is not None:
        metrics["entropy"] = sum(float(e) for e in ent) / N
    if ent_coef != 0.0:
        assert ent is not None
        s = 0.0
        for t in range(N):
            s += f[t] * float(ent[t])
        loss -= ent_coef * s / Z

    # metrics (docs/spec.md section 9)
    metrics["loss"] = loss
    metrics["coef/mean"] = sum(coef) / N
    metrics["coef/abs_max"] = max(abs(c) for c in coef)
    metrics["is/w_mean"] = sum(w) / N
    metrics["is/w_max"] = max(w)
    metrics["is/w_min"] = min(w)
    dev = 0.0
    for toks in resp:
        s = 0.0
        for t in toks:
            s += abs(delta[t])
        dev += s
    metrics["is/log_dev"] = dev / M
    k3s = 0.0
    for t in range(N):
        d = prox[t] - logp[t]
        k3s += math.exp(d) - d - 1.0
    metrics["kl/prox_k3"] = k3s / N
    if name in CLIP_OBJECTIVES:
        metrics["clip/frac"] = sum(clipped) / N
    if name in CREDIT_OBJECTIVES:
        ec = cfg["cost_clip"]
        metrics["pkl/cost_clip_frac"] = (0.0 if ec is None else
                                         sum(1 for x in lvec if abs(x) > float(ec)) / N)
        moving = [x for x in lvec if x != 0]
        metrics["pkl/moving_frac"] = len(moving) / N
        metrics["pkl/cost_clip_frac_moving"] = (0.0 if ec is None or not moving else
                                                sum(1 for x in moving if abs(x) > float(ec)) / len(moving))
        metrics["pkl/credit_mean"] = sum(C) / N
        metrics["pkl/credit_abs_max"] = max(abs(c) for c in C)
        metrics["pkl/adv_abs_mean"] = sum(abs(adv_tok[t]) for t in range(N)) / N
        metrics.update(naive_quantiles("pkl/credit", C))
    if sis_on:
        metrics["sis/accept_rate"] = sum(z) / N
        dv = 0.0
        for toks in resp:
            for t in toks:
                dv += (1 - z[t]) * abs(delta[t])
        metrics["sis/log_dev"] = dv / M
        tkp = _list(batch["topk_logp"])
        xi = 0.0
        for t in range(N):
            xi += 1.0 - sum(math.exp(float(v)) for v in tkp[t])
        metrics["sis/xi_k"] = xi / N
        ids, tks = _list(batch["token_ids"]), _list(batch["topk_ids"])
        rejected = [t for t in range(N) if not z[t]]
        outside = [t for t in rejected if int(ids[t]) not in [int(v) for v in tks[t]]]
        metrics["sis/reject_outside_topk"] = len(outside) / len(rejected) if rejected else 0.0
        metrics.update(naive_quantiles("sis/accept_rate", [sum(z[t] for t in toks) / len(toks) for toks in resp]))

    extras = {"z": z, "C": C, "f": f, "T": T, "A": A}
    naive_policy_loss.last_extras = extras  # for tests that want intermediate values
    return loss, coef, Z, metrics


def expected_metric_names(cfg_dict: Mapping[str, Any], has_entropy: bool = False) -> set[str]:
    """docs/spec.md section 9 metric names that apply to a config."""
    cfg = resolve_cfg(cfg_dict)
    name = cfg["name"]
    names = set(COMMON_METRICS)
    if name in CLIP_OBJECTIVES:
        names.add("clip/frac")
    if cfg["clip_ratio_c"] is not None:
        names.add("clip/dual_frac")
    q = ("_p10", "_p50", "_p90")
    if name in CREDIT_OBJECTIVES:
        names |= {"pkl/cost_clip_frac", "pkl/cost_clip_frac_moving", "pkl/moving_frac",
                  "pkl/credit_mean", "pkl/credit_abs_max", "pkl/adv_abs_mean"}
        names |= {"pkl/credit" + s for s in q}
    if cfg["sis"]["enabled"]:
        names |= {"sis/accept_rate", "sis/log_dev", "sis/xi_k", "sis/reject_outside_topk"}
        names |= {"sis/accept_rate" + s for s in q}
    if name == "tetpo":
        names |= {"tetpo/alpha_mean", "tetpo/alpha_min", "tetpo/tempered_frac",
                  "tetpo/ess_frac_before", "tetpo/ess_frac_after"}
        names |= {f"tetpo/{m}{s}" for m in ("alpha", "ess_frac_before", "ess_frac_after") for s in q}
    if name == "m2po":
        names.add("m2po/mask_frac")
    if name == "dppo_tv":
        names |= {"dppo/mask_frac", "dppo/tv"}
    if name == "clip_cov":
        names.add("clip_cov/mask_frac")
    if has_entropy:
        names.add("entropy")
    return names
