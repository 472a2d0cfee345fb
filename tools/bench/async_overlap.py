"""Benchmark: what generating ahead of training (rollout.async_batches) buys, per protocol.

For each staleness protocol the same tiny run trains twice, side by side in one invocation:
synchronously and with rollout.async_batches, its rollout server (`megapkl serve`, the embedded
engine behind SGLang's HTTP API, launched by the trainer) in its own process. With two or more
cores the trainer is pinned to one core and the server to another (`taskset`), so they do not
share a core. Printed per protocol, in seconds per update (the first updates left out: warm-up):

- sync: wall time of the synchronous run;
- async: wall time of the asynchronous run;
- gen: generation alone (the synchronous run's weight pushes, generation and reward);
- train: training alone (the rest of the synchronous run's update);
- limit: max(gen, train), what perfect overlap would reach; async/limit and sync/async.

The two runs' metrics.jsonl must agree (timing fields aside); the script says so for each protocol.

    python tools/bench/async_overlap.py                          # every protocol, 16 updates
    python tools/bench/async_overlap.py --protocols controlled_staleness --steps 24 KEY=VALUE ...
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

PROTOCOLS = {
    "periodic_refresh": ["rollout.refresh_every=4", "reference.refresh_every=4"],
    "controlled_staleness": ["rollout.protocol=controlled_staleness", "rollout.refresh_every=null",
                             "rollout.max_staleness=4", "rollout.minibatches_per_batch=4",
                             "reference.refresh_every=4"],
    "uniform_stale": ["rollout.protocol=uniform_stale", "rollout.refresh_every=null",
                      "rollout.max_staleness=4", "rollout.snapshot_pool=8",
                      "reference.refresh_every=4"],
}
GENERATION = ("sync", "generate", "reward")
# Below Linux's ephemeral range (32768-60999), where megapkl warns that an outgoing connection can
# take a server's port before it binds (warn_if_ephemeral: routers sit at base + 1000), and clear
# of the default base_port 30000 that a run of the same host may hold.
BASE_PORT = 31500


def base(run_dir: Path, steps: int, pin: bool, model: str) -> list[str]:
    serve = ["{python}", "-m", "megapkl.serve.serve", "--model-config", model,
             "--host", "{host}", "--port", "{port}", "--log-level", "warning"]
    if pin:
        serve = ["taskset", "-c", "1", *serve]
    return [f"model.name={model}", "model.hf_checkpoint=null", "model.dtype=fp32",
            "parallel.data=1", "parallel.micro_batch_size=32", f"train.steps={steps}",
            "rollout.engine=sglang", "rollout.sglang.colocate=false",
            "rollout.sglang.use_router=false", f"rollout.sglang.server_command={json.dumps(serve)}",
            f"rollout.sglang.base_port={BASE_PORT}", "rollout.sglang.startup_timeout_s=300",
            "rollout.prompts_per_batch=16", "rollout.responses_per_prompt=8",
            "rollout.max_response_len=12", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.export_hf=false",
            f"run_dir={run_dir}"]


def train(overrides: list[str]) -> list[dict]:
    from megapkl.config import load_config
    from megapkl.train.local import train_local
    from megapkl.train.metrics_log import read_metrics

    cfg = load_config("configs/demo/cpu_demo.yaml", overrides)
    train_local(cfg)
    return read_metrics(cfg.run_dir)


def per_update(rows: list[dict], keys) -> float:
    return sum(sum(r.get(f"time/{k}_s", 0.0) for k in keys) for r in rows) / len(rows)


def measure(protocol: str, steps: int, skip: int, pin: bool, extra: list[str], tmp: Path,
            model: str) -> dict:
    from megapkl.train.metrics_log import wall_clock

    runs = {}
    for mode, ahead in (("sync", "0"), ("async", "2")):
        run_dir = tmp / protocol / mode
        runs[mode] = train([*base(run_dir, steps, pin, model), *PROTOCOLS[protocol], *extra,
                            f"rollout.async_batches={ahead}"])
    same = [{k: v for k, v in r.items() if not wall_clock(k)} for r in runs["sync"]] == \
        [{k: v for k, v in r.items() if not wall_clock(k)} for r in runs["async"]]
    sync, asyn = runs["sync"][skip:], runs["async"][skip:]
    out = {"sync": per_update(sync, ["update"]), "async": per_update(asyn, ["update"]),
           "gen": per_update(sync, GENERATION), "identical": same}
    out["train"] = out["sync"] - out["gen"]
    out["limit"] = max(out["gen"], out["train"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=list(PROTOCOLS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=4, help="first updates left out (warm-up)")
    ap.add_argument("--model", default="tiny-qwen3", help="model spec (name or YAML) of trainer "
                    "and server; tools/bench/overlap-qwen3.yaml makes training and generation "
                    "cost about the same here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    import torch

    pin = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    if pin:
        os.sched_setaffinity(0, {0})  # the trainer (and the router-less client) on core 0
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="async_overlap_"))
    print(f"{args.steps} updates per run ({args.skip} left out), trainer "
          f"{'on core 0, server on core 1' if pin else 'and server unpinned'}; s per update")
    print(f"{'protocol':22s} {'sync':>7s} {'async':>7s} {'gen':>7s} {'train':>7s} {'limit':>7s} "
          f"{'async/limit':>11s} {'sync/async':>10s}  metrics")
    for protocol in args.protocols:
        m = measure(protocol, args.steps, args.skip, pin, args.overrides, tmp, args.model)
        print(f"{protocol:22s} {m['sync']:7.3f} {m['async']:7.3f} {m['gen']:7.3f} "
              f"{m['train']:7.3f} {m['limit']:7.3f} {m['async'] / m['limit']:11.2f} "
              f"{m['sync'] / m['async']:10.2f}  {'identical' if m['identical'] else 'DIFFER'}",
              flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
