"""GPU check for megapkl.models: Transformer Engine layer spec, BF16, HF logits, one Adam step.

One process, one GPU. For a tiny random Qwen3 (tied embeddings) and Qwen3-MoE (4 experts, top-2)
built with transformers' config classes (no downloads) it prints one JSON line per model:
- which layer spec ran (te / local) and the megatron parameter names it produced;
- max |logits| difference, megatron BF16 vs HF fp32 and vs HF BF16 (same tokens);
- whether the HF export of the BF16 model equals the BF16-rounded checkpoint exactly;
- one step of megatron DDP + distributed Adam (BF16 params, fp32 main weights) vs torch Adam on
  the fp32 HF model: pre-clip grad norms and the max parameter difference after the step.

Run (a device session; megatron-core is not in the GPU image: carry its wheel, and the
transformers the project pins, 5.x, whose Qwen3 / Qwen3-MoE names the checkpoints use):
    python tools/gpu_checks/models_te_bf16.py            # --no-te to check the local spec
Without `--no-te` this is a check of Transformer Engine's layer spec: when TE does not import (or
there is no GPU) it fails at once, exit status 1 and one JSON line naming the cause, instead of
checking the local spec under its name. The exit status is also 1 when a model's check raised.
Expected (measured with the local spec in BF16 on CPU, where the script also runs): logits within
~1e-2 of fp32 HF (HF's own BF16 differs from its fp32 by as much), export exact, grad norms within
1e-3 relative, parameters after the step within one BF16 ulp of the BF16-rounded reference.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LR = 1e-3


def hf_checkpoint(path: str, moe: bool):
    from transformers import (Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=512)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, tie_word_embeddings=False, router_aux_loss_coef=0.0))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(moe: bool, use_te, out: dict) -> None:
    from megapkl.models.hf import export_hf_weights, load_hf_weights
    from megapkl.models.optimizer import (OptimSettings, build_optimizer, finalize_grads,
                                          optimizer_step, wrap_ddp, zero_grads)
    from megapkl.models.provider import ModelOptions, build_model, te_available
    from megapkl.models.spec import load_spec

    name = "tiny-qwen3-moe" if moe else "tiny-qwen3"
    path = tempfile.mkdtemp()
    hf = hf_checkpoint(path, moe).cuda()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (4, 32), generator=gen).cuda()
    labels = torch.randint(0, 128, ids.shape, generator=gen).cuda()
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)

    opts = ModelOptions(dtype="bf16", use_te=use_te)
    model = build_model(load_spec(name), opts).cuda()
    out["spec"] = "te" if (use_te if use_te is not None else te_available()) else "local"
    out["megatron_params"] = [n for n, _ in model.named_parameters()][:12]
    load_hf_weights(model, path)

    with torch.no_grad():
        ref32 = hf(ids).logits.float()
        ref16 = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()
        got = model(ids, pos, None).float()
    out["logits_max_abs_vs_hf_fp32"] = (got - ref32).abs().max().item()
    out["logits_max_abs_vs_hf_bf16"] = (got - ref16).abs().max().item()
    out["hf_bf16_vs_fp32"] = (ref16 - ref32).abs().max().item()

    hf_bf16 = {n: p.detach().to(torch.bfloat16) for n, p in hf.named_parameters()}
    exported = dict(export_hf_weights(model))
    out["export_exact"] = all(torch.equal(exported[n].cpu(), hf_bf16[n].cpu()) for n in hf_bf16)

    # One step: megatron BF16 + fp32 main weights vs fp32 torch Adam on the HF model.
    settings = OptimSettings(lr=LR, clip_grad=1.0)
    ddp = wrap_ddp([model], settings)
    opt = build_optimizer(ddp, settings)
    zero_grads(ddp, opt)
    ddp[0](ids, pos, None, labels=labels).float().mean().backward()
    finalize_grads(ddp)
    t0 = time.time()
    stats = optimizer_step(opt)
    out["step_s"] = time.time() - t0
    logits = hf(ids).logits
    F.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0).item()
    torch.optim.Adam(hf.parameters(), lr=LR).step()
    out["grad_norm_megatron"], out["grad_norm_hf_fp32"] = stats.grad_norm, ref_norm
    after = dict(export_hf_weights(model))
    out["param_max_abs_after_step"] = max(
        (after[n].float() - p.detach().float()).abs().max().item()
        for n, p in hf.named_parameters())
    # BF16 params can only land on the BF16 grid: compare with the reference rounded to it.
    out["param_max_abs_after_step_vs_bf16_rounded_ref"] = max(
        (after[n].float() - p.detach().to(torch.bfloat16).float()).abs().max().item()
        for n, p in hf.named_parameters())
    out["param_step_size"] = LR


def te_missing() -> str | None:
    """Why Transformer Engine's layer spec cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from megapkl.models.provider import te_import_error

    return te_import_error()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-te", action="store_true", help="check megatron's local spec instead")
    args = parser.parse_args(argv)
    missing = None if args.no_te else te_missing()
    if missing is not None:
        print(json.dumps({"check": "transformer_engine", "ok": False, "error": (
            f"Transformer Engine cannot run here ({missing}): this checks TE's layer spec; "
            "install it (docs/install.md) or pass --no-te to check the local spec")}), flush=True)
        return 1
    from megapkl.parallel.groups import init_parallel

    init_parallel(seed=1, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    results = []
    for moe in (False, True):
        out = {"model": "tiny-qwen3-moe" if moe else "tiny-qwen3",
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        try:
            check(moe, False if args.no_te else True, out)  # TE requested: no silent fallback
        except Exception as exc:  # noqa: BLE001 - report and go on to the next model
            out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out), flush=True)
        results.append(out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "models_te_bf16.json").write_text(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
