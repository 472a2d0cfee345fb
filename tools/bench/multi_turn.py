"""Benchmark: what a tool's latency costs a batch of multi-turn rollouts, on each engine.

A batch of multi-turn trajectories is generated twice with the same seeds and the same
environment, whose every step answers after a fixed latency (`--latency-ms`, 50 by default) or at
once: the same tokens (checked), so the ratio of the two wall times is what the tool's latency
costs. Measured side by side, alternately, on

- the SGLang engine through `megapkl serve` worker processes (the embedded engine behind
  SGLang's HTTP API; requests from many trajectories at once, as SGLang serves them): every
  trajectory goes at its own pace, one request per turn, so while one waits on its tool the
  servers serve the others' turns; the goal is a ratio of at most 1.2;
- the embedded engine: a batch decodes in rounds, and a round waits for its slowest tool call
  (docs/agents.md, "Engines": continuous batching would hide it).

It also prints the wall time of the SGLang engine over that of the embedded engine, with and
without the tool's latency (the same trajectories' count and budgets; the draws differ). On CPU
that ratio measures `megapkl serve`, a stand-in that runs each HTTP request as an engine call of
its own (no batching across requests, no prefix cache: every turn recomputes its context), not
SGLang's continuous batching.

    python tools/bench/multi_turn.py                       # 2 workers, 64 trajectories
    python tools/bench/multi_turn.py --workers 2 --prompts 16 --n 4 --turns 3 --reps 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megapkl.envs.base import End, Environment, Observation  # noqa: E402


class Delayed(Environment):
    """After each turn "<o>k</o>" (k: the turn), the answer after `latency_s`; the driver's
    max_turns ends the trajectory."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    def step(self, turn):
        time.sleep(self.latency_s)
        if turn.turn >= 99:
            return End("answer")
        return Observation(f"<o>{turn.turn}</o>", closing="</o>", tool="delay")


def start_workers(count: int, model: str, work: Path) -> list:
    from megapkl.rollout.sglang.launch import ServerProcess, pick_ports, wait_healthy

    procs = []
    for i, port in enumerate(pick_ports("127.0.0.1", 39400, count)):
        cmd = [sys.executable, "-m", "megapkl.cli", "serve", "--model-config", model, "--host",
               "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        proc = ServerProcess(f"worker{i}", f"http://127.0.0.1:{port}", cmd,
                             work / f"worker{i}.log", env={"OMP_NUM_THREADS": "1"})
        procs.append(proc.start())
    for p in procs:
        wait_healthy(p, p.url, first_wait_s=0.0, interval_s=0.3, timeout_s=10.0, deadline_s=300.0,
                     what="megapkl serve")
    return procs


def engines(args, work: Path):
    """(SGLang engine over the workers, embedded engine) holding the same random weights."""
    import torch

    from megapkl.models.spec import hf_config_dict, load_spec
    from megapkl.rollout.embedded import EmbeddedEngine, checkpoint_tensors
    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
    from megapkl.rollout.sglang.weights import SyncSettings, WeightSync
    from megapkl.rollout.synthetic import CharTokenizer

    hf = hf_config_dict(load_spec(args.model), dtype="float32")
    torch.manual_seed(0)
    embedded = EmbeddedEngine(hf, tokenizer=CharTokenizer(), max_batch_size=args.prompts * args.n)
    weights = [(n, torch.randn_like(t) * 0.05) for n, t in checkpoint_tensors(embedded.model)]
    embedded.update_weights(weights, version=1)
    procs = start_workers(args.workers, args.model, work)
    fleet = Fleet([Worker(p.url, state="ready") for p in procs],
                  health=HealthSettings(timeout_s=60))
    served = SGLangEngine(fleet, hf, WeightSync(SyncSettings(mode="tensor", timeout_s=120)),
                          tokenizer=CharTokenizer(), heartbeat=False,
                          max_concurrency=args.prompts * args.n)
    served.update_weights(weights, version=1)
    return served, embedded, procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=8)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import torch

    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.sample import PromptItem
    from megapkl.rollout.synthetic import CharTokenizer
    from megapkl.rollout.turns import Budgets, TurnDriver

    torch.set_num_threads(1)
    tok = CharTokenizer()
    prompts = [PromptItem(tok.encode(f"q{i}:", add_special_tokens=False))
               for i in range(args.prompts)]
    budgets = Budgets(max_turns=args.turns, max_response_tokens=args.turns * (args.turn_tokens + 6),
                      max_turn_tokens=args.turn_tokens, max_observation_tokens=6)
    sampling = SamplingParams(max_new_tokens=budgets.max_response_tokens, seed=3, ignore_eos=True)
    drivers = {lat: TurnDriver(Delayed(lat), tok, budgets, concurrency=args.prompts * args.n)
               for lat in (0.0, args.latency_ms / 1000)}
    work = Path(tempfile.mkdtemp(prefix="megapkl-bench-turns-"))
    served, embedded, procs = engines(args, work)
    times: dict = {}
    tokens: dict = {}
    try:
        for rep in range(args.reps + 1):  # the first round warms up, untimed
            for name, engine in (("megapkl serve", served), ("embedded", embedded)):
                for lat, driver in (drivers.items() if rep % 2 else reversed(drivers.items())):
                    t0 = time.perf_counter()
                    samples = engine.generate(prompts, args.n, sampling, turns=driver)
                    took = time.perf_counter() - t0
                    seqs = [s.response_ids.tolist() for s in samples]
                    tokens.setdefault((name, lat), seqs)
                    assert tokens[(name, lat)] == seqs, f"{name}: a rerun drew other tokens"
                    if rep:
                        times.setdefault((name, lat), []).append(took)
    finally:
        served.close()
        for p in procs:
            p.stop()
        for d in drivers.values():
            d.close()
    lat = args.latency_ms / 1000
    trajs = args.prompts * args.n
    per = sum(len(s) for s in tokens[("embedded", 0.0)]) / trajs
    print(f"{trajs} trajectories ({args.prompts} prompts x {args.n}) of {args.turns} turns x "
          f"{args.turn_tokens} tokens ({per:.0f} response tokens each), model {args.model}, tool "
          f"latency {args.latency_ms:g} ms per step, {args.reps} reps (median), "
          f"{os.cpu_count()} CPUs")
    for name in ("megapkl serve", "embedded"):
        same = tokens[(name, 0.0)] == tokens[(name, lat)]
        fast, slow = statistics.median(times[(name, 0.0)]), statistics.median(times[(name, lat)])
        where = f"{args.workers} workers" if name == "megapkl serve" else "one batch, in rounds"
        print(f"  {name:14s} ({where:20s}) no latency {fast:7.3f} s   with latency {slow:7.3f} s"
              f"   ratio {slow / fast:5.2f}x   same tokens: {'yes' if same else 'NO'}")
    for name, at in (("no latency", 0.0), ("with latency", lat)):
        s = statistics.median(times[("megapkl serve", at)])
        e = statistics.median(times[("embedded", at)])
        print(f"  megapkl serve / embedded, {name:12s}: {s:7.3f} s / {e:7.3f} s = {s / e:5.2f}x")


if __name__ == "__main__":
    main()
