"""GPU check: real train steps of a Qwen3-1.7B-shaped model (random weights) in bf16 on one GPU.

Runs megapkl's own trainer (`megapkl.train.loop.Trainer`: megatron-core model, DDP, distributed
optimizer, NCCL world size 1, the embedded rollout engine on the same GPU) for `--steps` updates
of the CPU demo's task and protocol, scaled to longer responses (the last update saves a
checkpoint), then resumes from that checkpoint for `--resume-steps` more updates through
`megapkl.train.loop.run`, and asserts:
- every update: finite loss and an applied optimizer step;
- bf16 model parameters, fp32 main parameters in the optimizer;
- every tensor entering the model is on the trainer's device (cuda:0);
- the learner's log-probs equal a recomputation (a plain forward of the same model chunk plus an
  fp32 log-softmax) within bf16 tolerance, and the engine's rollout log-probs of the same weights
  agree with the learner's within bf16 tolerance;
- the resumed run starts at the checkpoint's update and metrics.jsonl ends with one row per update
  (0 .. steps + resume_steps - 1), every loss finite;
and prints tokens/s, MFU against 989 TFLOP/s (H100/H200 dense bf16), peak memory and the
weight-export seconds, as one JSON line. Exit status 1 when a check fails.

    python tools/gpu_checks/train_gpu.py                      # the GPU check (one GPU, ~3-5 min)
    python tools/gpu_checks/train_gpu.py --device cpu --tiny  # dry run of the same logic on CPU

The rewards of a random-weight model are the task's (first response token's class mod 10, so
about 1 in 10 is correct), enough for non-zero advantages. See README.md next to this file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny-qwen3 instead of qwen3-1.7b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--resume-steps", type=int, default=2,
                    help="updates after resuming from the final checkpoint (0: no resume)")
    ap.add_argument("--response-len", type=int, default=None, help="default 256 (tiny: 8)")
    return ap.parse_args(argv)


def run_config(args, run_dir: str, steps=None, resume: bool = False):
    from megapkl.config import configs_dir, load_config

    tiny = args.tiny
    steps = args.steps if steps is None else steps
    overrides = [
        f"model.name={'tiny-qwen3' if tiny else 'qwen3-1.7b'}", "model.dtype=bf16",
        "parallel.data=1", f"parallel.micro_batch_size={8 if tiny else 16}",
        f"rollout.prompts_per_batch={4 if tiny else 16}", "rollout.responses_per_prompt=8",
        f"rollout.max_response_len={args.response_len or (8 if tiny else 256)}",
        "advantage.filter_constant_groups=false",  # fixed generation work per update
        f"train.steps={steps}", "train.lr=1e-5", f"run_dir={run_dir}",
        "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0",
        "checkpoint.keep=1", f"checkpoint.resume={'true' if resume else 'false'}",
    ]
    return load_config(configs_dir() / "demo" / "cpu_demo.yaml", overrides)


def start_single_process(device: str) -> None:
    """World size 1 (NCCL on a GPU, gloo on CPU), as torchrun would describe it."""
    from megapkl.parallel.forked import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    if device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --device cpu --tiny for the dry mode")
        torch.cuda.set_device(0)


# ---------------------------------------------------------------- probes


def tensors_in(obj, depth: int = 0):
    """Every tensor reachable from `obj` (containers, dataclasses, NamedTuples, plain objects)."""
    if depth > 4 or obj is None:
        return
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, depth + 1)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        if isinstance(obj, torch.nn.Module):
            return
        fields = vars(obj) if hasattr(obj, "__dict__") else {
            f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        for v in fields.values():
            yield from tensors_in(v, depth + 1)


class Probe:
    """Times the learner's train steps and counts their tokens (prompt + response of the samples
    packed for the step: padding excluded); records the devices of every tensor that enters the
    model (a forward pre-hook on each chunk)."""

    def __init__(self, learner) -> None:
        from megapkl.parallel.chunks import unwrap

        self.step_s, self.tokens, self.devices = [], [], set()
        self.metrics: list[dict] = []
        self._packed = 0
        for chunk in learner.model:
            unwrap(chunk).register_forward_pre_hook(self._record, with_kwargs=True)
        self._wrap(learner, "pack", self._counted_pack)
        self._wrap(learner, "train_step", self._timed_step)

    def _counted_pack(self, inner, samples):
        self._packed = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return inner(samples)

    @staticmethod
    def _wrap(obj, name, wrapper):
        inner = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: wrapper(inner, *a, **k))

    def _record(self, module, args, kwargs):
        self.devices |= {str(t.device) for t in tensors_in((args, kwargs))}

    def _timed_step(self, inner, micro_batches, step, **kwargs):
        sync()
        t0 = time.perf_counter()
        metrics, applied = inner(micro_batches, step, **kwargs)
        sync()
        self.step_s.append(time.perf_counter() - t0)
        self.tokens.append(self._packed)
        self.metrics.append({"loss": metrics.get("loss", math.nan), "applied": applied})
        return metrics, applied


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_export(learner) -> tuple[list, float]:
    sync()
    t0 = time.perf_counter()
    items = [(n, t.detach().to("cpu", copy=True)) for n, t in learner.export()]
    return items, time.perf_counter() - t0


# ---------------------------------------------------------------- checks


def flops_per_token(spec, seq_len: float) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): the matmuls of every layer,
    the causal attention scores (mean context seq_len / 2) and the output layer."""
    h, heads, groups, d = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    qkv_o = h * d * (2 * heads + 2 * groups)
    mlp = 3 * h * spec.ffn_hidden_size
    attention = 2 * heads * d * (seq_len / 2)  # QK^T and AV per token
    forward = 2 * spec.num_layers * (qkv_o + mlp + attention) + 2 * h * spec.vocab_size
    return 3 * forward


