"""Tiny twins of the papers' checkpoints: a random Hugging Face checkpoint of
configs/models/tiny-qwen3.yaml (dense) or tiny-qwen3-moe.yaml (MoE) with a tokenizer, written
without the Hub, so that a run config's code paths can be followed on a CPU (`megapkl smoke`).

    write_twin(path, moe=False)   config.json + model.safetensors + tokenizer files in `path`

The weights are drawn from the spec's own shapes (`hf_mapping.expected_hf_shapes`) and saved with
the config.json an exported checkpoint carries (`spec.hf_config_dict`): what megapkl, `megapkl
serve` and transformers load. Norm weights are drawn around 1 rather than set to 1, so that a
swapped or missing norm changes the logits.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

TINY_DENSE, TINY_MOE = "tiny-qwen3", "tiny-qwen3-moe"
# Token ids of the tokenizer below (its special tokens come first).
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def twin_name(moe: bool) -> str:
    """The megapkl model name (configs/models/<name>.yaml) of the tiny twin of a family."""
    return TINY_MOE if moe else TINY_DENSE


def write_tokenizer(path: Union[str, Path]) -> None:
    """A character-level Hugging Face tokenizer (99 ids, within the tiny models' 128) with Qwen's
    ChatML special tokens and chat template: the math prompts of the papers' data go through
    `data.prompt_template: qwen_math` exactly as with Qwen's own tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=" "))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[EOS_ID],
                            pad_token=SPECIALS[PAD_ID], chat_template=CHATML
                            ).save_pretrained(str(path))


def random_weights(spec, seed: int) -> dict:
    """Every tensor of a HF checkpoint of `spec`, fp32: N(0, init_method_std), norms N(1, 0.1)."""
    import torch

    from megapkl.models.hf_mapping import expected_hf_shapes

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_hf_shapes(spec).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = spec.init_method_std * torch.randn(shape, generator=gen)
    return out


def write_twin(path: Union[str, Path], moe: bool, seed: int = 3) -> Path:
    """The tiny dense or MoE model as a Hugging Face checkpoint directory with its tokenizer."""
    from safetensors.torch import save_file

    from megapkl.models.spec import hf_config_dict, load_spec

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = load_spec(twin_name(moe))
    config = {**hf_config_dict(spec, dtype="float32"), "eos_token_id": EOS_ID,
              "pad_token_id": PAD_ID, "bos_token_id": None}
    (path / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    save_file(random_weights(spec, seed), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(path)
    return path
