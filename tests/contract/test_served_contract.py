"""megapkl's check of servers it did not start (`rollout.sglang.urls`, served.py) against SGLang's
own answers: SGLang's FastAPI app answers /server_info and /model_info as a server started with the
argument list megapkl launches for one variant (parsed and resolved by SGLang's ServerArgs), and
the check compares them with the config of the same or another variant. Each variant's own
servers pass; a server started with other flags is refused in one line naming what differs."""
from __future__ import annotations

import pytest

from megapkl_side import launched, load_variant

# (the server: variant and overrides, the run: variant and overrides, what the refusal names)
CASES = {
    "default_fp8_colocated": (("default_fp8_colocated", ()), ("default_fp8_colocated", ()), None),
    "bf16_separate_gpus": (("bf16_separate_gpus", ()), ("bf16_separate_gpus", ()), None),
    "moe_r3_tp2_ep2": (("moe_r3_tp2_ep2", ()), ("moe_r3_tp2_ep2", ()), None),
    "moe_fp8_context": (("moe_fp8_context", ()), ("moe_fp8_context", ()), None),
    # SGLang's default KV dtype (auto: the model's) is the run's explicit bf16
    "kv_auto_is_bf16": (("bf16_separate_gpus", ()),
                        ("bf16_separate_gpus", ("rollout.kv_cache_dtype=bf16",)), None),
    "tp": (("moe_r3_tp2_ep2", ()),
           ("moe_r3_tp2_ep2", ("rollout.sglang.tp=1", "rollout.sglang.ep=1")),
           r"--tp-size 2, rollout.sglang.tp is 1 \(the weight-update group"),
    "kv_fp8": (("default_fp8_colocated", ("rollout.kv_cache_dtype=fp8_e4m3",)),
               ("default_fp8_colocated", ()),
               "--kv-cache-dtype fp8_e4m3, rollout.kv_cache_dtype is bf16"),
    "routed_experts": (("moe_fp8_context", ()), ("moe_fp8_context", ("model.routing_replay=true",)),
                       "no --enable-return-routed-experts, which model.routing_replay needs"),
    "context_length": (("moe_fp8_context", ()),
                       ("moe_fp8_context", ("rollout.sglang.context_length=512",)),
                       "--context-length 256, rollout.sglang.context_length is 512"),
    "model": (("moe_fp8_context", ()), ("bf16_separate_gpus", ()),
              r"model \['Qwen3MoeForCausalLM'\], the trainer's is \['Qwen3ForCausalLM'\]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_server_is_checked_against_the_run_config(sglang, case, tmp_path, monkeypatch):
    from megapkl.models.spec import hf_config_dict, load_spec
    from engine_contexts import context_of
    from megapkl.rollout.sglang.launch import ServerLaunchError
    from megapkl.rollout.sglang.served import check_served, expected

    (server, server_extra), (run, run_extra), refusal = CASES[case]
    argv = launched(server, tmp_path / "server", monkeypatch, server_extra).sglang_argv()
    url = sglang.call("start_front", argv)
    cfg = load_variant(run, tmp_path / "run", run_extra)
    ctx = context_of(cfg, hf_config_dict(load_spec(cfg.model.name), dtype="bfloat16"))
    want = expected(cfg.rollout, ctx)
    if refusal is None:
        check_served("rollout.sglang.urls[0]", url, want, timeout_s=60)
        return
    with pytest.raises(ServerLaunchError, match=refusal) as info:
        check_served("rollout.sglang.urls[0]", url, want, timeout_s=60)
    message = str(info.value)
    assert message.startswith(f"rollout.sglang.urls[0]: {url} was started with ") \
        and "\n" not in message, message


def test_a_server_drawing_from_the_seed_alone_is_recognised(sglang, tmp_path, monkeypatch):
    """A server started with --enable-deterministic-inference (rollout.sglang.extra_args) says so
    in SGLang's own /server_info: the engine then sends each response of a seeded group its own
    seed (docs/engines.md, "Seeds"); a server started without it does not."""
    from megapkl.models.spec import hf_config_dict, load_spec
    from engine_contexts import context_of
    from megapkl.rollout.sglang.served import DETERMINISTIC, check_served, draws_from_seed, expected

    cfg = load_variant("bf16_separate_gpus", tmp_path / "run")
    want = expected(cfg.rollout, context_of(cfg, hf_config_dict(load_spec(cfg.model.name),
                                                                dtype="bfloat16")))
    # (this CPU resolves SGLang's attention backend to intel_amx, which deterministic inference
    # refuses: name one it takes, as a GPU server would resolve)
    on = f'rollout.sglang.extra_args=["{DETERMINISTIC}", "--attention-backend", "triton"]'
    for extra, draws in (((on,), True), ((), False)):
        argv = launched("bf16_separate_gpus", tmp_path / f"server{draws}", monkeypatch,
                        extra).sglang_argv()
        assert (DETERMINISTIC in argv) is draws
        url = sglang.call("start_front", argv)
        assert draws_from_seed(check_served("rollout.sglang.urls[0]", url, want,
                                            timeout_s=60)) is draws
