"""What megapkl starts SGLang with: the served model directory (block-FP8 quantization_config,
EOS), the memory-saver flags of colocated servers, and each server's GPUs (`--base-gpu-id`) per
data-parallel replica. SGLang's own parser and loader run on these in tests/contract/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megapkl.config import load_config
from megapkl.models.spec import hf_config_dict, load_spec
from megapkl.rollout.fp8 import QUANTIZATION_CONFIG, read_quantization_config
from megapkl.rollout.sglang.build import engine_slots, served_model_dir
from megapkl.rollout.sglang.launch import (ServerLaunchError, plan_servers, releases_memory,
                                           server_command)
from megapkl.config.layout import Layout
from megapkl.rollout.sglang.placement import (PlacementError, Slot, check_fleets,
                                              colocated_fleets, colocated_gpus, fleet_owners,
                                              fleet_slots, spread)


class _Tok:
    eos_token_id = 151643


def _cfg(*extra):
    return load_config("configs/demo/cpu_demo.yaml", ["rollout.engine=sglang", *extra])


def _hf():
    return hf_config_dict(load_spec("tiny-qwen3"), dtype="bfloat16")


def _served(cfg, work, tokenizer=None):
    from engine_contexts import context_of

    return served_model_dir(cfg.rollout, context_of(cfg, _hf()), _hf(), work, tokenizer)


def _slots(cfg, replica, replicas):
    from engine_contexts import context_of

    return engine_slots(cfg.rollout, context_of(cfg, _hf(), replica=replica, replicas=replicas))


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _cmd(cfg, path="m", dummy=True, gpu=None):
    sg = cfg.rollout.sglang
    return server_command(sg, model_path=path, host="127.0.0.1", port=30000,
                          kv_cache_dtype=cfg.rollout.kv_cache_dtype, routed_experts=False,
                          context_length=None, dummy_weights=dummy, base_gpu_id=gpu)


def test_fp8_serves_a_block_fp8_config_with_dummy_weights(tmp_path):
    """SGLang takes its quantization from config.json: only a block-FP8 quantization_config makes
    it build `weight_scale_inv` parameters for the pushed e4m3 weights (`--quantization fp8`
    alone is online per-tensor FP8)."""
    cfg = _cfg("rollout.fp8=true")
    path, dummy = _served(cfg, tmp_path, _Tok())
    config = json.loads((Path(path) / "config.json").read_text())
    assert dummy and config["quantization_config"] == QUANTIZATION_CONFIG
    assert read_quantization_config(config) == (128, 128)
    cmd = _cmd(cfg, path, dummy)
    assert _flag(cmd, "--load-format") == "dummy" and "--quantization" not in cmd
    assert _flag(cmd, "--model-path") == path


def test_an_fp8_run_from_a_checkpoint_serves_its_config_quantized(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    own = {**_hf(), "eos_token_id": 7, "bos_token_id": 1}
    (ckpt / "config.json").write_text(json.dumps(own))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    plain = _cfg(f"model.hf_checkpoint={ckpt}")
    assert _served(plain, tmp_path / "a") == (str(ckpt), False)
    path, dummy = _served(_cfg(f"model.hf_checkpoint={ckpt}", "rollout.fp8=true"),
                           tmp_path / "b", _Tok())
    config = json.loads((Path(path) / "config.json").read_text())
    assert dummy and config["eos_token_id"] == 7 and config["bos_token_id"] == 1
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert json.loads((Path(path) / "generation_config.json").read_text())["eos_token_id"] == [7, 8]


def test_the_config_only_model_declares_eos(tmp_path):
    """--skip-tokenizer-init: SGLang's EOS comes from config.json alone."""
    path, _ = _served(_cfg(), tmp_path, _Tok())
    assert json.loads((Path(path) / "config.json").read_text())["eos_token_id"] == 151643
    with pytest.raises(ServerLaunchError, match="eos_token_id.*model.tokenizer"):
        _served(_cfg(), tmp_path / "x", tokenizer=None)


