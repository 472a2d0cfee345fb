"""Components are built from their own config sections: during a run, no function but the entry
points (`loop.run`, `Trainer.__init__`, the local launcher's rank entry) and the config package's
own (the RunConfig's methods, the loader's dump) is handed the whole RunConfig.

Each run is traced on every rank with `sys.setprofile` / `threading.setprofile`: every megapkl
function called, the generation thread's included, has its arguments checked (positional,
keyword, *args and **kwargs). The runs cover construction, a resume, an evaluation, checkpoints,
the Hugging Face export, data parallelism, and the asynchronous producer with launched servers.
"""
from __future__ import annotations

import inspect
import sys
import threading

from megapkl.config import load_config

DEMO = "configs/demo/cpu_demo.yaml"
BASE = ["logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
        "rollout.responses_per_prompt=4", "rollout.max_response_len=4",
        "parallel.micro_batch_size=4"]
EVAL = ["eval.every=2", "eval.benchmarks=[{name: next_mod10, greedy: true}]"]
# (file under megapkl/, qualified name): the entry points that take the whole run
ENTRIES = {("train/loop.py", "run"), ("train/loop.py", "Trainer.__init__"),
           ("train/local.py", "_rank_main")}


def _takes_run_config(frame, run_config: type) -> bool:
    code, local = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    given = [local.get(name) for name in code.co_varnames[:n]]
    if code.co_flags & inspect.CO_VARARGS:
        given += list(local.get(code.co_varnames[n], ()))
        n += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        given += list(local.get(code.co_varnames[n], {}).values())
    return any(isinstance(v, run_config) for v in given)


def traced_run(rank: int, world: int, cfg) -> list[str]:
    """Train `cfg` on this rank; returns 'file:qualname' of every function outside the entry
    points and the config package that was handed the RunConfig."""
    from megapkl.config.run import RunConfig
    from megapkl.train.loop import run

    found: set[str] = set()
    root = "/megapkl/"

    def profile(frame, event, arg):  # noqa: ARG001 - the profiler's signature
        if event != "call" or root not in frame.f_code.co_filename:
            return
        where = frame.f_code.co_filename.rsplit(root, 1)[1]
        if where.startswith("config/") or (where, frame.f_code.co_qualname) in ENTRIES:
            return
        if _takes_run_config(frame, RunConfig):
            found.add(f"megapkl/{where}:{frame.f_code.co_qualname}")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(found)


def test_no_component_is_handed_the_whole_run_config(dist_run, tmp_path):
    sync = tmp_path / "sync"
    first = load_config(DEMO, [*BASE, *EVAL, "parallel.data=2", f"run_dir={sync}",
                               "train.steps=3", "checkpoint.every=2", "checkpoint.export_hf=true"])
    resumed = load_config(DEMO, [*BASE, *EVAL, "parallel.data=1", f"run_dir={sync}",
                                 "train.steps=4", "checkpoint.resume=true"])
    ahead = load_config("configs/demo/cpu_demo_async.yaml", [
        *BASE, "parallel.data=1", f"run_dir={tmp_path / 'async'}", "train.steps=2",
        "checkpoint.every=1"])
    found = {}
    for name, cfg, world in (("DP=2", first, 2), ("resumed", resumed, 1), ("async", ahead, 1)):
        for rank, names in enumerate(dist_run(traced_run, world, cfg, timeout=300)):
            for f in names:
                found.setdefault(f, []).append(f"{name} rank {rank}")
    assert not found, "handed the whole RunConfig (take the sections instead): " + "; ".join(
        f"{f} ({', '.join(where)})" for f, where in sorted(found.items()))