def recomputed_logprobs(learner, samples, temperature: float) -> list[torch.Tensor]:
    """log softmax(logits / T) at each response token: one plain forward of the model chunk per
    sample, the fp32 softmax over the full vocabulary (TP = 1)."""
    from megapkl.parallel.chunks import unwrap

    model, out = unwrap(learner.model[0]), []
    device = next(model.parameters()).device
    with torch.no_grad():
        for s in samples:
            ids = torch.cat([torch.as_tensor(s.prompt_ids), torch.as_tensor(s.response_ids)])
            ids = ids.to(device).unsqueeze(0)
            pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
            logits = model(ids, pos, None).float() / temperature          # [1, S, V]
            logp = torch.log_softmax(logits[0, :-1], dim=-1)
            targets = ids[0, 1:]
            start = len(s.prompt_ids) - 1
            out.append(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[start:].cpu())
    return out


def learner_logprobs(trainer, samples) -> list[torch.Tensor]:
    """The trainer's own log-prob pass (megatron schedule + the chunked vocab op)."""
    for s in samples:
        s.advantage = 0.0
    by_uid = trainer.learner.logprobs(trainer.learner.pack(samples))
    return [by_uid[s.uid].float().cpu() for s in samples]


def fresh_samples(trainer, n_prompts: int, max_new: int):
    """Samples from the engine holding the learner's current weights (staleness 0)."""
    from megapkl.rollout.engine import SamplingParams

    engine = trainer.slot.engine
    weights, export_s = timed_export(trainer.learner)
    engine.update_weights(iter(weights), version=10_000)
    prompts = [trainer.rollouts.dataset[i] for i in range(n_prompts)]
    samples = engine.generate(prompts, 2, SamplingParams(max_new_tokens=max_new,
                                                         temperature=trainer.learner.temperature,
                                                         seed=123))
    for i, s in enumerate(samples):
        s.uid = 1_000_000 + i
    return samples, export_s