def test_colocated_servers_start_with_the_memory_saver():
    """Release/resume do nothing without --enable-memory-saver; the weights survive a release
    only with --enable-weights-cpu-backup. `megapkl plan` counts the memory as free exactly when
    megapkl releases it."""
    colocated = _cfg("rollout.sglang.colocate=true")
    assert releases_memory(colocated.rollout.sglang)
    cmd = _cmd(colocated)
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd
    for other in (_cfg("rollout.sglang.colocate=false"),
                  _cfg('rollout.sglang.urls=["http://127.0.0.1:1"]')):
        assert not releases_memory(other.rollout.sglang)
        assert "--enable-memory-saver" not in _cmd(other)


def test_colocated_fleets_of_8_replicas_on_a_node_use_one_gpu_each():
    lay = Layout(tp=1, cp=1, pp=1, dp=8, per_node=8)
    slots = check_fleets(num_engines=1, tp=1, colocate=True, lay=lay)
    assert [s.base_gpu for fleet in slots for s in fleet] == list(range(8))
    with pytest.raises(PlacementError, match="rollout.sglang.num_engines x rollout.sglang.tp"):
        check_fleets(num_engines=2, tp=1, colocate=True, lay=lay)


def test_colocated_placement_follows_the_replica_ranks():
    # TP 2 x PP 2 on 8 GPUs: replica 0 trains on GPUs 0, 1 (stage 0) and 4, 5 (stage 1)
    lay = Layout(tp=2, cp=1, pp=2, dp=2, per_node=8)
    assert colocated_gpus(lay, 0) == [0, 1, 4, 5] and colocated_gpus(lay, 1) == [2, 3, 6, 7]
    assert [s.base_gpu for s in fleet_slots(num_engines=2, tp=2, colocate=True, lay=lay,
                                            replica=1)] == [2, 6]
    # CP 2 x TP 1 (the 1.7B PKL layout): 4 replicas of 2 GPUs on one node, 2 servers each
    lay = Layout(tp=1, cp=2, pp=1, dp=4, per_node=8)
    fleets = check_fleets(num_engines=2, tp=1, colocate=True, lay=lay)
    assert sorted(s.base_gpu for f in fleets for s in f) == list(range(8))
    # a replica spanning nodes: its leader's node holds the first share of its fleet
    lay = Layout(tp=8, cp=2, pp=2, dp=2, per_node=8)
    assert colocated_gpus(lay, 1) == list(range(8))
    assert [s.base_gpu for s in fleet_slots(num_engines=8, tp=4, colocate=True, lay=lay,
                                            replica=1)] == [0, 4]


# The 32B layout: TP 8 x CP 2 x PP 2 on 8 nodes of 8 GPUs, 2 replicas. Replica 0 trains on
# ranks 0-15 (stage 0, nodes 0-1) and 32-47 (stage 1, nodes 4-5), replica 1 on 16-31 and 48-63.
LAY_32B = Layout(tp=8, cp=2, pp=2, dp=2, per_node=8)


def _fleets(lay=LAY_32B, **kw):
    return [(f.node, f.owner, f.servers, [s.base_gpu for s in f.slots])
            for f in colocated_fleets(lay=lay, **kw)]


def test_a_replica_spanning_nodes_spreads_its_fleet_over_them():
    """Each node the replica trains on holds its share, owned by the replica's first rank
    there; the two replicas' 16 servers of 4 GPUs cover the 64 GPUs once."""
    assert LAY_32B.replica_nodes(1) == [2, 3, 6, 7]
    assert _fleets(num_engines=8, tp=4, replica=1) == [
        (2, 16, 2, [0, 4]), (3, 24, 2, [0, 4]), (6, 48, 2, [0, 4]), (7, 56, 2, [0, 4])]
    assert fleet_owners(num_engines=8, tp=4, colocate=True, lay=LAY_32B, replica=0) == [
        (0, 2), (8, 2), (32, 2), (40, 2)]
    gpus = [(s.node, s.base_gpu + k) for fleet in check_fleets(
        num_engines=8, tp=4, colocate=True, lay=LAY_32B) for s in fleet for k in range(4)]
    assert sorted(gpus) == [(n, g) for n in range(8) for g in range(8)]
    # a rank launches the servers of the fleet it owns, and none when it owns none
    assert fleet_slots(num_engines=8, tp=4, colocate=True, lay=LAY_32B, replica=1,
                       owner=48) == [Slot(None, 0), Slot(None, 4)]
    assert fleet_slots(num_engines=8, tp=4, colocate=True, lay=LAY_32B, replica=1,
                       owner=17) == []


