"""megapkl's server and router command lines, read by SGLang's and sglang-router's own parsers.

Executed from sglang (in the SGLang process, see sglang_side.py): `ServerArgs.add_cli_args`,
`ServerArgs.from_cli_args`, `ServerArgs.resolve_once` (the resolution pipeline and its checks,
with `device="cpu"` set on the parsed record: these machines have no accelerator SGLang knows, and
resolution refuses to guess one), `ModelConfig.from_server_args` on the directory megapkl serves,
`TorchMemorySaverAdapter.create`, and sglang_router's `parse_router_args`.
Not executed: `sglang.launch_server` itself (it starts GPU scheduler processes).

Each variant is launched the way a one-node, 8-GPU job launches it (megapkl_side.py): the trainer's
layout, the fleets of its data-parallel replicas, and the launcher's environment in each leader.
"""
from __future__ import annotations

import pytest

from megapkl_side import NODE_GPUS, VARIANTS, launched, launched_node


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_server_command_is_sglangs(sglang, name, tmp_path, monkeypatch):
    run = launched(name, tmp_path, monkeypatch)
    cfg, sg = run.cfg, run.cfg.rollout.sglang
    for i, (argv, _env) in enumerate(run.servers):
        got = sglang.call("parse_server_args", run.sglang_argv(i))
        assert "error" not in got, f"{name}: SGLang refuses megapkl's command line: {got}"
        assert got["model_path"] == str(run.model_dir)
        assert (got["tp_size"], got["ep_size"]) == (sg.tp, sg.ep)
        assert got["host"] == sg.host and got["skip_tokenizer_init"] is True
        # FP8 comes from the served config.json (test_model_dir_contract.py); a flag, if any,
        # must agree with it
        assert got["quantization"] in (("fp8", None) if cfg.rollout.fp8 else (None,)), got
        kv = {"auto": "auto", "bf16": "bf16"}.get(cfg.rollout.kv_cache_dtype,
                                                   cfg.rollout.kv_cache_dtype)
        assert got["kv_cache_dtype"] == kv
        assert got["enable_return_routed_experts"] is bool(cfg.model.routing_replay)
        assert got["context_length"] == sg.context_length
        assert got["load_format"] == "dummy"  # no HF checkpoint: the trainer pushes every weight
        assert got["mem_fraction_static"] == pytest.approx(sg.mem_fraction_static)
    assert len(run.servers) == sg.num_engines
    quant = sglang.call("quant_config", run.sglang_argv())  # SGLang's resolution of the served dir
    if cfg.rollout.fp8:
        assert (quant["quantization"], quant.get("checkpoint_fp8")) == ("fp8", True), quant
    else:
        assert quant["quantization"] is None, quant


def test_sglang_refuses_a_context_longer_than_the_model(sglang, tmp_path, monkeypatch):
    """The resolution really checks: a context length past max_position_embeddings is refused."""
    run = launched("moe_fp8_context", tmp_path, monkeypatch,
                   extra=("rollout.sglang.context_length=4096",))
    got = sglang.call("parse_server_args", run.sglang_argv())
    assert "error" in got and "context" in got["error"].lower(), got


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_memory_saver_adapter_follows_colocation(sglang, name, tmp_path, monkeypatch):
    run = launched(name, tmp_path, monkeypatch)
    colocated = run.cfg.rollout.sglang.colocate
    want = "_TorchMemorySaverAdapterReal" if colocated else "_TorchMemorySaverAdapterNoop"
    for i in range(len(run.servers)):
        got = sglang.call("memory_saver", run.sglang_argv(i))
        assert (got["adapter"], got["enable_memory_saver"]) == (want, colocated), (i, got)


def _gpus(sglang, argv: list[str], env: dict, tp: int) -> list[str]:
    """The physical GPUs a server's TP ranks use: rank r takes device base_gpu_id + r * step of
    what CUDA_VISIBLE_DEVICES shows (all devices when unset)."""
    got = sglang.call("parse_server_args", argv)
    base, step = got["base_gpu_id"], got["gpu_id_step"] or 1
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [base + r * step for r in range(tp)]
    if visible is None:
        return [str(i) for i in ids]
    shown = visible.split(",")
    assert max(ids) < len(shown), f"TP ranks {ids} beyond CUDA_VISIBLE_DEVICES={visible}"
    return [shown[i] for i in ids]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_servers_of_a_node_use_distinct_gpus(sglang, name, tmp_path, monkeypatch):
    """Every replica's leader launches its fleet: every server gets GPUs of its own on the node,
    a colocated fleet those its replica trains on (megatron-core's rank order; rank r uses GPU r
    of its node), a dedicated fleet none the trainer uses."""
    fleets = launched_node(name, tmp_path, monkeypatch)
    cfg = fleets[0][1].cfg
    sg, trainer_gpus = cfg.rollout.sglang, set(range(cfg.world_size))  # one process per GPU
    assert len(fleets) == cfg.parallel.data > 1
    used = []
    for d, (ranks, run) in enumerate(fleets):
        assert len(run.servers) == sg.num_engines, (d, run.servers)
        for i, (_, env) in enumerate(run.servers):
            gpus = _gpus(sglang, run.sglang_argv(i), env, sg.tp)
            used.append(gpus)
            assert set(gpus) <= {str(g) for g in range(NODE_GPUS)}, (d, i, gpus)
            if sg.colocate:
                assert set(gpus) <= {str(r % NODE_GPUS) for r in ranks}, \
                    f"replica {d} (trainer ranks {ranks}) has server {i} on GPUs {gpus}"
            else:
                assert not set(gpus) & {str(g) for g in trainer_gpus}, \
                    f"dedicated server {i} of replica {d} on the trainer's GPUs {gpus}"
    flat = [g for gpus in used for g in gpus]
    assert len(flat) == len(set(flat)), f"servers share GPUs: {used}"


@pytest.mark.parametrize("name", ["default_fp8_colocated", "moe_r3_tp2_ep2"])
def test_router_command_is_sglang_routers(sglang, name, tmp_path, monkeypatch):
    run = launched(name, tmp_path, monkeypatch)
    sg = run.cfg.rollout.sglang
    argv = run.router
    k = argv.index("sglang_router.launch_router")
    got = sglang.call("parse_router_args", argv[k + 1:])
    assert "error" not in got, got
    urls = [f"http://127.0.0.1:{a[a.index('--port') + 1]}" for a, _ in run.servers]
    assert got["worker_urls"] == urls
    assert got["policy"] == sg.router_policy
    assert got["host"] == sg.host
    assert got["prometheus_host"] == sg.host and got["prometheus_port"] != got["port"]
    assert got["health_check_endpoint"] == "/model_info"  # never a generation (fleet.py)
