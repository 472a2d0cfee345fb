"""Prompts and special ids of the real model families, with their real chat templates.

No test can download a tokenizer, so each family's is rebuilt here the way megapkl meets it:
a Hugging Face fast tokenizer with the family's special tokens at their real ids, a vocabulary of
the real size, the tokenizer_config values of the release (BOS, EOS, pad) and the release's chat
template (fixtures/: Meta's Llama-3.2-Instruct template, Qwen3's template), beside the release's
config.json / generation_config.json token ids. Checked for each: the rendered prompt does not
depend on the day (Llama stamps a date), BOS exactly once (Llama) or never (Qwen), the stop ids
of the model, and a pad id that is no real token. The tiny twins of `megapkl smoke` are held to
the same checks and to the real formats.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from megapkl.rollout.data import DataError, PromptDataset, PromptRecord, render_prompt
from megapkl.rollout.tokens import special_ids

FIXTURES = Path(__file__).parent / "fixtures"
PROBLEM = "  Find $x$ if $2x = 6$.  "

# Llama 3.x: 128000 text tokens, then 256 special ones (128000-128255)
LLAMA_NAMED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>",
               128004: "<|finetune_right_pad_id|>", 128006: "<|start_header_id|>",
               128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>",
               128010: "<|python_tag|>"}
LLAMA_CONFIG = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
# Qwen3: 151643 text tokens, 26 special ones, 267 embedding rows no token maps to
QWEN_NAMED = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


def _tokenizer(directory: Path, size: int, named: dict, special_end: int, template: str,
               bos=None, add_bos=False, **tokens):
    """A fast tokenizer: characters, fillers up to the first special id, the special tokens
    (`named` at their ids, reserved ones between), saved and loaded back as transformers would."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    first = min(named)
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(chars)}
    vocab.update({f"<t{i}>": i for i in range(len(chars), first)})
    specials = [named.get(i, f"<|reserved_special_token_{i - first}|>")
                for i in range(first, special_end)]
    vocab.update({t: first + k for k, t in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=" "))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, bos_token=bos,
                            **tokens).save_pretrained(str(directory))
    loaded = AutoTokenizer.from_pretrained(str(directory))
    assert len(loaded) == special_end
    return loaded


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Llama-3.2-3B-Instruct as megapkl sees it: tokenizer (eos <|eot_id|>, no pad) and the
    release's config.json / generation_config.json ids."""
    d = tmp_path_factory.mktemp("llama32")
    template = (FIXTURES / "llama3_2_instruct.jinja").read_text()
    tok = _tokenizer(d, 128256, LLAMA_NAMED, 128256, template, bos="<|begin_of_text|>",
                     add_bos=True, eos_token="<|eot_id|>")
    for name in ("config.json", "generation_config.json"):
        (d / name).write_text(json.dumps(LLAMA_CONFIG))
    return tok, d


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen3-8B-Base: eos and pad <|endoftext|>, no BOS; config.json eos 151643."""
    d = tmp_path_factory.mktemp("qwen3")
    tok = _tokenizer(d, 151936, QWEN_NAMED, 151669, (FIXTURES / "qwen3.jinja").read_text(),
                     eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    (d / "config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151643}))
    return tok, d


def _dataset(tok, template="qwen_math", problem=PROBLEM, **kw):
    record = PromptRecord(problem, "3", source="p.jsonl", line=7)
    return PromptDataset([record], tok, template, **kw)


def test_llama_prompt_never_depends_on_the_day(llama):
    tok, _ = llama
    text = _dataset(tok)[0].text
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" in text
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nFind $x$ if $2x = 6$."
                         "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    other = _dataset(tok, chat_date="01 Jan 2025")[0].text
    assert other == text.replace("26 Jul 2024", "01 Jan 2025")
    # what the template does when nobody gives it a date: today's, a prompt that changes daily
    bare = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert f"Today Date: {datetime.date.today().strftime('%d %b %Y')}\n" in bare


def test_llama_bos_exactly_once(llama):
    tok, _ = llama
    for template in ("qwen_math", "raw"):
        ids = _dataset(tok, template)[0].prompt_ids.tolist()
        assert ids[0] == 128000 and ids.count(128000) == 1, template
    with pytest.raises(DataError, match=r"^p\.jsonl:7: the prompt holds BOS \(128000\) 2 times"):
        _dataset(tok, problem="<|begin_of_text|>2+2?")


def test_llama_stop_and_pad_ids(llama):
    tok, d = llama
    ids = special_ids(tok, 128256, [str(d)])
    assert set(ids.stop) == {128001, 128008, 128009} and ids.bos == 128000
    assert ids.pad == 128004  # <|finetune_right_pad_id|>: no text encodes to it
    assert ids.pad not in ids.stop and ids.pad != ids.bos
    assert tok.added_tokens_decoder[ids.pad].special
    # the tokenizer alone names only <|eot_id|>: the checkpoint's files add the other two
    assert special_ids(tok, 128256).stop == (128009,)


def test_qwen3_prompt_bos_stop_and_pad(qwen, tmp_path):
    tok, d = qwen
    text = _dataset(tok)[0].text
    assert text == ("<|im_start|>system\nPlease reason step by step, and put your final answer "
                    "within \\boxed{}.<|im_end|>\n<|im_start|>user\n" + PROBLEM +
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert _dataset(tok, chat_date="01 Jan 2025")[0].text == text  # no date in Qwen's format
    # no BOS: config.json's bos_token_id (151643, <|endoftext|>) is never put before a prompt
    assert tok.bos_token_id is None
    for template, first in (("qwen_math", 151644), ("raw", tok.convert_tokens_to_ids(" "))):
        ids = _dataset(tok, template)[0].prompt_ids.tolist()
        assert ids[0] == first and 151643 not in ids, template
    ids = special_ids(tok, 151936, [str(d)])
    assert ids.stop == (151643,) and ids.bos is None
    assert ids.pad == 151669 and ids.pad not in tok.get_vocab().values()  # beyond every token
    # Qwen3 (instruct): turns end with <|im_end|>, generation_config adds <|endoftext|>
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert special_ids(tok, 151936, [str(tmp_path)]).stop == (151645, 151643)


def test_chatml_fallback_is_the_qwen3_format(qwen):
    """Without a chat template megapkl writes ChatML itself: Qwen3's rendering, no date."""
    text, specials = render_prompt(PROBLEM, "qwen_math", tokenizer=None, chat_date="01 Jan 2025")
    assert specials and text == render_prompt(PROBLEM, "qwen_math", qwen[0])[0]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tiny_twins_follow_their_family(name, tmp_path, llama, qwen):
    """The smoke twins: their chat format renders the math prompt as the release's template
    does, with the same BOS, stop and pad rules."""
    from transformers import AutoTokenizer

    from megapkl.models.spec import load_spec
    from megapkl.models.tiny import write_twin

    write_twin(tmp_path, name)
    twin = AutoTokenizer.from_pretrained(str(tmp_path))
    real = (llama if name == "tiny-llama" else qwen)[0]
    for date in ("26 Jul 2024", "03 Feb 2026"):
        mine = render_prompt(PROBLEM, "qwen_math", twin, date)[0]
        assert mine == render_prompt(PROBLEM, "qwen_math", real, date)[0]
    ids = special_ids(twin, load_spec(name).vocab_size, [str(tmp_path)])
    item = _dataset(twin)[0].prompt_ids.tolist()
    if name == "tiny-llama":
        assert ids.stop == (1, 4, 5) and ids.bos == 0 and item.count(0) == 1 and item[0] == 0
        assert twin.convert_ids_to_tokens(list(ids.stop)) == ["<|end_of_text|>", "<|eom_id|>",
                                                              "<|eot_id|>"]
    else:
        assert ids.stop == (2,) and ids.bos is None
    assert ids.pad not in twin.get_vocab().values()


