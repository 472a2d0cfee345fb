"""Policies on megatron-core (Qwen3 dense / MoE, Llama 3.x): specs, providers, HF I/O, optimizer,
R3, checkpoints

    spec.py        families and architectures as data (configs/models/*.yaml), layouts (no torch)
    rope.py        RoPE frequencies as transformers computes them (default, llama3)
    provider.py    TransformerConfig + layer specs (TE on GPU, local on CPU) -> GPTModel
    hf_mapping.py  megatron <-> Hugging Face names, shards and fused layouts (pure)
    hf.py          load a HF checkpoint into the sharded model; streamed HF export
    optimizer.py   DDP + distributed Adam, clipping, LR schedule
    routing_probe  the routers' top-k of each forward (R3 replay lives in megapkl.parallel.replay)
    checkpoint.py  reshardable distributed checkpoints (model, optimizer, scheduler, RNG)
    snapshot.py    frozen weight copies swapped in for forward passes

Submodules are imported explicitly (`from megapkl.models.hf import load_hf_weights`) so that
importing the package stays free of torch and megatron.
"""

from megapkl.models.spec import (ModelSpec, SpecError, available_specs, check_layout, load_spec,
                                 spec_from_hf_config, spec_from_model_config)

__all__ = ["ModelSpec", "SpecError", "available_specs", "check_layout", "load_spec",
           "spec_from_hf_config", "spec_from_model_config"]
