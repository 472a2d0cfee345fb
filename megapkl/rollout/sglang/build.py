"""An `SGLangEngine` from a run config: connect to `rollout.sglang.urls`, or launch the servers
(and sglang-router) with the flags of `rollout.sglang` and wait until they are healthy."""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megapkl.config.local_files import TOKENIZER_FILES
from megapkl.parallel.threads import rank_executor
from megapkl.rollout.sglang.answers import AnswerStore
from megapkl.rollout.sglang.client import SGLangEngine
from megapkl.rollout.sglang.fleet import Fleet, HealthSettings, Worker
from megapkl.rollout.sglang.kernels import mark_warm, startup_deadline
from megapkl.rollout.sglang.launch import (ServerLaunchError, ServerProcess, ServerSpec,
                                           local_address, plan_servers,
                                           port_lost, refuse_remote_tensor_sync,
                                           releases_memory, router_command,
                                           router_ports, server_command, slurm_nodes, this_node,
                                           wait_healthy)
from megapkl.rollout.sglang.placement import PlacementError, Slot, engine_owners, fleet_slots
from megapkl.rollout.sglang.served import (DETERMINISTIC, Expected, check_served, draws_from_seed,
                                           expected)
from megapkl.rollout.sglang.weights import (MiB, SyncSettings, Transform, WeightSync, group_backend,
                                            identity)

log = logging.getLogger(__name__)


def health_settings(sg: Any) -> HealthSettings:
    return HealthSettings(first_wait_s=sg.health_first_wait_s, interval_s=sg.health_interval_s,
                          timeout_s=sg.health_timeout_s, max_failures=sg.health_max_failures,
                          deadline_s=sg.startup_timeout_s,
                          no_engine_timeout_s=sg.no_engine_timeout_s, max_restarts=sg.max_restarts)


def sync_settings(sg: Any, urls: Sequence[str] = ()) -> SyncSettings:
    """The servers join the distributed-sync group at this process's address: loopback when they
    all answer on loopback, this node's name when some run elsewhere."""
    from urllib.parse import urlsplit

    from megapkl.rollout.sglang.http import is_loopback

    remote = any(not is_loopback(urlsplit(u).hostname or "") for u in urls)
    return SyncSettings(mode=sg.weight_sync, bucket_bytes=int(sg.bucket_mb * MiB),
                        pause_mode=sg.pause_mode, colocate=releases_memory(sg),
                        timeout_s=sg.sync_timeout_s,
                        group_address=this_node() if remote else local_address(sg.host))


def _eos_token_id(sg: Any, base: dict, tokenizer: Any) -> Any:
    """The EOS id(s) the served config.json declares: the checkpoint's own, else the tokenizer's.
    SGLang started with --skip-tokenizer-init takes EOS from config.json (and
    generation_config.json) only: without it no response ever stops at EOS."""
    for eos in (base.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)):
        if eos is not None:
            return eos
    if sg.server_command:
        return None  # a stand-in server (megapkl serve) knows its own EOS
    raise ServerLaunchError("rollout.sglang: the served model has no eos_token_id (no "
                      "model.hf_checkpoint config.json declares one, and no tokenizer is given: "
                      "set model.tokenizer); SGLang would never stop a response at EOS")


