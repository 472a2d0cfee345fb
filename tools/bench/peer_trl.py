"""Peer benchmark: megapkl and Hugging Face TRL's `GRPOTrainer` on the CPU demo's task.

Both sides train the demo's tiny Qwen3 on `next_mod10` with on-policy GRPO, one process each given
2 threads (OMP_NUM_THREADS / MKL_NUM_THREADS 2), from the one description `DESCRIPTION`;
`megapkl_overrides` and `trl_settings` derive each side's settings from it
(tests/test_bench_peer.py checks that they agree). megapkl runs its torch on the demo config's
`parallel.cpu_threads` (1: this model's operators are too small to split, and one thread is as
fast as two at half the CPU), TRL on the 2 it is given. A third system, `megapkl DP=2`, is
megapkl with the same settings as two data-parallel ranks of one thread each (the same two
cores, the same batch, each rank training half of the micro-batches); a fourth, `TRL 1 thread`,
is TRL on one torch thread, so that the thread count is compared on both sides. Runs alternate
(the order of the systems reverses every seed) so that load on the machine falls on all alike, and
each is a subprocess whose peak RSS the kernel reports (for DP=2: the largest of its processes).

    python tools/bench/peer_trl.py --install          # once: the side environment (local wheels)
    python tools/bench/peer_trl.py [--seeds 2] [--updates 300] [--threshold 0.9] [--set KEY=VALUE]

Printed per system: seconds per update (median over the updates of a run, then median and range
over seeds; also the run's 10th percentile, and CPU seconds per update, which say more than the
median on a host that other work loads: the wall time of an update there grows by the time the
process waits for a core), response tokens per second, peak RSS, the host's load average during
the run, updates until the training accuracy (EMA 0.2,
as `megapkl compare`) reaches the threshold, the final accuracy (mean of the last 10 updates), and
the paired ratio megapkl / TRL of seconds per update (the two runs of one seed).

Settings that map one to one (DESCRIPTION key: megapkl key / TRL `GRPOConfig` field):
- model: configs/models/tiny-qwen3.yaml / `Qwen3ForCausalLM` built from `hf_config_dict` of the
  same spec (the config megapkl's HF export writes), fp32 on both sides, no dropout, tied
  embeddings, no gradient checkpointing (model.recompute none / gradient_checkpointing=False).
- prompts_per_update x group_size: rollout.prompts_per_batch x rollout.responses_per_prompt /
  gradient_accumulation_steps x per_device_train_batch_size = generation batch, num_generations.
- micro_batch_size: parallel.micro_batch_size / per_device_train_batch_size; one optimizer update
  per batch (rollout.minibatches_per_batch 1 / steps_per_generation = gradient accumulation).
- max_response_len: rollout.max_response_len / max_completion_length; temperature, top_p, no
  top-k (-1 / 0). max_prompt_len is megapkl's only (GRPOConfig has no prompt limit; the prompts
  are 2 tokens).
- lr, constant schedule, no warmup; AdamW betas, eps, weight decay; grad_clip / max_grad_norm.
- objective: grpo, on-policy (rollout.protocol on_policy, reference.mode behavior: the proximal
  reference is the sampling policy) / num_iterations=1, beta=0 (no KL term); clip 0.2 on both
  sides (never active on-policy: the ratio is 1).
- advantage: group mean subtracted, no std division (advantage.mode group_mean /
  scale_rewards="none"); loss: token mean over the update's batch (objective.aggregation
  token_mean / loss_type="dapo", which normalizes by the batch's completion tokens).
- data: the task's 100 prompts ("d", BOS-prefixed, character tokens: TRL gets a tokenizer with the
  same ids as megapkl's CharTokenizer), shuffled per epoch; reward: `NextMod10.is_correct` on the
  response token ids (the first token read as a digit), +1 / -1, on both sides.

What cannot be made equal:
- initial weights: megatron-core's init (output projections scaled by 1/sqrt(2 layers)) against
  transformers' (normal 0.02 everywhere), and each side's own RNG streams for prompts and sampling:
  learning curves agree in distribution only, so updates-to-threshold differ by seed noise.
- the work per update besides the math: megapkl exports and pushes the weights to its embedded
  engine every update, and logs its off-policy and mismatch statistics; TRL generates with the
  policy module itself (`generate`) and logs its own metrics. Those differences are what the
  per-update time compares.
- prompt order: megapkl walks a per-epoch permutation, TRL samples 16 distinct prompts per update.

The side environment (`--install`): `.bench-venvs/trl`, a plain venv whose `.pth` file adds
megapkl's `.venv` site-packages after its own, so both sides use the same torch and transformers
and nothing installs torch or CUDA libraries; trl, accelerate and datasets (and what they need
beyond `.venv`) install with `pip --no-index` from the wheel directories named in
MEGAPKL_WHEEL_DIRS (os.pathsep-separated; default: the wheel cache of tools/setup_env.sh) plus
pip's own find-links. No registry is asked.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".bench-venvs" / "trl"
PINS = ("trl==1.13.0", "accelerate==1.15.0", "datasets==5.0.1")
DEMO_CONFIG = ROOT / "configs" / "demo" / "cpu_demo.yaml"
THREADS = 2
WARMUP = 2  # first updates left out of the per-update time (allocator and caches warming up)
FINAL_WINDOW = 10
EMA_ALPHA = 0.2
# --systems, in the order of the first seed
SYSTEMS = ("megapkl", "TRL", "megapkl DP=2", "TRL 1 thread")

DESCRIPTION = {
    "task": "next_mod10", "model": "tiny-qwen3", "dtype": "fp32",
    "prompts_per_update": 16, "group_size": 8, "micro_batch_size": 16,
    "max_prompt_len": 16, "max_response_len": 2,
    "temperature": 1.0, "top_p": 1.0,
    "lr": 3.0e-3, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1.0e-8,
    "weight_decay": 0.0, "grad_clip": 1.0, "clip_eps": 0.2,
    "reward_correct": 1.0, "reward_incorrect": -1.0,
}


def megapkl_overrides(d: dict, seed: int, updates: int, run_dir: Path, ranks: int = 1
                      ) -> list[str]:
    """`megapkl train configs/demo/cpu_demo.yaml` overrides for the description: on-policy GRPO,
    in one process or as `ranks` data-parallel ranks (megapkl's local launcher gives each rank
    cpu_count // ranks threads: one each here). The update's batch and micro-batch size are the
    same at any rank count: each rank trains its share of the micro-batches."""
    return [
        f"seed={seed}", f"run_dir={run_dir}", f"model.name={d['model']}",
        f"model.dtype={d['dtype']}", "model.recompute=none", f"parallel.data={ranks}",
        f"parallel.micro_batch_size={d['micro_batch_size']}",
        "objective.name=grpo", "objective.aggregation=token_mean",
        f"objective.eps_clip_low={d['clip_eps']}", f"objective.eps_clip_high={d['clip_eps']}",
        "objective.kl_init_coef=0.0", "objective.entropy_coef=0.0",
        "advantage.mode=group_mean", "reference.mode=behavior",
        "rollout.protocol=on_policy", "rollout.refresh_every=1", "rollout.minibatches_per_batch=1",
        f"rollout.prompts_per_batch={d['prompts_per_update']}",
        f"rollout.responses_per_prompt={d['group_size']}",
        f"rollout.max_prompt_len={d['max_prompt_len']}",
        f"rollout.max_response_len={d['max_response_len']}",
        f"rollout.temperature={d['temperature']}", f"rollout.top_p={d['top_p']}",
        "rollout.top_k=-1",
        f"train.steps={updates}", f"train.lr={d['lr']}", "train.lr_schedule=constant",
        "train.warmup_steps=0", f"train.adam_beta1={d['adam_beta1']}",
        f"train.adam_beta2={d['adam_beta2']}", f"train.adam_eps={d['adam_eps']}",
        f"train.weight_decay={d['weight_decay']}", f"train.grad_clip={d['grad_clip']}",
        f"data.synthetic={d['task']}", "data.prompt_template=raw", "reward.type=synthetic",
        f"reward.correct={d['reward_correct']}", f"reward.incorrect={d['reward_incorrect']}",
        "eval.every=0", "logging.tensorboard=false", "logging.progress_bar=false",
        "checkpoint.every=0",
    ]


def trl_settings(d: dict, seed: int, updates: int, out_dir: Path) -> dict:
    """`trl.GRPOConfig` keyword arguments for the description (plain values: no TRL import)."""
    batch = d["prompts_per_update"] * d["group_size"]
    if batch % d["micro_batch_size"]:
        raise ValueError(f"micro_batch_size {d['micro_batch_size']} must divide the batch {batch}")
    return dict(
        output_dir=str(out_dir), seed=seed, data_seed=seed, max_steps=updates,
        per_device_train_batch_size=d["micro_batch_size"],
        gradient_accumulation_steps=batch // d["micro_batch_size"],
        num_generations=d["group_size"], max_completion_length=d["max_response_len"],
        temperature=d["temperature"], top_p=d["top_p"], top_k=0,
        learning_rate=d["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=d["adam_beta1"], adam_beta2=d["adam_beta2"], adam_epsilon=d["adam_eps"],
        weight_decay=d["weight_decay"], max_grad_norm=d["grad_clip"],
        epsilon=d["clip_eps"], epsilon_high=d["clip_eps"], beta=0.0, num_iterations=1,
        scale_rewards="none", loss_type="dapo",
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False, shuffle_dataset=True,
    )


# ---------------------------------------------------------------- the side environment

def wheel_dirs() -> list[str]:
    raw = os.environ.get("MEGAPKL_WHEEL_DIRS")
    if raw is None:
        raw = os.environ.get("MEGAPKL_WHEEL_CACHE", str(Path.home() / ".cache/megapkl/wheels"))
    return [p for p in raw.split(os.pathsep) if p and Path(p).is_dir()]


def install() -> None:
    """Create `.bench-venvs/trl` over megapkl's `.venv` and install TRL from local wheels only."""
    base_python = ROOT / ".venv" / "bin" / "python"
    if not base_python.exists():
        raise SystemExit(f"peer_trl --install: {base_python} is missing; "
                         "run tools/setup_env.sh first")
    dirs = wheel_dirs()
    if not dirs:
        raise SystemExit("peer_trl --install: no wheel directory: set MEGAPKL_WHEEL_DIRS to the "
                         f"directories holding {', '.join(PINS)} and their dependencies")
    if not (VENV / "bin" / "python").exists():
        subprocess.run([str(base_python), "-m", "venv", str(VENV)], check=True)
    py = str(VENV / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    base_site = subprocess.run([str(base_python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # addsitedir (not a bare path line) so .venv's own .pth files run too: megapkl's editable
    # install is one. It appends, so what this venv installs shadows .venv, never the reverse.
    Path(site, "zz_megapkl_venv.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
    links = [arg for d in dirs for arg in ("--find-links", d)]
    subprocess.run([py, "-m", "pip", "install", "--no-index", *links, *PINS], check=True)
    out = subprocess.run([py, "-c", "import torch, transformers, trl; print(torch.__file__, "
                          "transformers.__version__, trl.__version__)"],
                         check=True, capture_output=True, text=True).stdout.strip()
    print(f"peer_trl: {VENV} ready (torch, transformers, trl: {out})")


# ---------------------------------------------------------------- the TRL side (in the side venv)

def char_tokenizer():
    """A transformers tokenizer with megapkl's CharTokenizer ids: ASCII code points, PAD 0, BOS 1,
    EOS 2, a BOS before every prompt; the ids that are not characters get placeholder names so
    that the vocabulary holds all 128 ids the model can sample."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from megapkl.rollout.synthetic import BOS_ID, EOS_ID, PAD_ID, CharTokenizer, _is_char

    special = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
    vocab = {special.get(i, chr(i) if _is_char(i) else f"<{i}>"): i
             for i in range(CharTokenizer.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", BOS_ID)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def score_completions(task, completion_ids, answers, d: dict = DESCRIPTION) -> list[float]:
    """TRL's rewards, read as megapkl's SyntheticReward reads a sample: `task.is_correct` on the
    response token ids (the EOS included, as both engines return it), correct / incorrect."""
    return [d["reward_correct"] if task.is_correct(ids, a) else d["reward_incorrect"]
            for ids, a in zip(completion_ids, answers)]


def trl_model(d: dict, tokenizer, seed: int):
    """`Qwen3ForCausalLM` of the description's model: the config megapkl's HF export writes."""
    import transformers

    from megapkl.models.spec import hf_config_dict, load_spec

    hf = hf_config_dict(load_spec(d["model"]), dtype="float32")
    config = transformers.Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"},
                                      pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    transformers.set_seed(seed)
    return transformers.Qwen3ForCausalLM(config).float()


def trl_worker(d: dict, seed: int, updates: int, out: Path, threads: int = THREADS) -> None:
    """Train with `trl.GRPOTrainer` on `threads` torch threads; write megapkl-style rows (step,
    time, train/accuracy, response_len/mean) to out/metrics.jsonl, one per optimizer update."""
    import torch

    torch.set_num_threads(threads)
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from megapkl.rollout.synthetic import CharTokenizer, make_synthetic_task

    task = make_synthetic_task(d["task"])
    tokenizer = char_tokenizer()
    for p in task.problems()[:10]:  # the prompts megapkl's data path builds: BOS + characters
        assert tokenizer(p.prompt)["input_ids"] == CharTokenizer().encode(p.prompt), p.prompt
    model = trl_model(d, tokenizer, seed)
    problems = task.problems()
    data = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                       "answer": [p.answer for p in problems]})
    last: dict = {}

    def next_mod10_reward(prompts, completions, completion_ids, answer, **_):
        scores = score_completions(task, completion_ids, answer, d)
        last.update(accuracy=sum(x == d["reward_correct"] for x in scores) / len(scores),
                    response_len=sum(len(ids) for ids in completion_ids) / len(scores))
        return scores

    out.mkdir(parents=True, exist_ok=True)
    rows = (out / "metrics.jsonl").open("w")

    class Rows(transformers.TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            rows.write(json.dumps({"step": state.global_step - 1,
                                   "time": time.perf_counter() - self.t0,
                                   "train/accuracy": last["accuracy"],
                                   "response_len/mean": last["response_len"]}) + "\n")
            rows.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=next_mod10_reward, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Rows()],
                          args=GRPOConfig(**trl_settings(d, seed, updates, out / "trl")))
    trainer.train()
    rows.close()


# ---------------------------------------------------------------- the runs (megapkl's .venv)

def child_env(threads: int = THREADS) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    env.pop("SLURM_CPUS_PER_TASK", None)  # megapkl's launcher would set its own thread count
    return env


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process and its descendants, all their threads
    (/proc/PID/stat; megapkl DP=2 trains in child processes)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue  # exited meanwhile
            # utime + stime, and cutime + cstime: the children it has reaped (whose own
            # entries are gone), so the sum never drops when a rank exits
            stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    if pid not in stats:
        raise OSError(f"process {pid} is gone")
    children: dict = {}
    for p, (parent, _) in stats.items():
        children.setdefault(parent, []).append(p)
    todo, ticks = [pid], 0
    while todo:
        p = todo.pop()
        ticks += stats[p][1]
        todo += children.get(p, [])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_per_update(samples: list[tuple[int, float]]) -> float | None:
    """CPU seconds per update from (rows written, CPU seconds) samples: from the first sample
    past the warm-up updates to the first one that saw the last row."""
    past = [s for s in samples if s[0] >= WARMUP]
    if not past or past[-1][0] == past[0][0]:
        return None
    last = min((s for s in past if s[0] == past[-1][0]), key=lambda s: s[1])
    return (last[1] - past[0][1]) / (last[0] - past[0][0])


def run_child(cmd: list[str], log: Path, cwd: Path, metrics: Path, threads: int = THREADS
              ) -> dict:
    """Run `cmd` (OMP and MKL set to `threads`) to its end: wall seconds, peak RSS (MiB, the
    kernel's count for it and the children it waited for) and CPU seconds per update. The CPU
    time is sampled next to the number of rows in `metrics`: under load from other processes wall
    time per update grows by however long the process waits for a core, while its CPU time
    mostly does not. The host's 1-minute load average, sampled alike, says how much other load
    there was."""
    t0, samples, loads, rows, seen = time.perf_counter(), [], [], 0, 0
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                env=child_env(threads))
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if metrics.exists():  # count the newlines written since the last look
                with metrics.open("rb") as m:
                    m.seek(seen)
                    chunk = m.read()
                seen, rows = seen + len(chunk), rows + chunk.count(b"\n")
            try:
                samples.append((rows, cpu_seconds(proc.pid)))
            except (OSError, IndexError, ValueError):
                pass  # it is exiting
            loads.append(os.getloadavg()[0])
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"peer_trl: {cmd[0]} exited {proc.returncode}; log {log}:\n{tail}")
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB
            "cpu_s_per_update": cpu_per_update(samples),
            "load_avg": statistics.mean(loads) if loads else os.getloadavg()[0]}


def run_megapkl(d: dict, seed: int, updates: int, work: Path, ranks: int = 1
                ) -> tuple[Path, dict]:
    name = "megapkl" if ranks == 1 else f"megapkl_dp{ranks}"
    run_dir = work / f"{name}_s{seed}"
    python = ROOT / ".venv" / "bin" / "python"
    cmd = [str(python if python.exists() else sys.executable), "-m", "megapkl.cli", "train",
           str(DEMO_CONFIG), *megapkl_overrides(d, seed, updates, run_dir, ranks),
           "--if-exists", "overwrite"]
    shutil.rmtree(run_dir, ignore_errors=True)  # rows of an earlier run would count as this one's
    metrics = run_dir / "metrics.jsonl"
    return metrics, run_child(cmd, work / f"{name}_s{seed}.log", work, metrics)


def run_trl(d: dict, seed: int, updates: int, work: Path, threads: int = THREADS
            ) -> tuple[Path, dict]:
    python = VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"peer_trl: {python} is missing; run `python {__file__} --install` first")
    name = "trl" if threads == THREADS else f"trl_t{threads}"
    out = work / f"{name}_s{seed}"
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", "trl", "--seed", str(seed),
           "--updates", str(updates), "--out", str(out), "--description", json.dumps(d),
           "--threads", str(threads)]
    shutil.rmtree(out, ignore_errors=True)
    metrics = out / "metrics.jsonl"
    return metrics, run_child(cmd, work / f"{name}_s{seed}.log", work, metrics, threads)


def summarize(d: dict, path: Path, process: dict, threshold: float) -> dict:
    """One run's numbers from its metrics.jsonl (megapkl's, or the TRL worker's same keys)."""
    from megapkl.analysis.compare_stats import ema, final_value, first_reaching

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/accuracy" in r]
    if not rows:
        raise SystemExit(f"peer_trl: {path}: no update rows with train/accuracy")
    times = [r["time"] for r in rows]
    per_update = [times[0]] + [b - a for a, b in zip(times, times[1:])]
    timed = per_update[WARMUP:] if len(per_update) > WARMUP else per_update
    batch = d["prompts_per_update"] * d["group_size"]
    tokens = sum(r["response_len/mean"] * batch for r in rows[len(rows) - len(timed):])
    acc = [r["train/accuracy"] for r in rows]
    reached = first_reaching(ema(acc, EMA_ALPHA), threshold)
    return {"updates": len(rows), "s_per_update": statistics.median(timed),
            "p10_s_per_update": statistics.quantiles(timed, n=10)[0] if len(timed) > 1
            else timed[0],
            "tokens_per_s": tokens / sum(timed), **process,
            "updates_to_threshold": None if reached is None else reached + 1,
            "final_accuracy": final_value(acc, FINAL_WINDOW)}


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def table(results: dict, threshold: float) -> str:
    lines = [f"| system | s / update | p10 s / update | CPU s / update | response tokens / s "
             f"| peak RSS MiB "
             f"| updates to {threshold:g} | final accuracy | process wall s | host load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        reach = ", ".join("never" if r["updates_to_threshold"] is None
                          else str(r["updates_to_threshold"]) for r in runs)
        cpu = [r["cpu_s_per_update"] for r in runs if r["cpu_s_per_update"] is not None]
        lines.append(f"| {name} | {spread([r['s_per_update'] for r in runs], '.3f')} "
                     f"| {spread([r['p10_s_per_update'] for r in runs], '.3f')} "
                     f"| {spread(cpu, '.3f') if cpu else '-'} "
                     f"| {spread([r['tokens_per_s'] for r in runs], '.0f')} "
                     f"| {spread([r['peak_rss_mib'] for r in runs], '.0f')} | {reach} "
                     f"| {spread([r['final_accuracy'] for r in runs], '.2f')} "
                     f"| {spread([r['wall_s'] for r in runs], '.0f')} "
                     f"| {spread([r['load_avg'] for r in runs], '.1f')} |")
    peers = [n for n in results if n.startswith("TRL")]
    for peer, name in [(p, n) for p in peers for n in results]:
        if name == peer or (name.startswith("TRL") and peer != "TRL"):
            continue  # megapkl against each TRL run, and TRL on one thread against its default
        pairs = list(zip(results[name], results[peer]))
        for key, what in (("s_per_update", "median seconds"), ("p10_s_per_update", "p10 seconds"),
                          ("cpu_s_per_update", "CPU seconds")):
            ratios = [m[key] / t[key] for m, t in pairs if m.get(key) and t.get(key)]
            if ratios:
                lines.append(f"\n{name} / {peer} {what} per update, paired by seed: "
                             f"{spread(ratios, '.2f')}")
    return "\n".join(lines)


def described(items: list[str]) -> dict:
    """DESCRIPTION with `--set KEY=VALUE` items applied (each value of its key's type)."""
    d = dict(DESCRIPTION)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in d:
            raise SystemExit(f"peer_trl: --set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{sorted(DESCRIPTION)}")
        d[key] = type(d[key])(value)
    return d


def bench(args) -> None:
    d = described(args.set or [])
    work = Path(args.out or tempfile.mkdtemp(prefix="megapkl_peer_trl_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    runners = dict(zip(SYSTEMS, (run_megapkl, run_trl, lambda *a: run_megapkl(*a, ranks=2),
                                 lambda *a: run_trl(*a, threads=1))))
    systems = [s for s in SYSTEMS if s in args.systems]
    results: dict = {name: [] for name in systems}
    for i, seed in enumerate(range(args.seed_base, args.seed_base + args.seeds)):
        order = systems if i % 2 == 0 else systems[::-1]  # alternate who goes first
        for name in order:
            path, process = runners[name](d, seed, args.updates, work)
            results[name].append({"seed": seed, **summarize(d, path, process, args.threshold)})
            print(f"[peer_trl] {name} seed {seed}: {json.dumps(results[name][-1])}", flush=True)
    (work / "results.json").write_text(json.dumps({"description": d, "updates": args.updates,
                                                   "threshold": args.threshold,
                                                   "results": results}, indent=1))
    print(f"\n{args.seeds} seed(s) x {args.updates} updates per system, {THREADS} threads per "
          "process (megapkl: its config's parallel.cpu_threads, 1 in the demo; megapkl DP=2: two "
          "processes of one thread; TRL 1 thread: one); "
          f"per-update time leaves out the first {WARMUP} updates; runs and logs in {work}\n")
    print(table(results, args.threshold))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", action="store_true", help="create the side environment and exit")
    ap.add_argument("--seeds", type=int, default=2, help="runs per system (default 2)")
    ap.add_argument("--seed-base", type=int, default=0)
    ap.add_argument("--updates", type=int, default=300, help="optimizer updates per run")
    ap.add_argument("--threshold", type=float, default=0.9,
                    help="accuracy for updates-to-threshold (default 0.9)")
    ap.add_argument("--out", default=None, help="directory for the runs (default: a new temp dir)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="change a DESCRIPTION "
                    "entry for both systems (repeatable), e.g. micro_batch_size=128")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated, of {', '.join(SYSTEMS)} (default all)")
    ap.add_argument("--worker", choices=("trl",), help=argparse.SUPPRESS)
    ap.add_argument("--description", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=THREADS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.install:
        return install()
    if args.worker:
        d = DESCRIPTION if args.description is None else json.loads(args.description)
        return trl_worker(d, args.seed, args.updates, Path(args.out), args.threads)
    if args.seeds < 1 or args.updates <= WARMUP:
        raise SystemExit(f"peer_trl: need --seeds >= 1 and --updates > {WARMUP}")
    args.systems = [s.strip() for s in args.systems.split(",")]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        raise SystemExit(f"peer_trl: --systems {','.join(args.systems)!r}: each one of {SYSTEMS}")
    bench(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
