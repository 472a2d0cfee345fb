"""Tiny twins of the papers' checkpoints: a random Hugging Face checkpoint of a family's tiny
model (configs/models/tiny-qwen3.yaml, tiny-qwen3-moe.yaml, tiny-llama.yaml: `Family.tiny_twin`)
with a tokenizer, written without the Hub, so that a run config's code paths can be followed on a
CPU (`megapkl smoke`).

    write_twin(path, "tiny-llama")   config.json + model.safetensors + tokenizer files in `path`

The weights are drawn from the spec's own shapes (`hf_mapping.expected_hf_shapes`) and saved with
the config.json an exported checkpoint carries (`spec.hf_config_dict`): what megapkl, `megapkl
serve` and transformers load. Norm weights are drawn around 1 rather than set to 1, so that a
swapped or missing norm changes the logits.

The tokenizers are character-level, with the special tokens and chat format of the family: Qwen's
ChatML, or Llama 3.x's header tokens, `<|eot_id|>` turns, a BOS the template writes, a system
header stamped with a date, three stop tokens and no pad token.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Optional, Union

# Token ids of the Qwen tokenizer below (its special tokens come first).
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The Llama twin's special tokens, and its ids of Llama 3.x's 128000 (BOS), 128001, 128008,
# 128009 (the Instruct model's stop ids) and 128004 (the reserved pad).
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"]
LLAMA_BOS, LLAMA_STOP = 0, [1, 4, 5]
# Llama 3.x's chat format for plain conversations (no tools), in the structure of Meta's
# Llama-3.2-Instruct template: BOS, a system header with the knowledge cutoff and the date
# (`date_string`, else today's), the trimmed system message, then each turn as
# <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>.
LLAMA3_CHAT = (
    '{{- bos_token }}'
    '{%- if date_string is not defined %}{%- if strftime_now is defined %}'
    '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}'
    '{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- endif %}'
    "{%- set system = messages[0]['content'] | trim if messages[0]['role'] == 'system' else '' %}"
    "{%- set turns = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n'
    'Today Date: " + date_string + "\\n\\n" + system + "<|eot_id|>" }}'
    "{%- for m in turns %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
    "m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")


def _chars() -> list[str]:
    return ["\n"] + [chr(c) for c in range(32, 127)]


def _save_tokenizer(path: Union[str, Path], specials: list[str], chat_template: str,
                    bos: str = None, add_bos: bool = False, **tokens: str) -> None:
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials + _chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=" "))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    if add_bos:  # plain text gets BOS from the tokenizer, as Llama 3.x's does
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, bos_token=bos,
                            **tokens).save_pretrained(str(path))


def write_tokenizer(path: Union[str, Path]) -> None:
    """A character-level Hugging Face tokenizer (99 ids, within the tiny models' 128) with Qwen's
    ChatML special tokens and chat template: the math prompts of the papers' data go through
    `data.prompt_template: qwen_math` exactly as with Qwen's own tokenizer."""
    _save_tokenizer(path, SPECIALS, CHATML, eos_token=SPECIALS[EOS_ID],
                    pad_token=SPECIALS[PAD_ID])


def write_llama_tokenizer(path: Union[str, Path]) -> None:
    """A character-level tokenizer (103 ids) with Llama 3.x's special tokens and chat format:
    BOS from the template (and before plain text), EOS `<|eot_id|>` as the Instruct tokenizer
    names it, no pad token."""
    _save_tokenizer(path, LLAMA_SPECIALS, LLAMA3_CHAT, bos=LLAMA_SPECIALS[LLAMA_BOS],
                    add_bos=True, eos_token="<|eot_id|>")


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


def write_twin(path: Union[str, Path], name: str, seed: int = 3, *,
               positions: Optional[int] = None,
               script: Optional[Mapping[str, str]] = None) -> Path:
    """The tiny model `name` (a family's `tiny_twin`) as a Hugging Face checkpoint directory with
    its tokenizer; a Llama twin also gets the generation_config.json that lists its stop ids.
    `positions`: its max_position_embeddings (the spec's unless given); `script`: a dense Qwen
    twin as a character bigram model (`bigram_weights`) instead of random weights."""
    from safetensors.torch import save_file

    from megapkl.models.spec import hf_config_dict, load_spec

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = load_spec(name, {"max_position_embeddings": positions} if positions else None)
    if spec.family == "llama":
        ids = {"eos_token_id": LLAMA_STOP, "bos_token_id": LLAMA_BOS}
        (path / "generation_config.json").write_text(json.dumps(ids, indent=1), encoding="utf-8")
        write_llama_tokenizer(path)
    else:
        ids = {"eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "bos_token_id": None}
        write_tokenizer(path)
    config = {**hf_config_dict(spec, dtype="float32"), **ids}
    (path / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    weights = bigram_weights(spec, script, seed) if script else random_weights(spec, seed)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def char_id(c: str) -> int:
    """The id of a character in the twins' tokenizer (`write_tokenizer`)."""
    return len(SPECIALS) + (0 if c == "\n" else 1 + ord(c) - 32)


def bigram_weights(spec, script: Mapping[str, str], seed: int, sharp: float = 5.0) -> dict:
    """Weights under which the dense twin writes after the character c one of `script[c]`
    (equally likely at temperature 1), whatever came before: a scripted policy for a CPU run that
    must exercise a tool (a random twin never writes a tool call). Every attention output and the
    last layer's MLP are zero; the scripted characters get one-hot embeddings (tied: the output
    layer reads the same rows) and the first layer's MLP is a lookup table from c's embedding to
    its successors'; `sharp` scales the final norm, so the successors take all the probability.
    Other characters keep random embeddings orthogonal to the scripted ones."""
    import torch

    chars = sorted(set(script) | {n for v in script.values() for n in v})
    if not spec.tie_word_embeddings or spec.is_moe or len(chars) > spec.hidden_size \
            or len(script) > spec.ffn_hidden_size:
        raise ValueError(f"bigram_weights: a tied dense twin with at least {len(chars)} hidden "
                         f"units and {len(script)} MLP units is needed")
    w = random_weights(spec, seed)
    dims = {c: i for i, c in enumerate(chars)}
    emb = w["model.embed_tokens.weight"]
    emb[:, :len(chars)] = 0.0  # every other row lives in the remaining dimensions
    for c, i in dims.items():
        emb[char_id(c)] = 0.0
        emb[char_id(c), i] = 1.0
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight", "gate_proj.weight",
                          "up_proj.weight")):
            w[name].zero_()
        if name.endswith("norm.weight"):
            w[name].fill_(1.0)
    w["model.norm.weight"].fill_(sharp)
    pre = "model.layers.0.mlp."
    # RMSNorm makes a one-hot embedding sqrt(hidden) times itself: unit j fires for c_j alone
    scale = spec.hidden_size ** 0.5
    fired = scale * scale / (1.0 + math.exp(-scale))  # silu(scale) * scale
    for j, (c, nxt) in enumerate(sorted(script.items())):
        w[pre + "gate_proj.weight"][j, dims[c]] = 1.0
        w[pre + "up_proj.weight"][j, dims[c]] = 1.0
        for n in nxt:
            w[pre + "down_proj.weight"][dims[n], j] = 4.0 / fired
    return w
