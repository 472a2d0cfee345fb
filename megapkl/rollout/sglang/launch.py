"""Starting, watching and stopping rollout server processes and the sglang-router.

`server_command` builds `python -m sglang.launch_server` with the flags of `rollout.sglang`; when
`rollout.sglang.server_command` is set, that argument list is used instead, with `{model_path}`,
`{host}`, `{port}`, `{tp}`, `{ep}`, `{python}` and `{tokenizer_path}` substituted (how the tests and CPU boxes run
`megapkl serve` through the same code path). Every process writes its log into the run directory,
runs in its own session (so a kill takes its children too) and dies with the trainer (Linux
parent-death signal). Each server gets its GPUs with `--base-gpu-id` (placement.py). Inside a
Slurm allocation, dedicated servers (`colocate: false`) run on their nodes through
`srun --overlap`; elsewhere everything runs on this host.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

from megapkl.errors import MegapklError
from megapkl.rollout.sglang import http
from megapkl.rollout.sglang.affinity import server_cpus
from megapkl.rollout.sglang.placement import Slot, releases_memory

log = logging.getLogger(__name__)


class ServerLaunchError(MegapklError, RuntimeError):
    """A server or the router did not come up; the message names it and its log."""


def _die_with_parent(cpus: Optional[Sequence[int]] = None) -> None:  # in the child, before exec
    os.setsid()
    if cpus:  # affinity.py: the share of the node's CPUs that belongs to the server's GPUs
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a cgroup that confines us more tightly: keep what we inherited
            pass
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the engine's close still stops the servers
        pass


@dataclass
class ServerProcess:
    """One launched process (a server or the router) and where its log goes."""

    name: str
    url: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: Optional[list[int]] = None  # the CPUs it runs on (None: the launcher's)
    popen: Optional[subprocess.Popen] = None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n==== megapkl: starting {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                      preexec_fn=functools.partial(_die_with_parent, self.cpus))
        log.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s` (also kills a stopped process)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
                if sig == signal.SIGTERM:
                    os.killpg(self.popen.pid, signal.SIGCONT)  # a SIGSTOPped server must see it
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def port_free(host: str, port: int) -> bool:
    """Nobody listens on `port` (connections of a server that just died, in TIME_WAIT, do not
    count: servers bind with SO_REUSEADDR, so a requeued job gets its ports back)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def holds_port(proc: "ServerProcess", port: int) -> Optional[bool]:
    """Whether the process megapkl launched, one of its session (it runs setsid: a wrapper's
    children count) or one descending from it (a wrapper's child in a session of its own) listens
    on `port` of this host: True; False when another process does; None when this cannot be told
    (no /proc, or nothing listens on it here: a server on another node). A server can lose its
    port to a process that took it before the server bound it, which then answers its URL and
    would be synced and sent requests."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for f in (r.split() for r in rows):  # local address:port, state 0A = LISTEN, inode
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    if not inodes or proc.popen is None:
        return None
    for task in _family(proc.popen.pid):
        try:
            if any(os.readlink(fd) in inodes for fd in (task / "fd").iterdir()):
                return True
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return False


def _family(root: int) -> list[Path]:
    """/proc/<pid> of the processes of session `root` and of those descending from `root`."""
    parent, session = {}, {}
    for task in Path("/proc").iterdir():
        try:  # stat's fields after the command's closing parenthesis: state, ppid, pgrp, session
            if task.name.isdigit():
                f = (task / "stat").read_text().rsplit(")", 1)[1].split()
                parent[int(task.name)], session[int(task.name)] = int(f[1]), int(f[3])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    ours = {pid for pid, sid in session.items() if sid == root} | {root}
    grown = True
    while grown:
        new = {pid for pid, ppid in parent.items() if ppid in ours} - ours
        ours |= new
        grown = bool(new)
    return [Path("/proc", str(pid)) for pid in sorted(ours)]


ROUTER_PORT_OFFSET = 1000  # the routers' ports start at base_port + this (router_ports)


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """This host's range of ports handed to outgoing connections (Linux's default if unknown)."""
    try:
        low, high = Path(path).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def warn_if_ephemeral(sg: Any, replicas: int = 1) -> None:
    """A server port in the ephemeral range can be taken by any outgoing connection between the
    free-port check and the server's bind: the server then dies with "Address already in use"."""
    low, high = ephemeral_ports()
    routers = sg.base_port + ROUTER_PORT_OFFSET
    last = routers + 2 * replicas  # the routers' ports are the highest
    if sg.base_port <= high and last >= low:
        log.warning("rollout.sglang.base_port %d: the servers' ports (%d-%d, routers from %d) "
                    "overlap this host's ephemeral port range %d-%d, where an outgoing "
                    "connection can take a port before its server binds it; choose a base_port "
                    "below %d", sg.base_port, sg.base_port,
                    sg.base_port + replicas * sg.num_engines - 1, routers, low, high,
                    low - (last - sg.base_port))


