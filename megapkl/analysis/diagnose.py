"""`megapkl diagnose correction-variance`: the Proximal KL paper's fixed-policy diagnostic (C.3).

Two frozen policies supply current and reference probabilities; P prompts x M responses are sampled
from the current policy and every response gives one scalar, its first-token correction summed
through H tokens (eq. C.4):

    C_pm^(H) = beta * sum_{j=1}^{min(H, T_pm)} clip(log rho_j, -eps_F, eps_F),   rho = pi_cur / pi_ref,

not divided by H or the length. V(H) is the within-prompt sample variance (M - 1 denominator),
averaged equally over prompts (eq. C.5), reported in units of 1e-3 like the paper's Fig. 9(c).
Policies, responses, beta and eps_F are held fixed across H, so the table isolates the effect of
extending the sum. The paper uses 16 prompts x 16 responses, beta 0.30 and eps_F 0.05; the command
takes beta and eps_F from the run's objective.beta and objective.cost_clip unless given.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

if TYPE_CHECKING:  # torch is imported inside the functions: `megapkl --help` must not need it
    from torch import Tensor

Horizon = Union[int, str]
DEFAULT_HORIZONS: tuple[Horizon, ...] = (1, 2, 4, 8, 16, 32, 64, "full")
UNIT = 1e-3


def first_token_correction(l: Tensor, horizon: Horizon, beta: float, eps_f: Optional[float]) -> float:
    """Eq. C.4 for one response: l = log rho_j of its tokens, in order."""
    import torch

    n = l.numel() if horizon == "full" else min(int(horizon), l.numel())
    costs = l[:n].to(torch.float64)
    if eps_f is not None:
        costs = costs.clamp(-eps_f, eps_f)
    return beta * float(costs.sum())


def correction_variance(l_by_prompt: Sequence[Sequence[Tensor]], horizon: Horizon, beta: float,
                        eps_f: Optional[float]) -> float:
    """Eq. C.5: mean over prompts of the sample variance (M - 1) of C_pm^(H) over their responses."""
    import torch

    variances = []
    for responses in l_by_prompt:
        if len(responses) < 2:
            raise ValueError("correction variance needs at least 2 responses per prompt")
        c = torch.tensor([first_token_correction(l, horizon, beta, eps_f) for l in responses],
                         dtype=torch.float64)
        variances.append(float(c.var(unbiased=True)))
    return sum(variances) / len(variances)


def variance_table(l_by_prompt, horizons: Sequence[Horizon], beta: float, eps_f: Optional[float]
                   ) -> dict[str, float]:
    """{str(H): V(H) in units of 1e-3}."""
    return {str(h): correction_variance(l_by_prompt, h, beta, eps_f) / UNIT for h in horizons}


def parse_horizons(text: str) -> list[Horizon]:
    out: list[Horizon] = []
    for part in text.split(","):
        part = part.strip()
        if part == "full":
            out.append("full")
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        else:
            raise ValueError(f"--horizons: expected integers >= 1 or 'full', got {part!r}")
    return out


# ----------------------------------------------------------------------------- on a run

def _config(source: Path, overrides: Sequence[str], prompts: int, responses: int,
            max_response_len: Optional[int]):
    """The run's (or a config file's) config, reshaped to one process and one prompt batch (one
    micro-batch per prompt's responses; an override `parallel.micro_batch_size=...` wins), its
    rollout fleet to what one process places here (eval_cli.one_process: refused up front, with
    the memory figures, when a Learner of the model does not fit one GPU)."""
    from megapkl.analysis.eval_cli import SINGLE_PROCESS, single_process_config

    path = source / "config.yaml" if source.is_dir() else source
    if not path.exists():
        raise FileNotFoundError(f"{source}: neither a run directory with config.yaml nor a config file")
    shape = [*SINGLE_PROCESS, f"rollout.prompts_per_batch={prompts}",
             f"rollout.responses_per_prompt={responses}", f"parallel.micro_batch_size={responses}",
             "parallel.max_tokens_per_micro_batch=null", "rollout.minibatches_per_batch=1",
             "logging.tensorboard=false"]
    if max_response_len is not None:
        shape.append(f"rollout.max_response_len={max_response_len}")
    cfg, placed = single_process_config(path, [*shape, *overrides], overrides, learner=True,
                                        what="diagnose")
    print(f"rollouts: {placed.says}", flush=True)
    return cfg


def _checkpoint(cfg, given: Optional[str]) -> Optional[Path]:
    from megapkl.train import checkpointing as ckpt

    if given in (None, "latest"):
        return ckpt.latest(cfg.checkpoint)
    if given == "init":
        return None
    path = Path(given)
    if not (path / ckpt.MARKER).exists():
        raise FileNotFoundError(f"{path}: not a complete megapkl checkpoint (no '{ckpt.MARKER}' marker)")
    return path


def _load(learner, path: Optional[Path], initial: dict) -> None:
    """Current model weights <- checkpoint `path`, or the initial weights when None."""
    import torch

    from megapkl.models.checkpoint import load_checkpoint

    if path is None:
        with torch.no_grad():
            for name, p in _params(learner.model):
                p.copy_(initial[name])
    else:
        load_checkpoint(path / "model", learner.model, load_rng=False)


def _params(model):
    chunks = model if isinstance(model, list) else [model]
    return [(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]


def sample_log_ratios(cfg, current: Optional[Path], reference: Optional[Path], responses: int
                      ) -> list[list[Tensor]]:
    """Responses of the current policy to the first P prompts; log rho_j per response, by prompt."""
    import contextlib
    import dataclasses

    import torch

    from megapkl.analysis.eval_cli import push_weights
    from megapkl.config.layout import Layout
    from megapkl.models.snapshot import SnapshotStore
    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.factory import build_run_engine, build_tokenizer_and_data
    from megapkl.train.learner import Learner
    from megapkl.train.loop import init_groups

    groups = init_groups(cfg.parallel, cfg.model, cfg.train.seed)
    learner = Learner(cfg.model, cfg.parallel, cfg.train, cfg.objective,
                      temperature=cfg.rollout.temperature, groups=groups)
    initial = {n: p.detach().clone() for n, p in _params(learner.model)}
    _load(learner, reference, initial)
    snapshots = SnapshotStore(learner.model)
    snapshots.save("reference")
    _load(learner, current, initial)
    r = cfg.rollout
    tokenizer, dataset, _ = build_tokenizer_and_data(cfg.model, cfg.data, r.max_prompt_len)
    engine = build_run_engine(r, cfg.model, learner.spec, tokenizer, work_dir=Path(cfg.run_dir),
                              seed=cfg.seed, layout=Layout.of(cfg.parallel, world=1))
    with contextlib.closing(engine):  # launched servers stop however this ends
        push_weights(engine, cfg, learner.export(), 1)  # FP8 rollouts: FP8, as eval pushes
        prompts = [dataset[i] for i in range(r.prompts_per_batch)]
        sampling = SamplingParams.from_rollout_config(
            r, topk_logprobs=r.topk_logprobs or 0, return_routed_experts=cfg.model.routing_replay)
        samples = engine.generate(prompts, responses, dataclasses.replace(sampling, seed=cfg.seed))
    for s in samples:
        s.advantage = 0.0  # no loss is taken; the packer carries one per response
    micro_batches = learner.pack(samples)
    cur = learner.logprobs(micro_batches)
    with snapshots.swapped_in("reference"):
        ref = learner.logprobs(micro_batches)
    by_prompt: list[list[Tensor]] = [[] for _ in prompts]
    for i, s in enumerate(samples):  # prompt-major: prompt i // responses
        by_prompt[i // responses].append((cur[s.uid] - ref[s.uid]).to(torch.float64))
    return by_prompt


def run_correction_variance(source: str, *, checkpoint: Optional[str] = None, reference: str = "init",
                            prompts: int = 16, responses: int = 16,
                            horizons: Sequence[Horizon] = DEFAULT_HORIZONS,
                            beta: Optional[float] = None, eps_f: Union[float, None, str] = "config",
                            max_response_len: Optional[int] = None,
                            overrides: Sequence[str] = (), out: Optional[str] = None) -> dict:
    """The C.3 diagnostic on a run directory (its latest checkpoint) or a config file. beta and
    eps_F default to the run's objective.beta and objective.cost_clip (eps_f=None: no clip)."""
    cfg = _config(Path(source), overrides, prompts, responses, max_response_len)
    beta = cfg.objective.beta if beta is None else beta
    eps_f = cfg.objective.cost_clip if eps_f == "config" else eps_f
    current, ref = _checkpoint(cfg, checkpoint), _checkpoint(cfg, reference)
    l_by_prompt = sample_log_ratios(cfg, current, ref, responses)
    lengths = [l.numel() for rs in l_by_prompt for l in rs]
    result = {
        "current": str(current or "init"), "reference": str(ref or "init"),
        "prompts": prompts, "responses": responses, "beta": beta, "eps_F": eps_f,
        "mean_response_len": sum(lengths) / len(lengths), "unit": UNIT,
        "V": variance_table(l_by_prompt, horizons, beta, eps_f),
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_table(result: dict) -> str:
    rows = [f"V(H) in 1e-3 units, {result['prompts']} prompts x {result['responses']} responses, "
            f"beta {result['beta']}, eps_F {result['eps_F']}, current {result['current']}, "
            f"reference {result['reference']}, mean length {result['mean_response_len']:.1f}",
            f"{'H':>6}  {'V(H)':>12}"]
    rows += [f"{h:>6}  {v:12.4f}" if math.isfinite(v) else f"{h:>6}  {'nan':>12}"
             for h, v in result["V"].items()]
    return "\n".join(rows)


def add_subcommand(sub) -> None:
    """`megapkl diagnose correction-variance ...` (registered by megapkl/cli.py)."""
    from megapkl.config.overrides_cli import _IntermixedParser

    diag = sub.add_parser("diagnose", help="the papers' fixed-policy diagnostics")
    kinds = diag.add_subparsers(dest="diagnostic", required=True)
    cv = kinds.add_parser("correction-variance",
                          help="PKL C.3: variance of the first-token future-KL correction vs H")
    cv.__class__ = _IntermixedParser  # KEY=VALUE anywhere on the line
    cv.add_argument("source", metavar="RUN_DIR_OR_CONFIG")
    cv.add_argument("--checkpoint", default=None,
                    help="current policy: a checkpoint step directory, 'init', or the run's latest (default)")
    cv.add_argument("--reference", default="init",
                    help="reference policy: a checkpoint step directory or 'init' (default)")
    cv.add_argument("--prompts", type=int, default=16)
    cv.add_argument("--responses", type=int, default=16)
    cv.add_argument("--horizons", type=parse_horizons, default=list(DEFAULT_HORIZONS),
                    help="comma-separated H values or 'full' (default 1,2,4,8,16,32,64,full)")
    cv.add_argument("--beta", type=float, default=None,
                    help="credit scale (default: the run's objective.beta)")
    cv.add_argument("--eps-f", default=None,
                    help="cost clip eps_F, or 'none' (default: the run's objective.cost_clip)")
    cv.add_argument("--max-response-len", type=int, default=None)
    cv.add_argument("--out", default=None, help="also write the result as JSON")
    cv.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    cv.set_defaults(func=_cmd)


def _cmd(args) -> int:
    eps = ("config" if args.eps_f is None else None if str(args.eps_f).lower() == "none"
           else float(args.eps_f))
    result = run_correction_variance(args.source, checkpoint=args.checkpoint, reference=args.reference,
                                     prompts=args.prompts, responses=args.responses,
                                     horizons=args.horizons, beta=args.beta, eps_f=eps,
                                     max_response_len=args.max_response_len,
                                     overrides=args.overrides, out=args.out)
    print(format_table(result))
    return 0