def update_split(run_dir: str) -> dict:
    """Median seconds per update and of each part the trainer times (metrics.jsonl `time/*_s`),
    the first update (warm-up) left out: where an update's time goes, next to tokens/s and MFU."""
    from megapkl.train.timers import NAMES

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    rows = rows[1:] or rows

    def median(key: str) -> float | None:
        vals = sorted(r[key] for r in rows if isinstance(r.get(key), (int, float)))
        return round(vals[len(vals) // 2], 4) if vals else None
    parts = {p: median(f"time/{p}_s") for p in NAMES}
    return {"update_s": median("time/update_s"),
            "update_split_s": {p: v for p, v in parts.items() if v is not None}}


def check(results: dict, name: str, ok: bool, detail) -> None:
    results["checks"][name] = {"ok": bool(ok), "detail": detail}


def resume_leg(args, run_dir: str, res: dict) -> None:
    """Resume from the final checkpoint for --resume-steps updates (a fresh Trainer in the same
    process, through the public entry point) and check metrics.jsonl."""
    from megapkl.train.loop import run

    total = args.steps + args.resume_steps
    sync()
    t0 = time.perf_counter()
    run(run_config(args, run_dir, steps=total, resume=True))
    sync()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    steps = {}
    for row in rows:  # a step logged again after a resume: its last line counts
        steps[int(row["step"])] = row
    losses = [steps[k].get("loss") for k in sorted(steps)]
    check(res, "resume_continues_from_checkpoint",
          sorted(steps) == list(range(total)) and all(
              isinstance(x, float) and math.isfinite(x) for x in losses),
          {"steps": sorted(steps), "resumed_losses": losses[args.steps:]})
    res["resume_s"] = round(time.perf_counter() - t0, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    start_single_process(args.device)
    from megapkl.models.optimizer import main_params
    from megapkl.train.loop import Trainer
    from megapkl.train.run_context import RunContext

    t_start = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="megapkl_gpu_check_")
    cfg = run_config(args, run_dir)
    context = RunContext().__enter__()  # closed below, as `megapkl.train.loop.run` closes it
    trainer = Trainer(cfg, context)
    learner = trainer.learner
    probe = Probe(learner)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.run()
    res: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                 "model": cfg.model.name, "steps": len(probe.step_s), "checks": {}}

    losses = [m["loss"] for m in probe.metrics]
    check(res, "finite_loss_every_step", len(losses) == args.steps and all(
        math.isfinite(x) for x in losses), losses)
    check(res, "every_update_applied", all(m["applied"] for m in probe.metrics),
          [m["applied"] for m in probe.metrics])
    params = {str(p.dtype) for c in learner.model for p in c.parameters()}
    mains = {str(p.dtype) for p in main_params(learner.optimizer)}
    check(res, "bf16_params", params == {"torch.bfloat16"}, sorted(params))
    check(res, "fp32_main_params", mains == {"torch.float32"}, sorted(mains))
    want = "cuda:0" if args.device == "cuda" else "cpu"
    check(res, "model_inputs_on_device", probe.devices == {want}, sorted(probe.devices))

    samples, export_s = fresh_samples(trainer, 4, cfg.rollout.max_response_len)
    mine = learner_logprobs(trainer, samples)
    again = recomputed_logprobs(learner, samples, learner.temperature)
    behav = [s.logp_behav.float().cpu() for s in samples]
    flat = torch.cat(mine)
    err_re = max(float((a - b).abs().max()) for a, b in zip(mine, again))
    err_engine = [float((a - b).abs().mean()) for a, b in zip(mine, behav)]
    spread = float(flat.std())  # random weights: the check is only meaningful if logp varies
    check(res, "logp_vs_recomputation", err_re < 0.05 and spread > 0.05,
          {"max_abs": err_re, "logp_std": spread})
    check(res, "logp_vs_engine", max(err_engine) < 0.05, {"mean_abs_per_response": err_engine})

    spec = learner.spec
    seq = sum(probe.tokens) / max(1, len(probe.tokens)) / (cfg.rollout.prompts_per_batch
                                                          * cfg.rollout.responses_per_prompt)
    timed = probe.step_s[1:] or probe.step_s  # the first step includes one-off warm-up
    tok_s = sum(probe.tokens[-len(timed):]) / sum(timed)
    res.update(
        tokens_per_s=round(tok_s, 1),
        mfu=round(tok_s * flops_per_token(spec, seq) / PEAK_FLOPS, 4),
        mean_seq_len=round(seq, 1),
        step_s=[round(x, 3) for x in probe.step_s],
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if args.device == "cuda" else None,
        weight_export_s=round(export_s, 3),
        **update_split(run_dir),
    )
    context.__exit__(None, None, None)  # the engine stops, the run lock is released
    del trainer, learner, probe, samples
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if args.resume_steps:
        resume_leg(args, run_dir, res)
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    ok = all(c["ok"] for c in res["checks"].values())
    res["ok"] = ok
    print(json.dumps(res), flush=True)
    if not ok:
        bad = [k for k, c in res["checks"].items() if not c["ok"]]
        print(f"FAILED: {bad}", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