def pick_ports(host: str, start: int, count: int, taken: Sequence[int] = (),
               stride: int = 0) -> list[int]:
    """`count` free ports from `start` on. With `stride` (>= count): only start + k * stride + j
    (j < count), so the replicas sharing a node, which search at the same time from
    base + replica * count with stride replicas * count, never pick the same port."""
    ports, block = [], max(stride, count)
    candidates = (start + k * block + j for k in range(65536) for j in range(count)) if stride \
        else iter(range(start, 65536))
    for p in candidates:
        if p > 65535:
            break
        if p not in taken and port_free(host, p):
            ports.append(p)
            if len(ports) == count:
                return ports
    raise ServerLaunchError(f"rollout.sglang.base_port: no {count} free ports from {start}")


def slurm_nodes() -> list[str]:
    """Host names of the current Slurm allocation ([] outside one), parsed from
    SLURM_JOB_NODELIST as submitit parses it (no Slurm client needed, e.g. inside a container)."""
    if not os.environ.get("SLURM_JOB_NODELIST"):
        return []
    from submitit.slurm.slurm import SlurmJobEnvironment

    return SlurmJobEnvironment().hostnames


def server_command(sg: Any, *, model_path: str, host: str, port: int,
                   kv_cache_dtype: str, routed_experts: bool, context_length: Optional[int],
                   dummy_weights: bool, base_gpu_id: Optional[int] = None,
                   tokenizer_path: Optional[str] = None) -> list[str]:
    """The argument list of one server (see the module docstring for `server_command`).
    FP8 needs no flag: the served model directory's config.json carries the block-FP8
    quantization_config, from which SGLang resolves its quantization (see build.py).
    Servers get ids and answer ids (--skip-tokenizer-init), unless `tokenizer_path`: the
    environment's stop strings are matched in decoded text, which SGLang refuses to do without
    its tokenizer (`raise_if_tokenizer_required`), so the server then loads that one."""
    subst = {"python": sys.executable, "model_path": model_path, "host": host, "port": str(port),
             "tp": str(sg.tp), "ep": str(sg.ep), "tokenizer_path": tokenizer_path or ""}
    if sg.server_command:
        return [a.format(**subst) for a in sg.server_command] + list(sg.extra_args)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", host, "--port", str(port), "--tp-size", str(sg.tp), "--ep-size", str(sg.ep),
           "--mem-fraction-static", str(sg.mem_fraction_static)]
    cmd += ["--tokenizer-path", tokenizer_path] if tokenizer_path else ["--skip-tokenizer-init"]
    if base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(base_gpu_id)]
    if dummy_weights:
        cmd += ["--load-format", "dummy"]  # the trainer pushes the real weights before any use
    if releases_memory(sg):
        # Without the memory saver, release/resume do nothing; without the CPU backup the
        # weights would not survive a release (generation without a push in between reads them).
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    if kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    return cmd + list(sg.extra_args)


def router_ports(sg: Any, replica: int, replicas: int,
                 taken: Sequence[int] = ()) -> tuple[int, int]:
    """The router's port and its Prometheus listener's, searched as a pair from
    base_port + 1000 + 2 * replica with stride 2 * replicas: the routers of replicas sharing a node
    start at the same time, and one's metrics port must not be the next one's router port.
    `taken`: ports not to pick (a router that lost them before its bind)."""
    port, metrics = pick_ports(sg.host, sg.base_port + ROUTER_PORT_OFFSET + 2 * replica, 2,
                               taken, stride=2 * replicas)
    return port, metrics


