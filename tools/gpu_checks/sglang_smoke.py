"""GPU check of the SGLang rollout path: a real SGLang server driven by megapkl's SGLangEngine.

NOT YET RUN BY THE PROJECT: SGLang needs CUDA and a networked install that the project's test
machines do not have. It is prepared for users with both.

SGLang 0.5.23 and sglang-router installed (`pip install -e .[gpu]`). Given a small local HF
checkpoint (e.g. Qwen3-0.6B), it
1. launches `python -m sglang.launch_server` through megapkl's launcher (log in --out). With two
   or more GPUs the server gets GPU 1 of its own (`colocate: false`, `--base-gpu-id 1`) while this
   process trains on GPU 0: NCCL refuses two ranks of one group on one GPU, so the distributed
   sync needs that. With one GPU the server is colocated on GPU 0 (memory saver on: its memory is
   released after each generation and resumed before the next push) and the distributed mode is
   skipped, said so in its JSON line;
2. generates with log-probs and top-K (K = 8) for a few prompts;
3. pushes the checkpoint's own weights, perturbed by a known amount, in each weight-sync mode
   (tensor, distributed over NCCL, disk) and checks the server's reported version and that the
   greedy log-probs changed the same way in every mode;
4. recomputes the behaviour log-probs of the generated responses with transformers (fp32, same
   temperature) and prints the max |difference| and the top-K overlap.
It prints one JSON line per step. Expected: versions as pushed; the three modes agree to ~1e-3 in
log-probs (BF16 server); engine vs recomputed log-probs within ~5e-2 (BF16 kernels).

    python tools/gpu_checks/sglang_smoke.py --model /path/to/Qwen3-0.6B --out /tmp/sglang_smoke
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def config(args, dedicated: bool) -> SimpleNamespace:
    """The few run-config fields the engine context and build_sglang_engine read, with the
    defaults of rollout.sglang."""
    from megapkl.config.sections import SGLangConfig

    sg = SGLangConfig(use_router=False, mem_fraction_static=0.5, health_first_wait_s=10.0,
                      health_interval_s=5.0, startup_timeout_s=900.0, base_port=args.port,
                      colocate=not dedicated)
    rollout = SimpleNamespace(sglang=sg, fp8=False, kv_cache_dtype="auto")
    model = SimpleNamespace(hf_checkpoint=args.model, tokenizer=None, dtype="bf16",
                            routing_replay=False)
    parallel = SimpleNamespace(tensor=1, context=1, pipeline=1, data=1, expert=1,
                               sequence_parallel=False)
    env = SimpleNamespace(multi_turn=False)  # single-turn: no stop strings, no tokenizer served
    return SimpleNamespace(rollout=rollout, model=model, parallel=parallel, env=env,
                           run_dir=args.out, name="sglang_smoke", seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local HF checkpoint directory")
    ap.add_argument("--out", default="/tmp/sglang_smoke")
    ap.add_argument("--port", type=int, default=31000)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megapkl.rollout.embedded import iter_safetensors
    from megapkl.rollout.engine import SamplingParams
    from megapkl.rollout.sample import PromptItem
    from megapkl.config.layout import Layout
    from megapkl.rollout.factory import engine_context
    from megapkl.rollout.sglang.build import build_sglang_engine

    hf_config = json.loads((Path(args.model) / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(args.model)
    dedicated = torch.cuda.device_count() >= 2
    torch.cuda.set_device(0)
    cfg = config(args, dedicated)
    ctx = engine_context(cfg.model, hf_config, work_dir=cfg.run_dir, seed=cfg.seed,
                         layout=Layout.of(cfg.parallel, world=1))
    engine = build_sglang_engine(cfg.rollout, ctx, tokenizer=tok)
    print(json.dumps({"step": "launched", "command": engine.fleet.workers[0].spec.cmd}),
          flush=True)
    weights = [(n, t.to("cuda:0")) for n, t in iter_safetensors(args.model)]
    prompts = [PromptItem(tok(p, return_tensors="pt").input_ids[0], text=p)
               for p in ("1 + 1 =", "The capital of France is", "def fib(n):")]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, topk_logprobs=8)
    results = {}
    try:
        for v, mode in enumerate(("tensor", "distributed", "disk"), start=1):
            if mode == "distributed" and not dedicated:
                print(json.dumps({"step": "sync_distributed", "skipped": "needs a second GPU "
                                  "for the server (NCCL: one rank per GPU in a group)"}),
                      flush=True)
                continue
            engine.sync.s.mode = mode
            scale = 1.0 + 0.01 * (v % 2)  # versions 1 and 3 perturbed alike, 2 not
            engine.update_weights([(n, t * scale) for n, t in weights], version=v)
            samples = engine.generate(prompts, n=1, sampling=greedy)
            results[mode] = samples
            print(json.dumps({"step": f"sync_{mode}", "reported_versions":
                              sorted({s.version for s in samples}), "expected": v}), flush=True)
        a, c = results["tensor"], results["disk"]
        same = all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, c))
        print(json.dumps({"step": "modes_agree", "tensor_vs_disk_same_tokens": same}), flush=True)

        engine.update_weights(weights, version=10)
        sampling = SamplingParams(max_new_tokens=32, temperature=1.0, topk_logprobs=8)
        samples = engine.generate(prompts, n=2, sampling=sampling)
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).cuda()
        worst, overlap = 0.0, []
        for s in samples:
            seq = s.sequence[:-1][None].cuda()
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0, s.prompt_len - 1:].float()
            logp = torch.log_softmax(logits / s.temperature, -1).cpu()
            worst = max(worst, float((logp.gather(1, s.response_ids[:, None])[:, 0]
                                      - s.logp_behav).abs().max()))
            top = logp.topk(8, -1).indices
            overlap.append(float((top[:, :, None] == s.topk_ids[:, None, :]).any(-1)
                                 .float().mean()))
        print(json.dumps({"step": "recompute", "max_abs_logp_diff": worst,
                          "topk_overlap": sum(overlap) / len(overlap)}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
