"""SGLang protocol end to end for R3 and FP8, against real `megapkl serve` processes.

R3: a tiny-Qwen3-MoE worker started with --enable-return-routed-experts generates for the real
trainer (`rollout.engine: sglang`, the real sglang-router configured in front: R3 requests must
bypass it, it drops `return_routed_experts`); the routed experts come back base64 on the wire, the
client maps their rows onto the trainer's replay positions, and the megatron-core learner replaying
them reproduces the engine's log-probs (measured max |diff| 4.8e-7 in fp32; rows shifted by one
position in the client: 0.12). Same fp32 weights route alike, so without replay the log-probs agree
too; replaying other experts moves them by up to ~0.15, which shows the replay is in effect.

FP8: a worker started with --quantization fp8 and the client with rollout.fp8's transform: every
sync mode sends block-FP8 buckets, the worker holds what write_fp8_checkpoint writes, and a
mismatched FP8 tensor is refused naming the weight.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sglang_fixtures import launch_cluster, make_serve_cluster  # noqa: F401

from megapkl.rollout.sample import PromptItem

MOE = ["model.name=tiny-qwen3-moe", "model.routing_replay=true", "parallel.data=1",
       "logging.tensorboard=false", "logging.progress_bar=false", "rollout.prompts_per_batch=4",
       "rollout.responses_per_prompt=4", "rollout.max_response_len=6", "parallel.micro_batch_size=8",
       "rollout.temperature=0.8", "checkpoint.every=0"]
EXPERT_GAIN = 8.0


# ---------------------------------------------------------------------------------------- R3

def r3_worker(rank, world, cfg):
    """Runs in a forked gloo rank: one batch from the SGLang engine, then the learner's log-probs
    of it replaying the wire's experts, routing on its own, and replaying wrong experts."""
    from megapkl.parallel.chunks import model_chunks
    from megapkl.rollout.sglang.client import SGLangEngine
    from megapkl.train.loop import Trainer
    from megapkl.train.run_context import RunContext

    t = Trainer(cfg, RunContext().__enter__())  # open for the rank's life
    assert isinstance(t.slot.engine, SGLangEngine)
    with torch.no_grad():  # louder experts (the random init's are faint): routing shows in logp
        for chunk in model_chunks(t.learner.model):
            for name, p in chunk.named_parameters():
                if "mlp.experts" in name and "linear_fc2" in name:
                    p.mul_(EXPERT_GAIN)
    t.keep_weights(t.schedule.plan(0))  # the engine gets the trainer's weights, gain included
    samples = t.rollouts.collect(0, [0] * cfg.rollout.prompts_per_batch)
    assert samples and all(s.version == 0 and s.routed_experts is not None for s in samples)
    shapes = {tuple(s.routed_experts.shape[1:]) for s in samples}
    rows_ok = all(s.routed_experts.shape[0] == s.prompt_len + s.response_len - 1 for s in samples)
    learner = t.learner
    experts = learner.spec.num_experts

    def logprobs(batch):
        out = learner.logprobs(learner.pack(batch))
        return torch.cat([(out[s.uid] - s.logp_behav).abs() for s in samples])

    replayed = logprobs(samples)
    natural = logprobs([dataclasses.replace(s, routed_experts=None) for s in samples])
    wrong = logprobs([dataclasses.replace(s, routed_experts=(s.routed_experts + 1) % experts)
                      for s in samples])
    return dict(shapes=shapes, rows_ok=rows_ok, tokens=int(replayed.numel()),
                replayed=float(replayed.max()), natural=float(natural.max()),
                natural_tokens=int((natural > 1e-4).sum()), wrong=float(wrong.max()),
                wrong_tokens=int((wrong > 1e-2).sum()))


def test_routed_experts_over_the_wire_replay_engine_logprobs(make_serve_cluster, dist_run,
                                                             tmp_path):
    from megapkl.config import load_config

    cluster = make_serve_cluster(num_workers=1, model_config="tiny-qwen3-moe",
                                 worker_args=["--enable-return-routed-experts"])
    cfg = load_config("configs/demo/cpu_demo.yaml", [
        *MOE, f"run_dir={tmp_path / 'r3'}", "rollout.engine=sglang",
        f"rollout.sglang.urls={json.dumps(cluster.worker_urls)}",
        f"rollout.sglang.router_url={cluster.router_url}"])
    got = dist_run(r3_worker, 1, cfg, timeout=300)[0]
    print(f"R3 over the wire: {got}")
    assert got["shapes"] == {(2, 2)} and got["rows_ok"]  # 2 MoE layers x top-2, P + R - 1 rows
    assert got["tokens"] >= 16
    assert got["replayed"] < 1e-4, f"replayed log-probs differ from the engine's by {got}"
    # Replay is in effect: other experts move the log-probs far beyond the tolerance.
    assert got["wrong"] > 1e-2 and got["wrong_tokens"] > got["tokens"] // 4, got