def router_command(sg: Any, worker_urls: Sequence[str], host: str, port: int,
                   metrics: int) -> list[str]:
    cmd = list(sg.router_command) if sg.router_command else [
        sys.executable, "-m", "sglang_router.launch_router"]
    # The router checks its workers on /model_info, which SGLang answers without its scheduler:
    # its default, /health, runs a generation, and one that lands while a colocated server has
    # released its memory ends that server. The fleet's heartbeat is what judges health.
    return cmd + ["--worker-urls", *worker_urls, "--policy", sg.router_policy,
                  "--host", host, "--port", str(port), "--prometheus-host", host,
                  "--prometheus-port", str(metrics), "--health-check-endpoint", "/model_info"]


def wait_healthy(proc: Optional[ServerProcess], url: str, *, first_wait_s: float,
                 interval_s: float, timeout_s: float, deadline_s: float, route: str = "health",
                 what: str = "server", stop: Callable[[], bool] = lambda: False) -> None:
    """Poll `route` until it answers 200; ServerLaunchError (naming the log) when the process exits,
    `deadline_s` passes or `stop()` says the wait is over (the fleet is closing). `first_wait_s`
    spares servers that compile before they listen."""
    t0 = time.monotonic()
    time.sleep(first_wait_s)
    while True:
        if stop():
            raise ServerLaunchError(f"{what} {url}: no longer waited for (the fleet is closing)")
        if proc is not None and not proc.alive():
            raise ServerLaunchError(f"{what} {url} exited with code {proc.popen.returncode} before it "
                              f"became healthy; log: {proc.log_path}\n{proc.log_tail()}")
        try:
            http.request(url, route, timeout=timeout_s)
            return
        except (http.ServerUnreachable, http.ServerError):
            pass
        if time.monotonic() - t0 > deadline_s:
            where = f"; log: {proc.log_path}\n{proc.log_tail()}" if proc is not None else ""
            raise ServerLaunchError(f"{what} {url} not healthy after {deadline_s:.0f} s "
                                    f"(rollout.sglang.startup_timeout_s, or compile_timeout_s "
                                    f"for FP8 servers compiling their kernels){where}")
        time.sleep(interval_s)


@dataclass
class ServerSpec:
    """How to (re)start engine `index`: its command, URL, log and node. `moved(taken)`: the same
    server on the next free port of its lane, none of `taken` (None: it runs elsewhere, where
    its port is not this host's to check)."""

    index: int
    url: str
    cmd: list[str]
    log_path: Path
    tp: int = 1
    cpus: Optional[list[int]] = None  # affinity.py (None: the launcher's)
    moved: Optional[Callable[[Sequence[int]], "ServerSpec"]] = field(default=None, repr=False,
                                                                     compare=False)

    def process(self) -> ServerProcess:
        return ServerProcess(f"engine{self.index}", self.url, self.cmd, self.log_path,
                             cpus=self.cpus)

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80


PORT_TAKEN = "address already in use"  # what Python's bind, uvicorn and SGLang's own logs say


def port_lost(proc: ServerProcess, port: int, failed: bool) -> Optional[str]:
    """Why a server just launched on this host lost `port` to another process between the
    free-port check and its bind (servers bind after loading the model, seconds later): it exited
    saying the address is in use, or another process answers its URL. None: it did not."""
    if failed and not proc.alive() and PORT_TAKEN in proc.log_tail(40).lower():
        return f"port {port} taken before it could bind it ({proc.log_path})"
    if not failed and holds_port(proc, port) is False:
        return (f"another process of this host listens on port {port}, neither the one megapkl "
                "launched nor of its session or descent")
    return None


def next_free_port(host: str, port: int, stride: int, taken: Sequence[int]) -> int:
    """The first free port after `port` among port + k * stride: the lane's own ports, which the
    other fleets of this host never pick."""
    for p in range(port + stride, 65536, stride):
        if p not in taken and port_free(host, p):
            return p
    raise ServerLaunchError(f"rollout.sglang.base_port: no free port after {port} (stride "
                            f"{stride})")


