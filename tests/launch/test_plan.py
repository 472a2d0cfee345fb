"""`megapkl plan`: parameter and optimizer bytes equal what megatron-core allocates for the tiny
models on CPU at several layouts; every paper experiment fits its profile; submit refuses a run
that cannot fit (unless --force) with the planner's table in the message."""
import pytest
from job_inputs import job_inputs

from megapkl.cli import main
from megapkl.config import configs_dir, load_config
from megapkl.launch.plan import CONTEXT_GIB, Layout, plan, plan_config, stage_params
from megapkl.models.spec import load_spec

EXPERIMENTS = sorted(p for p in (configs_dir() / "experiments").rglob("*.yaml")
                     if not p.name.startswith("_"))


def _allocated(rank, world, name, tp, pp, ep, sp):
    """(local parameters, gradient buffer elements, Adam exp_avg elements) megatron allocates."""
    from megapkl.models.checkpoint import _allocate_torch_adam_state, _sub_optimizers
    from megapkl.models.optimizer import OptimSettings, build_optimizer, wrap_ddp
    from megapkl.models.provider import ModelOptions, build_model
    from megapkl.parallel.groups import init_parallel

    g = init_parallel(tp=tp, pp=pp, ep=ep, etp=1 if ep > 1 else None, seed=0)
    model = build_model(load_spec(name), ModelOptions(dtype="fp32", sequence_parallel=sp))
    params = sum(p.numel() for p in model.parameters())
    ddp = wrap_ddp([model], OptimSettings())
    grads = sum(b.grad_data.numel() for c in ddp for b in c.buffers + c.expert_parallel_buffers)
    opt = build_optimizer(ddp, OptimSettings())
    moments = 0
    for sub in _sub_optimizers(opt):
        _allocate_torch_adam_state(sub)
        moments += sum(s["exp_avg"].numel() for s in sub.optimizer.state.values())
    return g.pp_rank, g.dp_size, params, grads, moments


LAYOUTS = [("tiny-qwen3", 1, 1, 1, False, 2), ("tiny-qwen3", 2, 1, 1, True, 2),
           ("tiny-qwen3", 1, 2, 1, False, 2), ("tiny-qwen3-moe", 1, 1, 2, False, 2)]


@pytest.mark.parametrize("name,tp,pp,ep,sp,world", LAYOUTS,
                         ids=[f"{n}-tp{t}-pp{p}-ep{e}" for n, t, p, e, _, _ in LAYOUTS])