def served_model_dir(rollout: Any, ctx: Any, hf_config: dict, work: Path, tokenizer: Any = None
                     ) -> tuple[str, bool]:
    """(model path for the servers, whether they start from dummy weights).

    The HF checkpoint itself when there is one and rollout.fp8 is off. Otherwise a config-only
    directory `<work>/model` (the trainer pushes every weight before any generation): the
    checkpoint's config.json (or the model's), with its EOS id and, under rollout.fp8, the
    block-FP8 `quantization_config`. SGLang resolves its quantization from that config
    (`ModelConfig._verify_quantization`), builds the block-FP8 linear method (e4m3 weights with
    `weight_scale_inv`, 128 x 128) and fills dummy FP8 weights; the pushed e4m3 weights and scales
    then load into those parameters. `--quantization fp8` alone would give online per-tensor FP8,
    which has no `weight_scale_inv` to load."""
    from megapkl.rollout.fp8 import QUANTIZATION_CONFIG

    ckpt = Path(ctx.hf_checkpoint) if ctx.hf_checkpoint else None
    if ckpt is not None and not rollout.fp8:
        return str(ckpt), False
    base = dict(hf_config)
    if ckpt is not None and (ckpt / "config.json").is_file():
        base = {**json.loads((ckpt / "config.json").read_text()),
                "torch_dtype": hf_config.get("torch_dtype", "bfloat16")}
    eos = _eos_token_id(rollout.sglang, base, tokenizer)
    if eos is not None:
        base["eos_token_id"] = eos
    if rollout.fp8:
        base["quantization_config"] = dict(QUANTIZATION_CONFIG)
    path = work / "model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(base, indent=1))
    if ckpt is not None and (ckpt / "generation_config.json").is_file():  # its EOS ids too
        shutil.copyfile(ckpt / "generation_config.json", path / "generation_config.json")
    return str(path), True


def served_tokenizer(ctx: Any, tokenizer: Any = None) -> Optional[str]:
    """The tokenizer directory the servers load: None (they run --skip-tokenizer-init, ids in
    and out) unless the environment has stop strings (`ctx.stop`), which SGLang matches in
    decoded text and refuses without its tokenizer (sampling_params.raise_if_tokenizer_required);
    then model.tokenizer, else model.hf_checkpoint (`ctx.tokenizer_path`), which must hold the
    tokenizer's files. A server holding a tokenizer also ends a response at the tokenizer's EOS
    (schedule_batch.Req._check_token_based_finish), so that id must be one the run stops at
    anyway (the model config's eos_token_id), or the two engines would end turns differently."""
    if not ctx.stop:
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    model_eos = (ctx.hf_config or {}).get("eos_token_id")
    model_eos = {model_eos} if isinstance(model_eos, int) else set(model_eos or ())
    if eos is not None and model_eos and eos not in model_eos:
        raise ServerLaunchError(
            f"model.tokenizer: its EOS id {eos} is not among the model config's eos_token_id "
            f"{sorted(model_eos)}; SGLang servers holding the tokenizer (env.stop needs it) would "
            "end responses at it where the run does not: use the model's own tokenizer")
    path = ctx.tokenizer_path
    if not path or not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        where = f"{path} has no {' or '.join(TOKENIZER_FILES)}" if path else \
            "neither model.tokenizer nor model.hf_checkpoint is set"
        raise ServerLaunchError(
            f"env.stop: the environment's stop strings {list(ctx.stop)} are matched by the SGLang "
            f"servers in decoded text, which needs the model's tokenizer there ({where}): set "
            "model.tokenizer to the tokenizer's directory")
    return str(path)


def node_gpus() -> Optional[int]:
    """GPUs on this node: Slurm's count for the job, else CUDA's (None: none seen)."""
    import torch

    return int(os.environ.get("SLURM_GPUS_ON_NODE") or 0) or torch.cuda.device_count() or None


def engine_slots(rollout: Any, ctx: Any) -> list[Slot]:
    """Where the SGLang servers of this engine go on the GPUs (placement.py): replica
    `ctx.replica`'s fleet on the node of `ctx.rank` when colocated (default: its leader's), from
    the trainer's layout (`ctx.layout`, its ranks per node included)."""
    sg, replica = rollout.sglang, ctx.replica
    try:
        return fleet_slots(num_engines=sg.num_engines, tp=sg.tp, colocate=sg.colocate,
                           lay=ctx.layout, replica=replica, nodes=max(1, len(slurm_nodes())),
                           gpus_per_node=node_gpus(), every_node=sg.every_node, owner=ctx.rank)
    except PlacementError as exc:
        raise ServerLaunchError(str(exc)) from None


@dataclass(frozen=True)
class Lane:
    """This engine's fleet among the run's: `index` of the `count` fleets of its replica (node
    order), `servers` in it, and its `lane` of `lanes` over the whole run, which keeps the ports of
    fleets sharing a host apart."""
    index: int = 0
    count: int = 1
    servers: int = 1
    lane: int = 0
    lanes: int = 1