def test_an_uneven_share_goes_to_the_earlier_nodes():
    assert spread(5, 4) == [2, 1, 1, 1] and spread(2, 4) == [1, 1, 0, 0] and spread(8, 1) == [8]
    # nodes left without a server have no fleet (no owner)
    assert _fleets(num_engines=3, tp=4, replica=0) == [
        (0, 0, 1, [0]), (1, 8, 1, [0]), (4, 32, 1, [0])]
    assert _fleets(num_engines=5, tp=4, replica=1) == [
        (2, 16, 2, [0, 4]), (3, 24, 1, [0]), (6, 48, 1, [0]), (7, 56, 1, [0])]


def test_every_node_false_keeps_a_fleet_on_its_leaders_node():
    assert _fleets(num_engines=2, tp=4, replica=1, every_node=False) == [(2, 16, 2, [0, 4])]
    assert fleet_owners(num_engines=2, tp=4, colocate=True, lay=LAY_32B, replica=1,
                        every_node=False) == [(16, 2)]
    assert [[s.node for s in f] for f in check_fleets(
        num_engines=2, tp=4, colocate=True, lay=LAY_32B, every_node=False)] == [[0, 0], [2, 2]]
    # dedicated servers: the leader owns the whole fleet
    assert fleet_owners(num_engines=3, tp=1, colocate=False, lay=LAY_32B, replica=1) == [(16, 3)]


def test_a_fleet_that_does_not_fit_names_the_keys():
    with pytest.raises(PlacementError) as info:
        check_fleets(num_engines=3, tp=4, colocate=True, lay=LAY_32B, every_node=False)
    msg = str(info.value)
    assert msg.startswith("rollout.sglang.num_engines x rollout.sglang.tp = 3 x 4: "), msg
    assert "its leader's node" in msg and "room for 2 server(s) of 4 GPU(s)" in msg, msg
    with pytest.raises(PlacementError) as info:  # 9 over 4 nodes: 3 on the first, room for 2
        check_fleets(num_engines=9, tp=4, colocate=True, lay=LAY_32B)
    msg = str(info.value)
    assert "its 4 nodes (rollout.sglang.every_node), 3 on node 0" in msg, msg
    assert "replica 0 trains on GPUs [0, 1, 2, 3, 4, 5, 6, 7] there, room for 2" in msg, msg
    assert len(msg.splitlines()) == 1


def test_servers_on_no_gpu_are_spread_without_a_fit():
    """A CPU stand-in (gpus false): the same spread over the replica's nodes, no slots, so a
    node with one trainer rank still holds two servers."""
    lay = Layout(tp=1, cp=1, pp=2, dp=1, per_node=1)
    assert _fleets(lay, num_engines=3, tp=1, replica=0, gpus=False) == [
        (0, 0, 2, []), (1, 1, 1, [])]
    assert fleet_owners(num_engines=3, tp=1, colocate=True, lay=lay, replica=0,
                        gpus=False) == [(0, 2), (1, 1)]
    with pytest.raises(PlacementError, match="room for 1"):
        colocated_fleets(num_engines=3, tp=1, lay=lay, replica=0)