def test_run_engine_carries_the_ids(tmp_path):
    """The run's embedded engine stops at every stop id and pads with the pad id."""
    from transformers import AutoTokenizer

    from megapkl.config import load_config
    from megapkl.config.layout import Layout
    from megapkl.models.spec import spec_from_model_config
    from megapkl.models.tiny import write_twin
    from megapkl.rollout.factory import build_run_engine

    write_twin(tmp_path / "m", "tiny-llama")
    cfg = load_config(Path(__file__).parents[2] / "configs/base/default.yaml",
                      ["model.name=tiny-llama", f"model.hf_checkpoint={tmp_path / 'm'}",
                       "model.dtype=fp32", "rollout.engine=embedded", "rollout.fp8=false",
                       "rollout.max_prompt_len=16", "rollout.max_response_len=16",
                       "data.train_path=x.jsonl", f"run_dir={tmp_path / 'run'}"])
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    engine = build_run_engine(cfg.rollout, cfg.model, spec_from_model_config(cfg.model), tok,
                              work_dir=tmp_path, seed=0, layout=Layout())
    try:
        assert engine.eos_token_ids == (1, 4, 5) and engine.pad_token_id == 103
    finally:
        engine.close()


def test_chat_date_is_checked():
    from megapkl.config import ConfigError, load_config

    base = Path(__file__).parents[2] / "configs/base/default.yaml"
    with pytest.raises(ConfigError, match="data.chat_date"):
        load_config(base, ["data.chat_date=2024-07-26", "data.train_path=x.jsonl"])
