"""The special token ids of a run: where a response stops, what fills padding, the prompt's BOS.

    ids = special_ids(tokenizer, spec.vocab_size, [model.hf_checkpoint, model.tokenizer])
    ids.stop   every id a response ends at
    ids.pad    the filler of padded positions: never a token any text encodes to
    ids.bos    the id a prompt starts with exactly once (None: the tokenizer has none)

Stop ids are the union of what the checkpoint declares (`eos_token_id` of its config.json and
generation_config.json, a number or a list) and the tokenizer's `eos_token_id`: Llama-3.2-Instruct
ends a turn with `<|eot_id|>` (128009), a tool call with `<|eom_id|>` (128008) and a document with
`<|end_of_text|>` (128001), while its tokenizer names only the first; Qwen3 ends with
`<|im_end|>` or `<|endoftext|>`. Generation must stop at each of them.

The pad id is, in this order: an embedding row beyond the tokenizer's tokens (Qwen3's vocabulary
has 267 such rows; no text can produce them), else the tokenizer's own pad token when it is a
special token that is neither a stop id nor BOS, else a special token whose name says pad
(Llama 3.x has no pad token but reserves `<|finetune_right_pad_id|>`, 128004). Padding with EOS,
the common fallback, would put a real token where there is none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megapkl.errors import MegapklError

CONFIG_FILES = ("config.json", "generation_config.json")


class TokenIdError(MegapklError, ValueError):
    """No usable special id; the message names the tokenizer or file."""


@dataclass(frozen=True)
class SpecialIds:
    stop: tuple[int, ...]
    pad: int
    bos: Optional[int]

    def hf_config(self) -> dict[str, Any]:
        """The config.json keys that carry these ids (`megapkl.models.spec.hf_config_dict`)."""
        return {"eos_token_id": list(self.stop), "pad_token_id": self.pad,
                "bos_token_id": self.bos}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def declared_eos(directories: Iterable[Optional[str]]) -> list[int]:
    """eos_token_id of the config.json / generation_config.json files in `directories`
    (missing directories and files are skipped), in the order found, without repeats."""
    out: list[int] = []
    for directory in directories:
        if not directory:
            continue
        for name in CONFIG_FILES:
            file = Path(directory) / name
            if not file.is_file():
                continue
            try:
                found = _as_ids(json.loads(file.read_text()).get("eos_token_id"))
            except (ValueError, TypeError) as exc:
                raise TokenIdError(f"{file}: eos_token_id: not an id or a list of ids "
                                   f"({exc})") from None
            out += [i for i in found if i not in out]
    return out


def _specials(tokenizer: Any) -> dict[str, int]:
    """Special tokens of a Hugging Face tokenizer: content -> id."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {tok.content: int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}


def pad_id(tokenizer: Any, vocab_size: int, stop: Sequence[int]) -> int:
    """The pad id (see the module docstring for the order of the choices)."""
    taken = set(tokenizer.get_vocab().values())
    spare = next((i for i in range(vocab_size) if i not in taken), None)
    if spare is not None:
        return spare
    avoid = set(stop) | {tokenizer.bos_token_id}
    specials = _specials(tokenizer)
    own = tokenizer.pad_token_id
    if own is not None and own not in avoid and own in specials.values():
        return int(own)
    for content, i in sorted(specials.items(), key=lambda kv: kv[1]):
        if "pad" in content.lower() and i not in avoid:
            return i
    raise TokenIdError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}: no pad id that is "
                       f"never a real token (every one of the model's {vocab_size} ids is a "
                       "token, and no special pad token); give the tokenizer a pad token")


def special_ids(tokenizer: Any, vocab_size: int,
                directories: Iterable[Optional[str]] = ()) -> SpecialIds:
    """The run's special ids from its Hugging Face tokenizer, the model's vocabulary size and the
    directories holding its config.json / generation_config.json (checkpoint, tokenizer)."""
    stop = declared_eos(directories)
    stop += [i for i in _as_ids(tokenizer.eos_token_id) if i not in stop]
    if not stop:
        raise TokenIdError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}: no EOS id in "
                           "the tokenizer or in the checkpoint's config.json / "
                           "generation_config.json: a response would never stop")
    bad = [i for i in stop if not 0 <= i < vocab_size]
    if bad:
        raise TokenIdError(f"eos_token_id {bad} outside the model's vocabulary [0, {vocab_size})")
    bos = tokenizer.bos_token_id
    return SpecialIds(stop=tuple(stop), pad=pad_id(tokenizer, vocab_size, stop),
                      bos=None if bos is None else int(bos))


def adds_bos(tokenizer: Any) -> Optional[int]:
    """The BOS id the tokenizer puts before plain text (`add_special_tokens=True`), else None
    (Qwen has no BOS; a synthetic task's tokenizer has its own rules)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or not hasattr(tokenizer, "get_vocab"):
        return None
    probe = tokenizer.encode("a", add_special_tokens=True)
    return int(bos) if probe and probe[0] == bos else None