def fleet_lane(rollout: Any, ctx: Any) -> Lane:
    sg = rollout.sglang
    if not sg.colocate:
        return Lane(servers=sg.num_engines, lane=ctx.replica, lanes=ctx.layout.dp)
    lay = ctx.layout
    owners = engine_owners(rollout, lay)
    me = lay.leader(ctx.replica) if ctx.rank is None else ctx.rank
    flat = [(d, rank, n) for d, fleets in enumerate(owners) for rank, n in fleets]
    for lane, (d, rank, n) in enumerate(flat):
        if d == ctx.replica and rank == me:
            index = [r for r, _ in owners[d]].index(rank)
            return Lane(index, len(owners[d]), n, lane, len(flat))
    raise ServerLaunchError(f"rollout.sglang: trainer rank {me} runs no colocated fleet of "
                            f"replica {ctx.replica} (placement: {owners[ctx.replica]})")


def _wait_all(procs: list[ServerProcess], health: HealthSettings, what: str,
              deadline_s: Optional[float] = None,
              lost: Callable[[ServerProcess, bool], Optional[str]] = lambda p, failed: None,
              ) -> dict[int, str]:
    """Wait until every process is healthy; the first failure raises and ends the other waits.
    `lost(process, failed)` names a server that lost its port to another process (failed or
    not): such a one is no failure, and {index in procs: why} comes back."""
    stop, moved = threading.Event(), {}

    def one(i: int, p: ServerProcess) -> None:
        try:
            wait_healthy(p, p.url, first_wait_s=health.first_wait_s,
                         interval_s=min(health.interval_s, 1.0), timeout_s=health.timeout_s,
                         deadline_s=health.deadline_s if deadline_s is None else deadline_s,
                         what=f"{what} {p.name}", stop=stop.is_set)
        except ServerLaunchError:
            if stop.is_set():
                return  # its wait ended by another's failure, which is raised
            if (why := lost(p, True)) is None:
                stop.set()
                raise
            moved[i] = why
            return
        if (why := lost(p, False)) is not None:
            moved[i] = why
    with rank_executor(max(1, len(procs)), "sglang-wait") as pool:
        futures = [pool.submit(one, i, p) for i, p in enumerate(procs)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return moved


PORT_LAUNCHES = 3  # launches of a server whose port other processes keep taking before its bind


def start_servers(specs: list[ServerSpec], health: HealthSettings, deadline: float,
                   started: list[ServerProcess]) -> list[tuple[ServerSpec, ServerProcess]]:
    """Start the servers and wait until all are healthy. A server of this host binds its port
    after loading the model, seconds after the free-port check: one whose port another process
    took meanwhile starts again on the next free port of its lane (up to PORT_LAUNCHES launches,
    a warning each time). `started` collects every process started, for the caller to stop."""
    specs, procs, todo = list(specs), [None] * len(specs), list(range(len(specs)))

    def lost(p: ServerProcess, failed: bool) -> Optional[str]:
        spec = specs[procs.index(p)]
        return None if spec.moved is None else port_lost(p, spec.port, failed)
    for launch in range(1, PORT_LAUNCHES + 1):
        for i in todo:
            procs[i] = specs[i].process().start()
            started.append(procs[i])
        moved = _wait_all([procs[i] for i in todo], health, "rollout.sglang: engine", deadline,
                          lost)
        again = {todo[k]: why for k, why in moved.items()}
        for i, why in sorted(again.items()):
            procs[i].stop(grace_s=1.0)
            if launch == PORT_LAUNCHES:
                raise ServerLaunchError(
                    f"rollout.sglang.base_port: engine{i} lost its port to another process "
                    f"{launch} times ({why}): choose a base_port no other server of this host "
                    "uses (and a server_command whose server stays in the session or descent of "
                    "the process megapkl starts)")
            specs[i] = specs[i].moved([s.port for s in specs])
            log.warning("rollout.sglang: engine%d: %s; starting it again on port %d", i, why,
                        specs[i].port)
        todo = sorted(again)
        if not todo:
            break
    return list(zip(specs, procs))


def start_router(sg: Any, lane: Lane, worker_urls: list[str], log_path: Path,
                 health: HealthSettings, started: list[ServerProcess]) -> ServerProcess:
    """sglang-router in front of the fleet's servers, healthy; started again on the lane's next
    pair of ports should another process take its own before it binds them (as servers)."""
    taken: list[int] = []
    while True:
        port, metrics = router_ports(sg, lane.lane, lane.lanes, taken)
        router = ServerProcess("router", f"http://{local_address(sg.host)}:{port}",
                               router_command(sg, worker_urls, sg.host, port, metrics),
                               log_path).start()
        started.append(router)
        moved = _wait_all([router], health, "rollout.sglang: sglang-router",
                          lost=lambda p, failed: port_lost(p, port, failed))
        if not moved:
            return router
        router.stop(grace_s=1.0)
        taken += [port, metrics]
        if len(taken) == 2 * PORT_LAUNCHES:
            raise ServerLaunchError(f"rollout.sglang.base_port: sglang-router lost its ports to "
                                    f"another process {PORT_LAUNCHES} times ({moved[0]}): "
                                    "choose a base_port no other server of this host uses")
        log.warning("rollout.sglang: sglang-router: %s; starting it again on other ports",
                    moved[0])


def launch_fleet(rollout: Any, ctx: Any, hf_config: dict, work: Path, tokenizer: Any = None,
                 lane: Optional[Lane] = None) -> Fleet:
    """Start rollout.sglang.num_engines servers (+ the router) and wait for them; on any failure
    everything started is stopped and ServerLaunchError names the server and its log. `ctx`: the
    engine context (megapkl.rollout.factory.EngineContext); `lane`: its fleet_lane, if known."""
    sg, health = rollout.sglang, health_settings(rollout.sglang)
    lane = fleet_lane(rollout, ctx) if lane is None else lane
    model_path, dummy = served_model_dir(rollout, ctx, hf_config, work, tokenizer)
    # GPU placement for SGLang itself; a stand-in server_command places nothing.
    slots = None if sg.server_command else engine_slots(rollout, ctx)
    if slots is not None and sg.colocate and sg.weight_sync == "distributed" \
            and group_backend() == "nccl":
        raise ServerLaunchError("rollout.sglang.weight_sync: distributed with colocate true puts the "
                          "trainer's NCCL rank and a server's on one GPU, which NCCL refuses; use "
                          "tensor or disk, or rollout.sglang.colocate false")

    tokenizer_path = served_tokenizer(ctx, tokenizer)

    def make_cmd(host: str, port: int, base_gpu_id: Optional[int]) -> list[str]:
        return server_command(sg, model_path=model_path, host=host, port=port,
                              kv_cache_dtype=rollout.kv_cache_dtype,
                              routed_experts=ctx.routing_replay,
                              context_length=sg.context_length, dummy_weights=dummy,
                              base_gpu_id=base_gpu_id, tokenizer_path=tokenizer_path)

    specs = plan_servers(sg, log_dir=work / "logs", make_cmd=make_cmd, host=sg.host,
                         replica=lane.lane, slots=slots, replicas=lane.lanes,
                         gpus_per_node=None if slots is None else node_gpus(),
                         count=lane.servers)
    started: list[ServerProcess] = []
    router: Optional[ServerProcess] = None
    router_url: Optional[str] = None
    # a cold DeepGEMM cache makes FP8 servers compile at their first start (kernels.py)
    deadline, mark = startup_deadline(sg, rollout.fp8, hf_config)
    try:
        workers = [Worker(s.url, s.tp, spec=s, process=p)
                   for s, p in start_servers(specs, health, deadline, started)]
        mark_warm(mark)
        if sg.use_router:
            router = start_router(sg, lane, [w.url for w in workers], work / "logs" / "router.log",
                                  health, started)
            router_url = router.url
    except BaseException:
        for p in [*started, router]:
            if p is not None:
                p.stop()
        raise
    return Fleet(workers, health=health, router=router, router_url=router_url,
                 stopping=ctx.stopping, deterministic=DETERMINISTIC in sg.extra_args)


def connect_fleet(sg: Any, want: Expected, stopping: Callable[[], bool] = lambda: False) -> Fleet:
    """Servers someone else started: each must answer /health within startup_timeout_s and
    serve what `want` asks (served.py); the router only /health. `stopping`: the run is stopping
    (EngineContext.stopping)."""
    from urllib.parse import urlsplit

    for i, u in enumerate(sg.urls):  # before any server is waited for
        refuse_remote_tensor_sync(sg.weight_sync, urlsplit(u).hostname or "",
                                  f"rollout.sglang.urls[{i}]")
    health = health_settings(sg)
    # (config key, url, is a server whose flags and model must match)
    named = [(f"rollout.sglang.urls[{i}]", u, True) for i, u in enumerate(sg.urls)]
    if sg.router_url:
        named.append(("rollout.sglang.router_url", sg.router_url, False))

    def one(key_url: tuple[str, str, bool]) -> dict:
        key, url, is_server = key_url
        try:
            wait_healthy(None, url, first_wait_s=0.0, interval_s=min(health.interval_s, 1.0),
                         timeout_s=health.timeout_s, deadline_s=health.deadline_s, what=key)
        except ServerLaunchError as exc:
            raise ServerLaunchError(f"{key}: {url} is unreachable or unhealthy ({exc})") from None
        return check_served(key, url, want, timeout_s=health.timeout_s) if is_server else {}
    with rank_executor(len(named), "sglang-connect") as pool:
        infos = [f.result() for f in [pool.submit(one, x) for x in named]]
    return Fleet([Worker(u, sg.tp) for u in sg.urls], health=health, router_url=sg.router_url,
                 stopping=stopping,
                 deterministic=any(draws_from_seed(i) for i in infos))


def build_sglang_engine(rollout: Any, ctx: Any, tokenizer: Any = None,
                        transform: Optional[Transform] = None) -> SGLangEngine:
    """The engine of `rollout.sglang` for the engine context `ctx`
    (megapkl.rollout.factory.EngineContext): replica `ctx.replica` of `ctx.layout.dp` (data-parallel
    leaders); with several, each launches its own fleet, logs and exports under
    <run_dir>/sglang/replica<r>/, and a colocated replica spanning nodes has one fleet per node
    (`ctx.rank`'s, under .../node<k>/). The trainer pushes versions already quantized under
    rollout.fp8 (where it writes them); `transform` is applied to each bucket of a push besides
    (identity by default: pass megapkl.rollout.fp8.sync_transform() to push BF16 weights to an
    FP8 server yourself). The caller owns the engine: `close()` it (a run holds it in its run
    context); should the engine not come to be, the servers launched for it are stopped."""
    sg = rollout.sglang
    hf_config = {**ctx.hf_config,
                 "torch_dtype": "float32" if ctx.model_dtype == "fp32" else "bfloat16"}
    work = Path(ctx.work_dir) / "sglang"
    if ctx.layout.dp > 1:
        work = work / f"replica{ctx.replica}"
    if sg.urls:
        fleet = connect_fleet(sg, expected(rollout, ctx), stopping=ctx.stopping)
    else:
        lane = fleet_lane(rollout, ctx)
        if lane.count > 1:  # a fleet on each of the replica's nodes
            work = work / f"node{lane.index}"
        fleet = launch_fleet(rollout, ctx, hf_config, work, tokenizer, lane)
    try:
        sync = WeightSync(sync_settings(sg, [w.url for w in fleet.workers]), export_dir=work,
                          transform=transform or identity, hf_config=hf_config)
        return SGLangEngine(fleet, hf_config, sync, tokenizer=tokenizer,
                            answers=AnswerStore(work / "answered.pt"),
                            max_concurrency=sg.max_concurrency,
                            request_timeout_s=sg.request_timeout_s, max_retries=sg.max_retries)
    except BaseException:
        fleet.close()  # the servers launched for an engine that never came to be
        raise