# ---------------------------------------------------------------------------------------- FP8

# tiny-qwen3 with sides that are not multiples of 128: weights of 1 x 2 up to 3 x 2 FP8 blocks.
WIDE = {"hidden_size": 160, "ffn_hidden_size": 288}


def _wide_spec(tmp_path) -> str:
    import yaml

    base = yaml.safe_load(open("configs/models/tiny-qwen3.yaml"))
    path = tmp_path / "tiny-qwen3-wide.yaml"
    path.write_text(yaml.safe_dump({**base, **WIDE}))
    return str(path)


def _hf(spec_path):
    from megapkl.models.spec import hf_config_dict, load_spec

    return hf_config_dict(load_spec(spec_path), dtype="float32")


def _plain_weights(hf, seed):
    """Random plain weights under the engine's names (what the trainer's export yields)."""
    from megapkl.rollout.embedded import EmbeddedEngine

    g = torch.Generator().manual_seed(seed)
    shapes = {n: p.shape for n, p in EmbeddedEngine(hf).model.state_dict().items()}
    out = {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}
    if hf.get("tie_word_embeddings") and "lm_head.weight" in out:  # one tensor, two names
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return list(out.items())


def _edge_after_first_fp8(stream) -> int:
    """A bucket size that ends a plain bucketing right after the stream's first FP8 weight."""
    from megapkl.models.hf import bucketed

    size = 0
    for name, t in stream:
        size += t.numel() * t.element_size()
        if t.dtype == torch.float8_e4m3fn:
            break
    assert any(b[-1][1].dtype == torch.float8_e4m3fn for b in bucketed(stream, size))
    return size


def _held(url, name):
    from megapkl.rollout.sglang import http

    return torch.tensor(http.request(url, "/get_weights_by_name",
                                     {"name": name, "truncate_size": 1 << 20}, timeout=30))


def _checkpoint(tmp_path, weights, hf):
    from safetensors.torch import load_file

    from megapkl.rollout import fp8 as F

    ckpt = F.write_fp8_checkpoint(tmp_path / "ckpt", weights, hf)
    return {n: t for f in sorted(ckpt.glob("*.safetensors")) for n, t in load_file(f).items()}


@pytest.fixture(scope="module")
def fp8_setup(tmp_path_factory):
    """An FP8 `megapkl serve` worker (--quantization fp8) and an SGLangEngine with rollout.fp8,
    shared by the FP8 tests of this module."""
    from megapkl.config import load_config
    from engine_contexts import context_of
    from megapkl.rollout.sglang.build import build_sglang_engine

    tmp = tmp_path_factory.mktemp("fp8")
    spec = _wide_spec(tmp)
    cluster = launch_cluster(tmp / "cluster", num_workers=1, model_config=spec, router=False,
                             worker_args=["--quantization", "fp8"])
    try:
        cfg = load_config("configs/demo/cpu_demo.yaml", [
            "rollout.engine=sglang", "rollout.fp8=true", f"run_dir={tmp / 'run'}",
            f"rollout.sglang.urls={json.dumps(cluster.worker_urls)}",
            "rollout.sglang.bucket_mb=0.1"])  # several buckets per sync
        from megapkl.rollout.fp8 import sync_transform

        # plain BF16 pushes to an FP8 server: quantized by the sync (the trainer's versions are
        # stored quantized already, and pushed as they are)
        engine = build_sglang_engine(cfg.rollout, context_of(cfg, _hf(spec)),
                                     transform=sync_transform())
        yield engine, cluster.worker_urls[0], _hf(spec)
        engine.close()
    finally:
        cluster.close()


