"""`megapkl plan CONFIG [--profile P]`: will the run fit its GPUs, and how long is an update?

Per-GPU memory of the most loaded rank (pipeline stage 0 holds the embedding and, under 1F1B, PP
micro-batches of activations; the last stage holds the output layer):

- parameters in the model dtype (bf16: 2 bytes; fp32: 4), this rank's TP/PP/EP shard;
- gradients in fp32 (megatron's main-grad buffer): 4 bytes per local parameter;
- fp32 main parameters and Adam's two moments (12 bytes per parameter; the main copy only when the
  model is bf16), sharded by the distributed optimizer over the data x context ranks (experts over
  the expert-data-parallel ranks);
- activations of one micro-batch, Korthikanti et al. (2022) for TP + SP transformers with
  flash attention (no s^2 scores kept): per layer 34 s b h / t bytes without recompute or with
  selective recompute, 2 s b h / t (the layer input) with full recompute; s = sequence / CP;
  times the layers of a stage and the PP micro-batches in flight on stage 0;
- the log-prob path: the vocab-parallel logits of a micro-batch in fp32 plus their gradient
  (8 bytes per element) and the bf16 logits (2), s b V / t elements;
- an SGLang server reserves `mem_fraction_static` of the GPU memory *free when it starts* for its
  weights and KV cache, not of the whole GPU: SGLang measures the free memory before it loads
  the model (`pre_model_load_memory`) and sizes the KV cache so that (1 - mem_fraction_static)
  of it stays free (`kv_cache_configurator.py`, `_profile_available_bytes`). A colocated server
  megapkl launches starts beside the built trainer (parameters, gradients and the optimizer's
  main copy resident; Adam's moments come at the first step, so they are not counted as held
  then: the larger estimate of the server's share), each process with its own CUDA context
  (CONTEXT_GIB); a dedicated server starts on a GPU of its own. While generating, the trainer's
  parameters, gradients and optimizer state stay resident (activations are free), so that phase
  is checked too. Servers megapkl launches colocated hand their memory back while the trainer
  trains (SGLang's memory saver, `releases_memory`); colocated servers it only connects to
  (`rollout.sglang.urls`, started before the trainer) keep it, and count while training too.

The SGLang fleet (`check_fleet`): each data-parallel replica's `num_engines` servers of `tp` GPUs
must fit the GPUs placement.py gives them in the job (colocated: spread over the nodes the replica
trains on unless `every_node` is false); the error names the keys. Its line says how many training
GPUs generate and, when some do not, why.

FLOPs per update: 6 N T for the policy forward + backward plus 2 N T for each extra forward (the
proximal reference and the initial model when their log-probs are recomputed), plus causal
attention 6 L s h_attn per token (forward + backward), T = responses per update x (max prompt +
max response) tokens, an upper bound. Step time = FLOPs / (GPUs x peak x MFU).

Time per update (`update_times`): generation = decoded tokens of a batch (prompts x responses x
the response length: max_response_len unless given, an upper bound) over the servers' GPUs at the
profile's decode throughput, spread over the batch's updates; training = the step time. The
synchronous update is their sum. The asynchronous one (rollout.async_batches, allowed only with the
servers on GPUs of their own) comes from `overlapped_update_s`, which plays the schedule's
versions through an engine lane and a trainer lane. Weight sync, rewards and refill rounds are
left out.

The search agent's retriever, when the run serves its own (env.search.index): its index's host
memory, where it runs (the profile's `retriever:` step, else beside rank 0) and, on a step with
GPUs, a flat index's float16 shard added to those GPUs' load (`launch.retriever.size_retriever`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from megapkl.config.layout import Layout
from megapkl.launch.runconfig import prepare_run
from megapkl.launch.shape import settle_shape
from megapkl.models.sizes import (layer_params, padded_vocab, served_weight_bytes,  # noqa: F401
                                  stage_params, total_params)

GIB = 1024 ** 3
DEFAULT_MFU = 0.35
# A CUDA process's own context (the driver's and NCCL's buffers), outside every allocator pool: an
# estimate, in GiB, of what a process holds on a GPU before its first tensor.
CONTEXT_GIB = 0.5
# SGLang decode tokens/s of one GPU over all its requests, when a GPU profile sets no
# gpu_decode_tokens_per_s: Qwen3 1.7B-8B with FP8 weights and BF16 KV at 16K-token responses on
# an H100 (KV-cache reads bound decoding at long context). An assumption: measure your own.
DEFAULT_DECODE_TOKENS_PER_S = 1500.0


# ------------------------------------------------------------------ memory


@dataclasses.dataclass
class Plan:
    rows: list[tuple[str, float]]  # (what, GiB) of the most loaded rank while training
    train_gib: float
    rollout_gib: float  # resident trainer state + colocated engines while generating
    gpu_gib: Optional[float]
    flops: float
    step_s: Optional[float]
    mfu: float
    layout: Layout
    gpus: int
    servers: str = ""  # the SGLang fleet, one line (empty without launched SGLang servers)
    engine_gib: float = 0.0  # one SGLang server's weights + KV cache per GPU (engine_reservation)
    engine_free_gib: float = 0.0  # the GPU memory free at that server's start
    engine_weights_gib: float = 0.0  # the served weights per GPU of a server
    times: Optional["UpdateTimes"] = None  # per-update time (None: no GPU profile or fleet)
    retriever: Any = None  # launch.retriever.RetrieverSizing of env.search.index, or None

    @property
    def fits(self) -> bool:
        if self.retriever is not None and not self.retriever.fits:
            return False
        if self.gpu_gib is None:
            return True
        return (max(self.train_gib, self.rollout_gib) <= self.gpu_gib
                and self.engine_weights_gib <= self.engine_gib)

    def table(self) -> str:
        lay = self.layout
        head = (f"layout TP={lay.tp} PP={lay.pp} CP={lay.cp} EP={lay.ep} DP={lay.dp} "
                f"SP={'on' if lay.sp else 'off'} on {self.gpus} GPUs")
        w = 56
        lines = [head, f"{'per-GPU memory (most loaded rank)':<{w + 2}}{'GiB':>8}"]
        lines += [f"  {name:<{w}}{gib:>8.2f}" for name, gib in self.rows]
        lines.append(f"  {'= training peak':<{w}}{self.train_gib:>8.2f}")
        lines.append(f"  {'= while generating (resident state + colocated engines)':<{w}}"
                     f"{self.rollout_gib:>8.2f}")
        if self.gpu_gib is None:
            lines.append(f"  {'GPU memory':<{w}}{'?':>8}  (the profile sets no gpu_mem_gib)")
        else:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"  {'GPU memory':<{w}}{self.gpu_gib:>8.1f}  -> {verdict}")
        if self.servers:
            lines.append(self.servers)
        if self.engine_gib and self.engine_weights_gib:
            ok = "fits" if self.engine_weights_gib <= self.engine_gib else "DOES NOT FIT"
            lines.append(f"SGLang weights per GPU {self.engine_weights_gib:.2f} GiB of the "
                         f"server's {self.engine_gib:.2f} (mem_fraction_static of the "
                         f"{self.engine_free_gib:.1f} GiB free at its start) -> {ok}")
        lines.append(f"model FLOPs per update: {self.flops:.3e}")
        if self.step_s is not None:
            lines.append(f"step time at MFU {self.mfu:.2f}: {self.step_s:.1f} s")
        if self.times is not None:
            lines += self.times.lines()
        if self.retriever is not None:
            lines += self.retriever.lines()
        return "\n".join(lines)


def _layout(cfg) -> Layout:
    return Layout.of(cfg.parallel)  # an "auto" DP counts as 1 here


def layer_activation_bytes(s: float, b: int, h: int, heads: int, t: int, recompute: str,
                           bytes_per: int = 2, flash: bool = True) -> float:
    """Activations one transformer layer keeps for backward (Korthikanti et al. 2022, eq. 2 with
    SP): 34 s b h / t in 16-bit, plus 5 a s^2 b / t when attention scores are materialized (no
    flash attention); full recompute keeps only the layer input, 2 s b h / t."""
    scale = bytes_per / 2
    if recompute == "full":
        return 2 * s * b * h / t * scale
    scores = 0.0 if flash or recompute == "selective" else 5 * heads * s * s * b / t
    return (34 * s * b * h / t + scores) * scale


def memory_rows(cfg, spec, lay: Layout) -> tuple[list[tuple[str, float]], float, float]:
    """(rows, resident GiB, of which Adam's moments) of pipeline stage 0 and the last stage,
    whichever is larger."""
    ro = cfg.rollout
    bf16 = cfg.model.dtype == "bf16"
    best: Optional[tuple[float, list, float]] = None
    for stage in sorted({0, lay.pp - 1}):
        dense, expert = stage_params(spec, lay, stage)
        n = dense + expert
        dp_cp = lay.dp * lay.cp
        edp = max(1, dp_cp // lay.ep)
        opt_bytes = 12 if bf16 else 8  # fp32 main copy + Adam m, v (fp32 model: no main copy)
        rows = [("parameters (" + ("bf16" if bf16 else "fp32") + ")", n * (2 if bf16 else 4)),
                ("gradients (fp32 main grads)", n * 4),
                (f"optimizer: main params + Adam moments / DP ({dp_cp})",
                 dense * opt_bytes / dp_cp + expert * opt_bytes / edp)]
        s = (ro.max_prompt_len + ro.max_response_len) / lay.cp
        b, h = cfg.parallel.micro_batch_size, spec.hidden_size
        t = lay.tp if lay.sp else 1
        per_layer = layer_activation_bytes(s, b, h, spec.num_attention_heads, t,
                                           cfg.model.recompute)
        in_flight = lay.pp - stage  # 1F1B: stage k keeps pp - k micro-batches
        rows.append((f"activations ({cfg.model.recompute} recompute, {in_flight} micro-batch)",
                     per_layer * spec.num_layers / lay.pp * in_flight))
        if stage == lay.pp - 1:
            rows.append(("log-prob path (logits fp32 + grad + bf16)",
                         s * b * padded_vocab(spec, lay.tp) / lay.tp * 10))
        resident = sum(v for _, v in rows[:3])
        moments = (dense / dp_cp + expert / edp) * 8  # Adam's m and v, fp32
        total = sum(v for _, v in rows)
        if best is None or total > best[0]:
            best = (total, rows, resident, moments)
    _, rows, resident, moments = best
    return [(name, v / GIB) for name, v in rows], resident / GIB, moments / GIB


def engine_reservation(sg, gpu_gib: float, held_gib: float) -> tuple[float, float]:
    """(what one SGLang server reserves per GPU for its weights and KV cache, the GPU memory free
    at its start): `mem_fraction_static` of what is free when it starts on a GPU where
    `held_gib` is already taken, after its own CUDA context."""
    free = max(0.0, gpu_gib - held_gib - CONTEXT_GIB)
    return sg.mem_fraction_static * free, free


def update_flops(cfg, spec) -> float:
    ro = cfg.rollout
    seq = ro.max_prompt_len + ro.max_response_len
    tokens = ro.responses_per_minibatch * seq
    n = total_params(spec, active=True)
    attn = 6 * spec.num_layers * seq / 2 * spec.num_attention_heads * spec.head_dim * 2
    passes = 6 + 2 * (cfg.reference.mode != "behavior") + 2 * bool(cfg.objective.kl_init_coef > 0)
    return tokens * (passes * n + attn)


def plan(cfg, profile: Any = None, mfu: float = DEFAULT_MFU,
         response_len: Optional[int] = None) -> Plan:
    """The plan of a resolved run config on a cluster profile (None: no capacity to check)."""
    from megapkl.models.spec import spec_from_model_config

    spec = spec_from_model_config(cfg.model)
    lay = _layout(cfg)
    rows, resident, moments = memory_rows(cfg, spec, lay)
    gpu = getattr(profile, "gpu_mem_gib", None) if profile is not None else None
    train = sum(v for _, v in rows)
    sg = cfg.rollout.sglang
    engines, memory = 0.0, _engine_memory(cfg, spec, gpu, resident - moments)
    from megapkl.rollout.sglang.launch import releases_memory

    if cfg.rollout.engine == "sglang" and sg.colocate and gpu is not None:
        engines = memory.get("engine_gib", 0.0) or engine_reservation(sg, gpu, 0.0)[0]
    if engines and not releases_memory(sg):  # never handed back: there while training too
        rows.append(("colocated SGLang servers (memory not released)", engines))
        train += engines
    gpus = lay.tp * lay.pp * lay.cp * lay.dp
    flops = update_flops(cfg, spec)
    peak = getattr(profile, "gpu_tflops", None) if profile is not None else None
    step = flops / (gpus * peak * 1e12 * mfu) if peak else None
    servers = fleet_line(cfg)
    fleet = servers.startswith("SGLang: ") and "DOES NOT FIT" not in servers  # launched, fits
    times = update_times(cfg, profile, step, response_len) if fleet and step is not None else None
    from pathlib import Path

    from megapkl.launch.retriever import size_retriever

    retriever = size_retriever(cfg.env, getattr(profile, "retriever", None), cwd=Path.cwd(),
                               nodes=cfg.slurm.nodes, train_gib=max(train, resident + engines),
                               gpu_mem_gib=gpu)
    return Plan(rows=rows, train_gib=train, rollout_gib=resident + engines, gpu_gib=gpu,
                flops=flops, step_s=step, mfu=mfu, layout=lay, gpus=gpus,
                servers=servers, times=times, retriever=retriever, **memory)


# ------------------------------------------------------------------ time per update


@dataclasses.dataclass
class UpdateTimes:
    """Seconds per optimizer update (a batch's generation spread over its updates)."""
    generate_s: float
    train_s: float
    sync_s: float  # generation + training
    async_s: float  # with generation ahead where placement and protocol allow; else sync_s
    tokens: int  # decoded tokens of one batch
    batch: str  # 'prompts x responses per prompt'
    minibatches: int  # updates per batch
    response_len: int
    response_len_is_max: bool  # max_response_len: an upper bound
    gen_gpus: int
    decode_tokens_per_s: float  # per GPU
    decode_from_profile: bool
    async_batches: int  # rollout.async_batches (0: the asynchronous time is what it would give)
    ahead: tuple[int, int] = (0, 0)  # batches generated ahead, of a steady-state window
    why_not: str = ""  # why nothing overlaps (placement)

    def lines(self) -> list[str]:
        length = (f"{self.response_len} tokens (max_response_len, an upper bound)"
                  if self.response_len_is_max else f"{self.response_len} tokens (mean, given)")
        source = ("profile gpu_decode_tokens_per_s" if self.decode_from_profile
                  else "default; set the profile's gpu_decode_tokens_per_s")
        per = f" / {self.minibatches} updates" if self.minibatches > 1 else ""
        out = ["time per update (estimate; weight sync, rewards and refill rounds left out):",
               f"  generation   {self.generate_s:8.1f} s  {self.batch} responses x {length}{per}",
               f"  {'':<23}= {self.tokens:.3e} tokens on {self.gen_gpus} server GPUs at "
               f"{self.decode_tokens_per_s:.0f} tokens/s each ({source})",
               f"  training     {self.train_s:8.1f} s  (the step time above)",
               f"  synchronous  {self.sync_s:8.1f} s  (generation + training)"]
        if self.why_not:
            out.append(f"  asynchronous {self.async_s:8.1f} s  = synchronous: {self.why_not}")
            return out
        when = (f"rollout.async_batches: {self.async_batches}" if self.async_batches
                else "if rollout.async_batches were > 0")
        out.append(f"  asynchronous {self.async_s:8.1f} s  ({when}; {self.ahead[0]} of "
                   f"{self.ahead[1]} batches generated ahead; {self.sync_s / self.async_s:.2f}x)")
        return out


def overlapped_update_s(sched, gen_s: float, train_s: float) -> tuple[float, int, int]:
    """(mean seconds per update, batches generated ahead, window) of the steady state when the
    engine generates ahead: batch b starts once the engine is free and every version its groups
    name is published (version v: when update v - 1 ends); its updates start once it is generated
    and the previous update ended. `gen_s` is one batch's generation. The window is one refresh
    period (16 batches otherwise), after a warm-up. With constant times one batch ahead already
    reaches this mean, so the queue depth (rollout.async_batches) does not enter."""
    import math

    m = sched.minibatches
    n = sched.refresh_every
    window = n // math.gcd(n, m) if sched.protocol == "periodic_refresh" else 16
    warm = window + sched.max_staleness // m + 1
    update_end: dict[int, float] = {}
    engine_free = trainer_free = 0.0
    ahead = 0
    for b in range(warm + window):
        published = update_end.get(max(sched.group_versions(b)) - 1, 0.0)
        start = max(engine_free, published)
        ahead += b >= warm and start < trainer_free
        engine_free = start + gen_s
        t = max(engine_free, trainer_free)
        for i in range(m):
            t += train_s
            update_end[b * m + i] = t
        trainer_free = t
    span = update_end[(warm + window) * m - 1] - update_end[warm * m - 1]
    return span / (window * m), ahead, window


def update_times(cfg, profile: Any, train_s: float,
                 response_len: Optional[int] = None) -> UpdateTimes:
    """Generation, training, synchronous and asynchronous seconds per update of `cfg` (a launched
    SGLang fleet) on a GPU profile."""
    from megapkl.train.schedule import Schedule

    ro, sg = cfg.rollout, cfg.rollout.sglang
    length = response_len or ro.max_response_len
    tokens = ro.prompts_per_batch * ro.responses_per_prompt * length
    _, fleets = placed_fleets(cfg)
    gen_gpus = sum(len(f) for f in fleets) * sg.tp  # the GPUs placement.py gives the servers
    given = getattr(profile, "gpu_decode_tokens_per_s", None)
    tps = given or DEFAULT_DECODE_TOKENS_PER_S
    gen_batch = tokens / (gen_gpus * tps)
    m = ro.minibatches_per_batch
    sync = (gen_batch + m * train_s) / m
    times = UpdateTimes(
        generate_s=gen_batch / m, train_s=train_s, sync_s=sync, async_s=sync, tokens=tokens,
        batch=f"{ro.prompts_per_batch} x {ro.responses_per_prompt}", minibatches=m,
        response_len=length, response_len_is_max=not response_len, gen_gpus=gen_gpus,
        decode_tokens_per_s=tps, decode_from_profile=bool(given), async_batches=ro.async_batches)
    if sg.colocate:  # rollout.async_batches is refused there
        times.why_not = ("the servers share the trainer's GPUs (rollout.sglang.colocate: "
                         "true; false gives them GPUs of their own)")
        return times
    schedule = Schedule.of(cfg.rollout, cfg.reference, cfg.seed)
    times.async_s, ahead, window = overlapped_update_s(schedule, gen_batch, train_s)
    times.ahead = (ahead, window)
    if not ahead:
        times.why_not = f"{ro.protocol} waits for each batch's version"
    return times


def _engine_memory(cfg, spec, gpu: Optional[float], trainer_at_start: float
                   ) -> dict[str, float]:
    """A launched server's reservation and served weights per GPU: colocated, it starts beside
    the built trainer (`trainer_at_start` GiB and the trainer's CUDA context held); dedicated,
    on a GPU of its own."""
    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or sg.urls or gpu is None:
        return {}
    held = trainer_at_start + CONTEXT_GIB if sg.colocate else 0.0
    reserved, free = engine_reservation(sg, gpu, held)
    return {"engine_gib": reserved, "engine_free_gib": free,
            "engine_weights_gib": served_weight_bytes(spec, cfg.rollout.fp8) / sg.tp / GIB}


def fleet_line(cfg) -> str:
    from megapkl.config.typed import ConfigError

    try:
        return check_fleet(cfg)
    except ConfigError as exc:
        return f"SGLang: DOES NOT FIT: {exc}"


def check_fleet(cfg, source: str = "") -> str:
    """One line on the SGLang servers megapkl will launch for `cfg` (empty when it launches none
    or the job shape is unknown); ConfigError naming the keys when they do not fit the job."""
    placed = placed_fleets(cfg, source)
    if placed is None:
        return ""
    lay, fleets = placed
    sg, world = cfg.rollout.sglang, cfg.world_size
    servers = sum(len(f) for f in fleets)
    used = servers * sg.tp
    head = (f"SGLang: {lay.dp} replicas x {sg.num_engines} servers (rollout.sglang.num_engines) "
            f"of {sg.tp} GPU(s) = {servers} servers on {used} GPUs")
    if not sg.colocate:
        return head + ", on GPUs of their own"
    return (f"{head}, colocated on the replicas' GPUs, {_node_note(lay, fleets[0])}; {used} of "
            f"the {world} training GPUs generate" + _idle_note(cfg, lay, world, used))


def placed_fleets(cfg, source: str = ""):
    """(trainer layout, every replica's server slots) of the servers megapkl launches for `cfg`,
    as placement.py places them; None when it launches none or the job shape is unknown."""
    from megapkl.config.typed import ConfigError
    from megapkl.rollout.sglang.placement import PlacementError, check_fleets

    sg, par, slurm = cfg.rollout.sglang, cfg.parallel, cfg.slurm
    world = cfg.world_size
    if cfg.rollout.engine != "sglang" or sg.urls or sg.server_command or world is None:
        return None
    if sg.colocate and sg.weight_sync == "distributed":
        raise ConfigError("distributed with colocate true: the trainer's NCCL rank and a "
                          "server's would share a GPU, which NCCL refuses; use tensor or disk, "
                          "or rollout.sglang.colocate false", key="rollout.sglang.weight_sync",
                          source=source)
    if world % slurm.nodes:
        raise ConfigError(f"{world} trainer ranks do not split evenly over {slurm.nodes} nodes "
                          "(rollout.sglang.num_engines, rollout.sglang.tp)", key="slurm.nodes",
                          source=source)
    lay = Layout.of(par, world, per_node=world // slurm.nodes)
    try:
        return lay, check_fleets(num_engines=sg.num_engines, tp=sg.tp, colocate=sg.colocate,
                                 lay=lay, nodes=slurm.nodes, gpus_per_node=slurm.gpus_per_node,
                                 every_node=sg.every_node)
    except PlacementError as exc:  # the message names the keys
        raise ConfigError(str(exc), source=source) from None


def _node_note(lay, slots) -> str:
    """Over how many of its nodes replica 0's colocated servers run (every replica alike)."""
    counts = [sum(s.node == n for s in slots) for n in lay.replica_nodes(0)]
    held = [c for c in counts if c]
    of = f" of each replica's {len(counts)}" if len(held) < len(counts) else " per replica"
    each = (f"{held[0]} server(s) on each" if len(set(held)) == 1
            else "+".join(map(str, held)) + " servers")
    return f"fleets on {len(held)} node(s){of}, {each}"


def _idle_note(cfg, lay, world: int, used: int) -> str:
    """Why training GPUs generate nothing: fewer colocated servers than a replica's GPUs hold
    (rollout.sglang.num_engines), or all of them on its leader's node (every_node false)."""
    from megapkl.rollout.sglang.placement import (PlacementError, colocated_fleets,
                                                  colocated_gpus)

    if used >= world:
        return ""
    sg = cfg.rollout.sglang
    per_replica = len(lay.replica_ranks(0))
    fit = sg.num_engines
    while fit * sg.tp < per_replica:  # the most servers a replica's GPUs take as placed
        try:
            colocated_fleets(num_engines=fit + 1, tp=sg.tp, lay=lay, replica=0,
                             every_node=sg.every_node)
        except PlacementError:
            break
        fit += 1
    why = []
    if fit > sg.num_engines:
        why.append(f"rollout.sglang.num_engines {sg.num_engines}, where a replica's GPUs take "
                   f"up to {fit} servers of {sg.tp} GPU(s)")
    if not sg.every_node and len(lay.replica_nodes(0)) > 1:
        why.append("rollout.sglang.every_node false: a replica's servers only on its leader's "
                   f"node, {len(colocated_gpus(lay, 0))} of its {per_replica} GPUs")
    if not why:  # tp-wide runs of a node's replica GPUs leave some over
        why.append(f"rollout.sglang.tp {sg.tp} does not divide a replica's GPUs on a node")
    return f" ({world - used} idle: {'; '.join(why)})"


def plan_config(config: str, profile: Optional[str] = None, overrides: Any = (),
                mfu: float = DEFAULT_MFU, response_len: Optional[int] = None) -> Plan:
    """Plan a run config file with a profile (default: its slurm.profile), the job shape filled in
    as `megapkl submit` does; without any profile, the layout alone (no fit verdict)."""
    overrides = list(overrides)
    # sized from the model preset's shape: no tokenizer needed (model.hf_checkpoint may be null)
    prep = prepare_run(config, overrides, cwd=Path.cwd(), tokenizes=False)
    if not (profile or prep.cfg.slurm.profile):
        check_fleet(prep.cfg, prep.config_path)
        return plan(prep.cfg, None, mfu, response_len)
    prep, prof = settle_shape(config, overrides, profile, cwd=Path.cwd(), tokenizes=False)
    check_fleet(prep.cfg, prep.config_path)
    return plan(prep.cfg, prof, mfu, response_len)