def plan_servers(sg: Any, *, log_dir: Path,
                 make_cmd: Callable[[str, int, Optional[int]], list[str]], host: str,
                 replica: int = 0, slots: Optional[Sequence[Slot]] = None, replicas: int = 1,
                 gpus_per_node: Optional[int] = None,
                 count: Optional[int] = None) -> list[ServerSpec]:
    """One spec per server of fleet `replica` of `replicas` (a data-parallel replica's, or with
    colocated fleets on every node of a replica, one lane per fleet of the run): `count` servers
    (default num_engines). Ports start at base_port + replica * num_engines, so fleets sharing a
    node never collide.
    `slots` (placement.py): the node and first GPU of each server (None: no GPU placement, e.g.
    `megapkl serve` stand-ins on CPU); `make_cmd(host, port, base_gpu_id)`. A server launched
    here runs on its GPUs' share of the node's CPUs (affinity.py, `gpus_per_node`).

    - colocate (the default), or outside a multi-node Slurm allocation: the engines run on this
      host (the replica's own node), bound to `host` (loopback unless configured).
    - colocate false inside an allocation of several nodes: the engines run on the nodes of their
      slots (`srun --overlap`), bound to `host` and addressed by node name. Other nodes must reach
      them, so `host` must not be loopback: setting it is the explicit choice to expose the
      servers' weight-update routes to the network (a warning is logged)."""
    first = sg.base_port + replica * sg.num_engines
    count = sg.num_engines if count is None else count
    if replica == 0:
        warn_if_ephemeral(sg, replicas)
    gpu = [None if slots is None else slots[i].base_gpu for i in range(count)]
    nodes = slurm_nodes()
    if len(nodes) > 1 and not sg.colocate:
        if shutil.which("srun") is None:
            raise ServerLaunchError("rollout.sglang.colocate false starts the servers on the "
                              "allocation's other nodes with `srun --overlap`, and srun is not "
                              "on this task's PATH (a container without the Slurm client?): run "
                              "the job outside a container, or with colocate true")
        from megapkl.rollout.sglang.http import is_loopback

        if is_loopback(host):
            raise ServerLaunchError(f"rollout.sglang.colocate false spreads the servers over the "
                              f"allocation's {len(nodes)} nodes, which cannot reach a server bound "
                              f"to rollout.sglang.host {host}: set it to an address other nodes "
                              "reach (e.g. 0.0.0.0), which exposes the servers' weight-update "
                              "routes to that network")
        log.warning("rollout.sglang.host %s: the SGLang servers' weight-update routes (which load "
                    "tensors and files sent to them) are reachable from the network", host)
        specs = []
        for i in range(sg.num_engines):
            k = replica * sg.num_engines + i  # no slots: the run's servers in turn over the nodes
            node = nodes[(k if slots is None else slots[i].node) % len(nodes)]
            refuse_remote_tensor_sync(sg.weight_sync, node, "rollout.sglang.colocate false")
            port = first + i
            cmd = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                   *make_cmd(host, port, gpu[i])]
            specs.append(ServerSpec(i, f"http://{node}:{port}", cmd,
                                    log_dir / f"engine{i}.log", sg.tp))
        return specs
    stride = replicas * sg.num_engines

    def local(i: int, port: int) -> ServerSpec:
        return ServerSpec(i, f"http://{local_address(host)}:{port}", make_cmd(host, port, gpu[i]),
                          log_dir / f"engine{i}.log", sg.tp,
                          cpus=server_cpus(gpu[i], sg.tp, gpus_per_node),
                          moved=lambda taken: local(i, next_free_port(host, port, stride, taken)))
    return [local(i, port) for i, port in enumerate(pick_ports(host, first, count, stride=stride))]


def local_address(host: str) -> str:
    """How this host reaches a server bound to `host` (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def this_node() -> str:
    """This process's node name as the allocation's other nodes know it."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def on_this_host(hostname: str) -> bool:
    """Is `hostname` (a server URL's host) this machine, as far as its names tell?"""
    from megapkl.rollout.sglang.http import is_loopback

    names = {this_node(), socket.gethostname(), socket.getfqdn(), "localhost"}
    return is_loopback(hostname) or hostname in names or hostname.split(".")[0] in names


def refuse_remote_tensor_sync(mode: str, hostname: str, where: str) -> None:
    """`tensor` sync sends shared-memory file names (and CUDA IPC handles), which exist on this
    host only: a server on another host could never load them."""
    if mode == "tensor" and not on_this_host(hostname):
        raise ServerLaunchError(
            f"rollout.sglang.weight_sync: tensor sends shared-memory file names, which a server on "
            f"another host ({hostname}, {where}) cannot open: use distributed or disk")