def test_parameter_and_optimizer_bytes_match_megatron(dist_run, name, tp, pp, ep, sp, world):
    spec = load_spec(name)
    for pp_rank, dp, params, grads, moments in dist_run(_allocated, world, name, tp, pp, ep, sp):
        lay = Layout(tp=tp, pp=pp, ep=ep, dp=dp, sp=sp)
        dense, expert = stage_params(spec, lay, pp_rank)
        assert params == dense + expert, (pp_rank, params, dense, expert)
        # megatron pads its grad buffer to a multiple of the DP size (x 128 per bucket)
        assert dense + expert <= grads <= dense + expert + 128 * dp * 2
        expect = dense / dp + expert / max(1, dp // ep)
        assert abs(moments - expect) <= 128 * 2, (moments, expect)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_every_experiment_fits_its_profile(path, tmp_path):
    cfg = load_config(path)
    p = plan_config(str(path), cfg.slurm.profile or "h100", [f"model.hf_checkpoint={tmp_path}"])
    assert p.gpu_gib is not None and p.fits, p.table()


def test_plan_cli_and_submit_refuses_a_run_that_cannot_fit(capsys, tmp_path):
    cfg = "configs/experiments/pkl_periodic/qwen3_32b_pkl.yaml"
    inputs = job_inputs(tmp_path)  # what submit checks the job can read
    assert main(["plan", cfg, *inputs, "--profile", "h100"]) == 0
    out = capsys.readouterr().out
    assert "-> fits" in out and "model FLOPs per update" in out
    # no tensor/pipeline parallelism: 32B on one GPU's worth of layout cannot fit 80 GB
    big = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.context=1",
           "parallel.sequence_parallel=false", "rollout.sglang.tp=1",
           "rollout.sglang.num_engines=1", f"run_dir={tmp_path / 'r'}", *inputs]
    assert main(["plan", cfg, *big, "--profile", "h100"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["submit", cfg, *big, "--profile", "h100", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "does not fit h100's GPUs" in err and "DOES NOT FIT" in err
    assert main(["submit", cfg, *big, "--profile", "h100", "--dry-run", "--force"]) == 0
    capsys.readouterr()


def test_without_a_profile_memory_has_no_verdict():
    p = plan(load_config("configs/demo/cpu_demo.yaml"), None)
    assert p.gpu_gib is None and p.fits and "sets no gpu_mem_gib" in p.table()


def _saved_activation_bytes(rank, world, seq):
    """Bytes of the tensors a tiny-qwen3 forward keeps for backward (autograd's saved tensors,
    each storage once; parameters excluded), at micro-batch 1 and sequence length `seq`."""
    import torch

    from megapkl.models.provider import ModelOptions, build_model
    from megapkl.parallel.groups import init_parallel

    init_parallel(seed=0)
    model = build_model(load_spec("tiny-qwen3"), ModelOptions(dtype="fp32"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 128, (1, seq))
    pos = torch.arange(seq).unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, pos, None)
    return sum(seen.values())


@pytest.mark.parametrize("seq", [128, 512])
def test_activation_estimate_within_a_factor_of_two_of_the_cpu_forward(dist_run, seq):
    """The CPU model is fp32 with unfused attention (scores kept): the same formula with 4-byte
    activations and the 5 a s^2 b term, plus the fp32 logits, within 2x of what autograd keeps."""
    from megapkl.launch.plan import layer_activation_bytes

    spec = load_spec("tiny-qwen3")
    (measured,) = dist_run(_saved_activation_bytes, 1, seq)
    per_layer = layer_activation_bytes(seq, 1, spec.hidden_size, spec.num_attention_heads, 1,
                                       "none", bytes_per=4, flash=False)
    estimate = per_layer * spec.num_layers + seq * spec.padded_vocab_size(1) * 4
    assert 0.5 <= measured / estimate <= 2.0, (measured, estimate)


def test_plan_and_submit_check_the_sglang_fleet_against_the_job(capsys, tmp_path):
    """num_engines servers per data-parallel replica must fit the replica's GPUs: a one-line
    error naming the keys, from `megapkl plan` and from `megapkl submit` (--force or not)."""
    cfg = "configs/experiments/pkl_periodic/qwen3_1p7b_pkl.yaml"
    inputs = job_inputs(tmp_path)  # what submit checks the job can read
    bad = ["rollout.sglang.num_engines=8", f"run_dir={tmp_path / 'r'}", *inputs]
    assert main(["plan", cfg, *inputs, "--profile", "h100"]) == 0
    assert "= 8 servers on 8 GPUs" in capsys.readouterr().out
    for argv in (["plan", cfg, *bad, "--profile", "h100"],
                 ["submit", cfg, *bad, "--profile", "h100", "--dry-run", "--force"]):
        assert main(argv) == 2  # a config error
        err = capsys.readouterr().err.strip()
        assert "rollout.sglang.num_engines x rollout.sglang.tp = 8 x 1" in err, err
        assert len(err.splitlines()) == 1, err


def test_dedicated_sglang_gpus_shape_the_job(tmp_path):
    """colocate false: the job asks for every GPU of its nodes and starts one task per trainer
    rank; each replica's servers take the GPUs the trainer leaves."""
    from megapkl.launch.submit import submit

    sub = submit("configs/experiments/tetpo/qwen3_1p7b_grpo.yaml", "h100",
                 ["rollout.sglang.colocate=false", f"run_dir={tmp_path / 'r'}",
                  *job_inputs(tmp_path)],
                 entry="megapkl.launch.toy:run", dry_run=True, force=True)
    assert "#SBATCH --gpus-per-node=8" in sub.script
    assert "#SBATCH --ntasks-per-node=4" in sub.script
    p = plan_config("configs/experiments/tetpo/qwen3_1p7b_grpo.yaml", "h100",
                    ["rollout.sglang.colocate=false", f"model.hf_checkpoint={tmp_path}"])
    assert "4 replicas x 1 servers" in p.servers and "on GPUs of their own" in p.servers


def test_a_sweep_of_dedicated_sglang_gpus_is_shaped_like_its_runs(tmp_path):
    """A sweep's array job gets the shape `submit` gives each of its runs: one task per trainer
    rank beside the servers' own GPUs; elements that need different shapes are refused."""
    from megapkl.config.typed import ConfigError
    from megapkl.launch.sweep import sweep

    from megapkl.launch.submit import submit

    cfg = "configs/experiments/tetpo/qwen3_1p7b_grpo.yaml"
    inputs = job_inputs(tmp_path)
    base = ["rollout.sglang.colocate=false", *inputs]
    sub = sweep(cfg, "h100", ["seed=0,1"], [*base, f"run_dir={tmp_path / 'a'}"],
                entry="megapkl.launch.toy:run", dry_run=True)
    assert "#SBATCH --gpus-per-node=8" in sub.script
    assert "#SBATCH --ntasks-per-node=4" in sub.script, sub.script

    def shape(script):
        return [ln for ln in script.splitlines()
                if ln.startswith(("#SBATCH --nodes", "#SBATCH --ntasks-per-node",
                                  "#SBATCH --gpus-per-node"))]

    # on 4 nodes (the 8B run: 16 trainer ranks beside 16 server GPUs), the submit's shape
    one = submit(PKL_8B, "h100", [*base, f"run_dir={tmp_path / 'c'}"],
                 entry="megapkl.launch.toy:run", dry_run=True, force=True)
    many = sweep(PKL_8B, "h100", ["seed=0,1"], [*base, f"run_dir={tmp_path / 'd'}"],
                 entry="megapkl.launch.toy:run", dry_run=True)
    assert shape(many.script) == shape(one.script) == [
        "#SBATCH --gpus-per-node=8", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=4"], \
        shape(many.script)
    with pytest.raises(ConfigError, match="different tasks per node") as info:
        sweep(cfg, "h100", ["rollout.sglang.colocate=false,true"],
              [*inputs, f"run_dir={tmp_path / 'b'}"],
              entry="megapkl.launch.toy:run", dry_run=True)
    assert info.value.key == "--grid"


def test_plan_counts_colocated_servers_while_training_unless_megapkl_releases_them(tmp_path):
    """Launched colocated servers run with SGLang's memory saver and hand their memory back while
    the trainer trains; servers megapkl only connects to (urls) keep it."""
    from megapkl.launch.profile import load_profile

    cfg = "configs/experiments/pkl_periodic/qwen3_1p7b_pkl.yaml"
    launched = plan_config(cfg, "h100", [f"model.hf_checkpoint={tmp_path}"])
    named = plan(load_config(cfg, ['rollout.sglang.urls=["http://127.0.0.1:30000"]',
                                   "slurm.gpus_per_node=8", "slurm.nodes=1"]),
                 load_profile("h100"))
    engines = 0.8 * (load_profile("h100").gpu_mem_gib - CONTEXT_GIB)  # started before the trainer
    assert not any("not released" in name for name, _ in launched.rows)
    assert ("colocated SGLang servers (memory not released)", engines) in named.rows
    assert abs(named.train_gib - launched.train_gib - engines) < 1e-6


@pytest.mark.parametrize("colocate", [True, False])
def test_plan_takes_mem_fraction_static_of_the_memory_free_at_the_servers_start(tmp_path,
                                                                                colocate):
    """SGLang sizes its weights + KV cache as mem_fraction_static of the GPU memory free when the
    server starts (pre_model_load_memory). A colocated server megapkl launches starts beside the
    built trainer (parameters, gradients, the optimizer's main copy; Adam's moments come at its
    first step), a dedicated one on a GPU of its own; each process has its CUDA context. Before:
    mem_fraction_static of the whole GPU, whatever the trainer held."""
    from megapkl.launch.plan import memory_rows
    from megapkl.launch.profile import load_profile
    from megapkl.models.spec import spec_from_model_config

    cfg = load_config(PKL_1P7B, [f"model.hf_checkpoint={tmp_path}", "slurm.gpus_per_node=8",
                                 "slurm.nodes=1", f"rollout.sglang.colocate={str(colocate).lower()}",
                                 "rollout.sglang.mem_fraction_static=0.85"])
    gpu = load_profile("h100").gpu_mem_gib
    got = plan(cfg, load_profile("h100"))
    _, resident, moments = memory_rows(cfg, spec_from_model_config(cfg.model),
                                       got.layout)
    held = resident - moments + CONTEXT_GIB if colocate else 0.0
    free = gpu - held - CONTEXT_GIB
    assert abs(got.engine_free_gib - free) < 1e-9 and abs(got.engine_gib - 0.85 * free) < 1e-9
    assert got.engine_gib < 0.85 * gpu
    if colocate:  # while generating: the trainer's resident state beside the server's share
        assert abs(got.rollout_gib - (resident + 0.85 * free)) < 1e-9
    assert f"of the {free:.1f} GiB free at its start" in got.table()


# ---- time per update: generation, training, synchronous and asynchronous

PKL_1P7B = "configs/experiments/pkl_periodic/qwen3_1p7b_pkl.yaml"
PKL_8B = "configs/experiments/pkl_periodic/qwen3_8b_pkl.yaml"
PKL_32B = "configs/experiments/pkl_periodic/qwen3_32b_pkl.yaml"
BATCH_TOKENS = 32 * 8 * 16384  # prompts x responses x max_response_len of the PKL runs


def test_shipped_gpu_profiles_state_a_decode_throughput():
    from megapkl.launch.profile import load_profile

    assert load_profile("h100").gpu_decode_tokens_per_s == 1500.0
    assert load_profile("h200").gpu_decode_tokens_per_s == 2100.0
    assert load_profile("local_cpu").gpu_decode_tokens_per_s is None


def _schedule(protocol, **kw):
    from megapkl.train.schedule import Schedule

    return Schedule(protocol=protocol, groups_per_batch=32, **kw)


@pytest.mark.parametrize("protocol,kw,gen,train,expect", [
    # on-policy: every batch waits for the version its update makes
    ("on_policy", {}, 3.0, 2.0, 5.0),
    # periodic refresh N = 4: the first batch of a period waits (G + T), the N - 1 others overlap
    ("periodic_refresh", {"refresh_every": 4}, 3.0, 2.0, (5.0 + 3 * 3.0) / 4),
    ("periodic_refresh", {"refresh_every": 4}, 2.0, 3.0, (5.0 + 3 * 3.0) / 4),
    ("periodic_refresh", {"refresh_every": 64}, 3.0, 2.0, (5.0 + 63 * 3.0) / 64),
    # controlled staleness k = 4: every batch overlaps the previous one's training
    ("controlled_staleness", {"max_staleness": 4}, 3.0, 2.0, 3.0),
    ("controlled_staleness", {"max_staleness": 4}, 1.0, 2.0, 2.0),
    # k = 1 with 4 minibatches of T = 1: batch b + 1 (version u - 1) can start only at the last
    # update of batch b, so 3 of its 4 s of generation overlap 1 s of training: 4 T + 2 per batch
    ("controlled_staleness", {"max_staleness": 1, "minibatches": 4}, 3.0, 1.0, 6.0 / 4),
    ("uniform_stale", {"max_staleness": 32}, 3.0, 2.0, 3.0),
])
def test_overlapped_update_time_follows_the_schedule(protocol, kw, gen, train, expect):
    from megapkl.launch.plan import overlapped_update_s

    mean, ahead, window = overlapped_update_s(_schedule(protocol, **kw), gen, train)
    assert mean == pytest.approx(expect)
    if protocol == "periodic_refresh":
        assert (ahead, window) == (kw["refresh_every"] - 1, kw["refresh_every"])
    else:
        assert ahead == (0 if protocol == "on_policy" else window)


def test_plan_times_the_1p7b_pkl_run_colocated_and_on_gpus_of_its_own(tmp_path):
    """Colocated (the paper config): no overlap. Servers on GPUs of their own: 63 of every 64
    batches of periodic refresh are generated while the previous one trains."""
    import dataclasses

    weights = f"model.hf_checkpoint={tmp_path}"
    p = plan_config(PKL_1P7B, "h100", [weights])
    t = p.times
    gen = BATCH_TOKENS / (8 * 1500.0)  # 8 colocated server GPUs (4 replicas x 2 servers x tp 1)
    assert (t.tokens, t.gen_gpus) == (BATCH_TOKENS, 8) and t.response_len_is_max
    assert t.generate_s == pytest.approx(gen) and t.train_s == p.step_s
    assert t.sync_s == pytest.approx(gen + p.step_s) and t.async_s == t.sync_s
    assert "colocate: true" in t.why_not
    assert "max_response_len, an upper bound" in p.table()
    assert dataclasses.asdict(p)["times"]["sync_s"] == t.sync_s

    own = plan_config(PKL_1P7B, "h100", [weights, "rollout.sglang.colocate=false",
                                         "rollout.async_batches=2"])
    t = own.times
    gen, train = BATCH_TOKENS / (4 * 1500.0), own.step_s  # 4 trainer GPUs, 4 server GPUs
    assert t.gen_gpus == 4 and t.generate_s == pytest.approx(gen)
    assert t.async_s == pytest.approx(((gen + train) + 63 * max(gen, train)) / 64)
    assert t.ahead == (63, 64) and t.async_batches == 2
    assert "rollout.async_batches: 2; 63 of 64 batches generated ahead" in own.table()

    half = plan_config(PKL_1P7B, "h200", [weights, "rollout.sglang.colocate=false"],
                       response_len=8192)
    assert half.times.generate_s == pytest.approx(BATCH_TOKENS / 2 / (4 * 2100.0))
    assert "if rollout.async_batches were > 0" in half.table()
    assert "8192 tokens (mean, given)" in half.table()


def test_plan_times_the_8b_pkl_run_at_periodic_refresh(tmp_path):
    weights = f"model.hf_checkpoint={tmp_path}"
    t = plan_config(PKL_8B, "h100", [weights]).times
    assert t.gen_gpus == 32 and t.generate_s == pytest.approx(BATCH_TOKENS / (32 * 1500.0))
    own = plan_config(PKL_8B, "h100", [weights, "rollout.sglang.colocate=false"])
    # 16 trainer GPUs; 2 replicas x 4 servers x tp 2 = 16 server GPUs
    t, gen = own.times, BATCH_TOKENS / (16 * 1500.0)
    assert t.gen_gpus == 16 and t.generate_s == pytest.approx(gen)
    assert t.sync_s == pytest.approx(gen + own.step_s)
    assert t.async_s == pytest.approx(((gen + own.step_s) + 63 * max(gen, own.step_s)) / 64)


def test_plan_times_generation_on_the_gpus_placement_gives_the_32b_servers(tmp_path):
    """The 32B runs' 16 servers of 4 GPUs hold all 64 GPUs of the job, spread over each replica's
    4 nodes; kept on each leader's node (every_node false, 2 servers a replica) they hold 16."""
    weights = f"model.hf_checkpoint={tmp_path}"
    p = plan_config(PKL_32B, "h100", [weights])
    assert p.times.gen_gpus == 64
    assert p.times.generate_s == pytest.approx(BATCH_TOKENS / (64 * 1500.0))
    table = p.table()
    assert "fleets on 4 node(s) per replica, 2 server(s) on each; 64 of the 64 training GPUs " \
           "generate\n" in table, table
    assert "tokens on 64 server GPUs" in table
    old = plan_config(PKL_32B, "h100", [weights, "rollout.sglang.every_node=false",
                                        "rollout.sglang.num_engines=2"])
    assert old.times.gen_gpus == 16
    assert old.times.generate_s == pytest.approx(4 * p.times.generate_s)
    assert old.times.sync_s - p.times.sync_s == pytest.approx(3 * p.times.generate_s)
    assert "16 of the 64 training GPUs generate (48 idle: rollout.sglang.every_node false" \
        in old.table()


def test_plan_on_policy_gains_nothing_from_generation_ahead(tmp_path):
    p = plan_config(PKL_1P7B, "h100", [f"model.hf_checkpoint={tmp_path}",
                                       "rollout.sglang.colocate=false",
                                       "rollout.protocol=on_policy", "rollout.refresh_every=null"])
    assert p.times.async_s == pytest.approx(p.times.sync_s) and p.times.ahead[0] == 0
    assert "on_policy waits for each batch's version" in p.table()


# ---- the search agent's retriever

AGENT_8B = "configs/experiments/sis_agent/qwen3_8b_grpo_sis.yaml"


def _profile_with_retriever(tmp_path, **placement):
    import yaml

    data = yaml.safe_load((configs_dir().parent / "slurm" / "profiles" / "h100.yaml").read_text())
    data["retriever"] = placement
    path = tmp_path / f"h100_{placement['mem']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_plan_sizes_the_retriever_and_says_where_it_runs(tmp_path, monkeypatch):
    """The flat E5 index of wiki-18 (not built: Search-R1's 21,015,324 x 768 float32) in host
    memory beside rank 0, or in the profile's step, whose memory and GPUs it must fit; a built
    index is sized from its manifest and files."""
    from megapkl.retriever.index import build_index

    ckpt = [f"model.hf_checkpoint={tmp_path}"]
    beside = plan_config(AGENT_8B, "h100", ckpt)
    r = beside.retriever
    assert (r.backend, r.rows, r.gpus) == ("flat", 21_015_324, 0)
    assert 64.5e9 < r.host_bytes < 65.5e9  # 64.6 GB of vectors, offsets, the encoder
    assert "beside rank 0" in beside.table() and "faiss-gpu build shards" in beside.table()
    step = plan_config(AGENT_8B, _profile_with_retriever(tmp_path, node=-1, gpus=8, mem="80G"),
                       ckpt)
    assert step.fits and "its own Slurm step on node 1 of the allocation" in step.table()
    shard = 21_015_324 * 768 * 2 / 8 / 2 ** 30  # float16, sharded over the step's 8 GPUs
    assert step.retriever.gpu_gib == pytest.approx(shard)
    assert step.retriever.gpu_load_gib == pytest.approx(step.rollout_gib + shard)
    small = plan_config(AGENT_8B, _profile_with_retriever(tmp_path, node=0, gpus=0, mem="48G"),
                        ckpt)
    assert not small.fits and "of the step's 48 GiB (retriever.mem) -> DOES NOT FIT" in small.table()
    # a built BM25 index: its rows and its files
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"id": "{i}", "contents": "\\"T{i}\\"\\nword{i} text"}}\n'
                              for i in range(50)))
    build_index(str(corpus), str(tmp_path / "ix"))
    monkeypatch.chdir(tmp_path)
    bm25 = plan_config(str(configs_dir().parent / AGENT_8B), "h100",
                       [*ckpt, f"env.search.index={tmp_path / 'ix'}"]).retriever
    assert (bm25.backend, bm25.rows) == ("bm25", 50) and "memory-mapped" in "\n".join(bm25.lines())