def test_dedicated_servers_take_the_gpus_the_trainer_leaves():
    lay = Layout(tp=1, cp=1, pp=1, dp=4, per_node=2)  # 2 nodes x 2 trainer ranks
    fleets = check_fleets(num_engines=1, tp=3, colocate=False, lay=lay, nodes=2, gpus_per_node=8)
    assert [(s.node, s.base_gpu) for f in fleets for s in f] == [(0, 2), (0, 5), (1, 2), (1, 5)]
    with pytest.raises(PlacementError, match="room for 2"):
        check_fleets(num_engines=1, tp=4, colocate=False, lay=lay, nodes=2, gpus_per_node=8)
    lay = Layout(tp=1, cp=1, pp=1, dp=8, per_node=4)
    fleets = check_fleets(num_engines=1, tp=1, colocate=False, lay=lay, nodes=2, gpus_per_node=8)
    assert [(s.node, s.base_gpu) for f in fleets for s in f] == \
        [(n, g) for n in range(2) for g in range(4, 8)]


def test_each_server_gets_its_own_base_gpu_id(tmp_path, monkeypatch):
    """The commands megapkl starts: no two servers of a node share a GPU, across replicas too."""
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = _cfg("parallel.data=4", "parallel.context=2", "rollout.sglang.num_engines=2",
               "rollout.sglang.base_port=31000")
    sg = cfg.rollout.sglang
    seen = []
    for replica in range(4):
        slots = _slots(cfg, replica, 4)
        specs = plan_servers(sg, log_dir=tmp_path, host="127.0.0.1", replica=replica,
                             slots=slots, make_cmd=lambda h, p, g: _cmd(cfg, gpu=g))
        seen += [int(_flag(s.cmd, "--base-gpu-id")) for s in specs]
    assert sorted(seen) == list(range(8))
    with pytest.raises(ServerLaunchError, match="num_engines"):
        _slots(_cfg("parallel.data=4", "parallel.context=2", "rollout.sglang.num_engines=3"),
               0, 4)


@pytest.mark.parametrize("base_port, warned", [(30000, False), (31800, True), (40000, True),
                                                (61500, False)])
def test_server_ports_in_the_ephemeral_range_are_warned_about(base_port, warned, tmp_path,
                                                              monkeypatch, caplog):
    """Ports an outgoing connection may take before the server binds them: the servers' (from
    base_port) or the routers' (from base_port + 1000), against this host's range."""
    import logging

    from megapkl.rollout.sglang import launch

    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.setattr(launch, "ephemeral_ports", lambda: (32768, 60999))  # Linux's default
    cfg = _cfg("rollout.sglang.num_engines=2", f"rollout.sglang.base_port={base_port}")
    with caplog.at_level(logging.WARNING, logger=launch.__name__):
        plan_servers(cfg.rollout.sglang, log_dir=tmp_path, host="127.0.0.1",
                     make_cmd=lambda h, p, g: ["true"])
    hits = [r.getMessage() for r in caplog.records if "ephemeral port range" in r.getMessage()]
    assert bool(hits) == warned, hits
    if warned:
        assert hits[0].startswith(f"rollout.sglang.base_port {base_port}: ") and "31766" in hits[0]


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    from megapkl.rollout.sglang.launch import ephemeral_ports

    rng = tmp_path / "ip_local_port_range"
    rng.write_text("40000\t50000\n")
    assert ephemeral_ports(str(rng)) == (40000, 50000)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)


def test_slurm_nodes_need_no_slurm_client(monkeypatch):
    from megapkl.rollout.sglang.launch import slurm_nodes

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-a[003-004],gpu-b7")
    assert slurm_nodes() == ["gpu-a003", "gpu-a004", "gpu-b7"]
    assert Slot(None, 0).node is None