def test_fp8_sync_modes_send_block_fp8_and_worker_holds_the_checkpoint(fp8_setup, tmp_path):
    from megapkl.rollout import fp8 as F
    from megapkl.rollout.embedded import EmbeddedEngine
    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.sglang import http
    from megapkl.rollout.sglang.protocol import decode_response, generate_payload

    engine, url, hf = fp8_setup
    sent: list[list[tuple[str, torch.Tensor]]] = []
    transform = engine.sync.transform

    def recording(bucket):  # the buckets exactly as they go on the wire
        sent.append(list(transform(bucket)))
        return iter(sent[-1])  # lazily, as FP8Transform yields: every mode must take that

    engine.sync.transform = recording
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompt = [5, 9, 17, 33]
    for version, mode in enumerate(["tensor", "distributed", "disk"], start=1):
        weights = _plain_weights(hf, version)
        want = _checkpoint(tmp_path / mode, weights, hf)
        # distributed: an already-quantized stream, as the trainer's version store hands it over
        stream = list(F.FP8Transform()(weights)) if mode == "distributed" else weights
        if mode == "distributed":  # a bucket edge right between a weight and its scale
            engine.sync.s.bucket_bytes = _edge_after_first_fp8(stream)
        sent.clear()
        engine.sync.s.mode = mode
        engine.update_weights(stream, version=version)
        # On the wire: block-FP8 buckets, each weight with its scale, nothing else for a linear.
        assert len(sent) > 2, mode
        for bucket in sent:
            names = {n for n, _ in bucket}
            for name, t in bucket:
                if name.endswith(F.SCALE_SUFFIX) or F.quantized_name(name, tuple(t.shape)):
                    base = name.removesuffix(F.SCALE_SUFFIX)
                    assert {base, base + F.SCALE_SUFFIX} <= names, (mode, name)
                    assert t.dtype == (torch.float32 if name != base else torch.float8_e4m3fn)
                    assert torch.equal(t.view(torch.uint8) if name == base else t,
                                       want[name].view(torch.uint8) if name == base
                                       else want[name]), (mode, name)
        assert sorted(n for b in sent for n, _ in b) == sorted(want), mode
        # Held by the worker: the checkpoint's FP8 weights dequantized, bit for bit.
        assert http.request(url, "model_info", timeout=10)["weight_version"] == str(version)
        for name, _ in weights:
            expect = want[name]
            if expect.dtype == torch.float8_e4m3fn:
                expect = F.dequantize_block_fp8(expect, want[name + F.SCALE_SUFFIX],
                                                torch.float32, name=name)
            assert torch.equal(_held(url, name), expect), (mode, name)
        # ... and it generates exactly as an FP8 engine loaded from that checkpoint.
        ref = EmbeddedEngine.from_pretrained(tmp_path / mode / "ckpt")
        assert ref.fp8
        expect = ref.generate([PromptItem(torch.tensor(prompt))], 1, greedy)[0]
        d = decode_response(http.request(url, "generate", generate_payload(prompt, greedy, 1),
                                         timeout=60), prompt_len=len(prompt), sampling=greedy)
        assert torch.equal(d.response_ids, expect.response_ids)
        assert torch.equal(d.logp, expect.logp_behav), mode


def test_fp8_worker_refuses_mismatched_fp8_tensors(fp8_setup):
    from megapkl.rollout import fp8 as F
    from megapkl.rollout.engine import WeightUpdateError
    from megapkl.rollout.sglang import http
    from megapkl.rollout.sglang.weights import SyncSettings, Target, WeightSync

    engine, url, hf = fp8_setup
    weights = _plain_weights(hf, 7)
    engine.update_weights(weights, version=7)
    raw = WeightSync(SyncSettings(mode="tensor", timeout_s=30))  # no FP8 transform: as given
    name = "model.layers.1.mlp.down_proj.weight"
    w = dict(weights)[name]
    q, s = F.quantize_block_fp8(w)
    assert list(s.shape) == [2, 3]
    cases = {
        "wrong scale shape": ([(name, q), (name + "_scale_inv", s[:, :2].contiguous())],
                              r"weight 'model.layers.1.mlp.down_proj.weight_scale_inv': expected "
                              r"float32 \[2, 3\]"),
        "BF16 where FP8 is expected": ([(name, w.bfloat16())],
                                       r"weight 'model.layers.1.mlp.down_proj.weight': this server "
                                       r"runs block FP8 and expects float8_e4m3fn"),
        "FP8 for a kept weight": ([("model.embed_tokens.weight",
                                    dict(weights)["model.embed_tokens.weight"].to(
                                        torch.float8_e4m3fn))],
                                  r"weight 'model.embed_tokens.weight': float8_e4m3fn for a weight"),
        "scale of the wrong dtype": ([(name, q), (name + "_scale_inv", s.bfloat16())],
                                     r"_scale_inv': expected float32 \[2, 3\].*bfloat16"),
    }
    for case, (bad, message) in cases.items():
        with pytest.raises(WeightUpdateError, match=message):
            raw.push([Target(url)], bad, version=8)
    assert http.request(url, "model_info", timeout=10)["weight_version"] == "7"
    assert torch.equal(_held(url, name), F.dequantize_block_fp8(q, s, torch.float32))