def test_replicas_sharing_a_node_search_disjoint_ports():
    """The replicas of a node pick their ports at the same time: when their first ports are taken
    (a requeued job whose old servers still hold them), they must not both move to the same next
    free one. A port whose server died (TIME_WAIT) counts as free, as for the server's own bind."""
    import socket

    from megapkl.rollout.sglang.launch import pick_ports

    from sglang_fixtures import free_port

    def hold_two_adjacent():
        """Listen on a free port and the next one (another process may own base+1: try again)."""
        for _ in range(50):
            base, held = free_port(), []
            try:
                for p in (base, base + 1):
                    s = socket.socket()
                    held.append(s)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", p))
                    s.listen()
                return base, held
            except OSError:
                for s in held:
                    s.close()
        raise AssertionError("no two adjacent free loopback ports in 50 tries")

    base, held = hold_two_adjacent()  # both replicas' first ports are taken
    try:
        got = [pick_ports("127.0.0.1", base + r, 1, stride=2)[0] for r in range(2)]
    finally:
        for s in held:
            s.close()
    assert got[0] != got[1] and {p % 2 for p in got} == {base % 2, (base + 1) % 2}, got
    assert pick_ports("127.0.0.1", base, 2, stride=4) == [base, base + 1]  # closed: free again


@pytest.mark.parametrize("replicas", [2, 4])
def test_routers_of_replicas_sharing_a_node_never_share_a_port(replicas):
    """Each replica's router and its Prometheus listener: no port of one replica's pair is another
    replica's (the routers start at the same time, so a port free now may be taken next)."""
    from types import SimpleNamespace

    from megapkl.rollout.sglang.launch import router_ports

    from sglang_fixtures import free_port

    sg = SimpleNamespace(host="127.0.0.1", base_port=free_port() - 1000)
    pairs = [router_ports(sg, r, replicas) for r in range(replicas)]
    ports = [p for pair in pairs for p in pair]
    assert len(set(ports)) == len(ports), pairs


def test_tensor_sync_to_a_server_on_another_host_is_refused_before_any_wait():
    """`tensor` sync sends shared-memory file names, which exist on this host only."""
    import socket
    from types import SimpleNamespace

    from megapkl.rollout.sglang.build import connect_fleet
    from megapkl.rollout.sglang.launch import ServerLaunchError, refuse_remote_tensor_sync

    sg = SimpleNamespace(urls=["http://127.0.0.1:30000", "http://gpu-node-17.invalid:30000"],
                         weight_sync="tensor")
    with pytest.raises(ServerLaunchError, match=r"rollout.sglang.weight_sync: tensor .*"
                       r"gpu-node-17.invalid, rollout.sglang.urls\[1\]"):
        connect_fleet(sg, None)
    for host in ("127.0.0.1", "localhost", socket.gethostname()):
        refuse_remote_tensor_sync("tensor", host, "here")  # this host: accepted
    for mode in ("distributed", "disk"):
        refuse_remote_tensor_sync(mode, "gpu-node-17.invalid", "there")


def test_each_launched_server_runs_on_its_gpus_share_of_the_nodes_cpus(tmp_path):
    """A server inherits its launcher's affinity, which a task binding narrows to the leader
    rank's cores: each launched server gets its GPUs' slice of the job's CPUs instead."""
    import os
    import sys
    import time
    from types import SimpleNamespace

    from megapkl.rollout.sglang.affinity import job_cpus, parse_cpu_list, server_cpus
    from megapkl.rollout.sglang.launch import plan_servers
    from megapkl.rollout.sglang.placement import Slot

    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    cpus = list(range(16))
    assert server_cpus(0, 1, 8, cpus) == [0, 1] and server_cpus(7, 1, 8, cpus) == [14, 15]
    assert server_cpus(4, 2, 8, cpus) == [8, 9, 10, 11]  # a TP=2 server: both GPUs' slices
    assert server_cpus(None, 1, 8, cpus) is None and server_cpus(0, 1, None, cpus) is None
    assert server_cpus(0, 1, 32, cpus) is None  # fewer CPUs than GPUs: inherit

    mine = sorted(os.sched_getaffinity(0))
    if len(job_cpus()) < 2 or len(mine) < 2:
        pytest.skip("needs two CPUs")
    os.sched_setaffinity(0, mine[:1])  # the launcher bound to one core, as srun --cpu-bind does
    try:
        sg = SimpleNamespace(base_port=30700, num_engines=2, tp=1, colocate=True)
        probe = [sys.executable, "-c", "import os; print('cpus', sorted(os.sched_getaffinity(0)))"]
        specs = plan_servers(sg, log_dir=tmp_path, make_cmd=lambda h, p, g: probe,
                             host="127.0.0.1", slots=[Slot(None, 0), Slot(None, 1)],
                             gpus_per_node=2)
        procs = [s.process().start() for s in specs]
        for p in procs:
            p.popen.wait(timeout=60)
    finally:
        os.sched_setaffinity(0, mine)
    seen = [p.log_path.read_text().split("cpus ")[-1].strip() for p in procs]
    share = len(job_cpus()) // 2
    assert seen == [str(job_cpus()[:share]), str(job_cpus()[share:2 * share])], seen


def test_the_placements_nodes_must_be_the_ranks_hosts():
    from megapkl.rollout.sglang.placement import check_nodes

    check_nodes(["a", "a", "b", "b"], per_node=2)  # block by block: as placed
    with pytest.raises(PlacementError, match=r"ranks 0-1 are placed on one node .* \['a', 'b'\]"):
        check_nodes(["a", "b", "a", "b"], per_node=2)  # round robin over the hosts
    with pytest.raises(PlacementError, match="nodes 0 and 1 of the placement .* both host a"):
        check_nodes(["a", "a", "a", "a"], per_node=2)  # LOCAL_WORLD_SIZE too small
    check_nodes(["a", "a"], per_node=1, gpus=False)  # CPU stand-ins take no GPU: allowed


SLOW_STUB = ["{python}", "-c", "import http.server as h, sys, time\n"
             "time.sleep(3)  # the first start's DeepGEMM compile\n"
             "class H(h.BaseHTTPRequestHandler):\n"
             "    def do_GET(self): self.send_response(200); self.end_headers()\n"
             "    def log_message(self, *a): pass\n"
             "h.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()",
             "{host}", "{port}"]


def test_an_fp8_fleet_waits_for_its_kernels_once_per_cache(tmp_path, monkeypatch):
    """An FP8 server's first start compiles DeepGEMM's kernels (SGLang: "typically 10-20 mins"),
    far past startup_timeout_s: the first start on a cold cache waits up to compile_timeout_s,
    marks the cache warm for its model shape once healthy, and later starts are held to
    startup_timeout_s again. Before: 900 s, and the launch failed."""
    from engine_contexts import context_of
    from megapkl.rollout.sglang.build import launch_fleet
    from megapkl.rollout.sglang.kernels import cache_dir

    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("SGLANG_DG_CACHE_DIR", "SGLANG_JIT_DEEPGEMM_PRECOMPILE"):
        monkeypatch.delenv(var, raising=False)
    cfg = _cfg("rollout.fp8=true", f"rollout.sglang.server_command={json.dumps(SLOW_STUB)}",
               "rollout.sglang.use_router=false", "rollout.sglang.startup_timeout_s=1",
               "rollout.sglang.compile_timeout_s=120", "rollout.sglang.base_port=30420",
               f"run_dir={tmp_path}")
    launch = lambda: launch_fleet(cfg.rollout, context_of(cfg, _hf()), _hf(),  # noqa: E731
                                  tmp_path / "sglang", _Tok())
    launch().close()  # cold: compiles (3 s) within compile_timeout_s
    assert len(list((cache_dir() / "megapkl-warm").iterdir())) == 1
    with pytest.raises(ServerLaunchError, match="not healthy after 1 s"):
        launch()  # warm: held to startup_timeout_s (the stub still takes 3 s)
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")  # nothing compiles at start
    cold = load_config("configs/demo/cpu_demo.yaml", ["rollout.engine=sglang", "rollout.fp8=true"])
    from megapkl.rollout.sglang.kernels import startup_deadline

    assert startup_deadline(cold.rollout.sglang, True, _hf()) == (900.0, None)
