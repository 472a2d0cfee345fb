"""The embedded rollout engine: a Hugging Face transformers causal LM sampled in pure torch.

It is the default engine on CPU and a correct (slow) fallback anywhere. Its weights arrive only
through `update_weights` from (HF name, full tensor) pairs, the same stream the SGLang engine gets,
so every CPU run exercises the trainer's export path. It holds a private copy of whatever was pushed
last, with that version: a snapshot is just an older push.

Generation: prompts are left-padded into one batch (attention mask 0 on padding, position ids
counting real tokens only, so a padded row computes exactly what it would alone), prefilled once,
then decoded one token per step with the transformers KV cache. See `megapkl.rollout.sampling` for
the log-prob / top-k / top-p conventions and `megapkl.rollout.sample` for the Sample layout.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from megapkl.rollout import fp8 as FP8
from megapkl.rollout import weight_write as WW
from megapkl.rollout.embedded_model import (ConfigLike, _ExpertRecorder, _kv_dtype, _RoundedCache,
                                            _unfuse_experts, checkpoint_tensors, iter_safetensors,
                                            load_hf_config)
from megapkl.rollout.engine import (RolloutEngine, RolloutEngineError, SamplingParams,
                                    WeightUpdateError, check_generate_args)
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.rollout.sampling import draw, step_logprobs, top_logprobs
from megapkl.rollout.seeds import row_seeds, uniforms
from megapkl.rollout.stops import StopStrings
from megapkl.rollout.version_store import StoredVersion

if TYPE_CHECKING:
    from megapkl.rollout.turns import TurnDriver


class EmbeddedEngine(RolloutEngine):
    """Rollout engine holding a transformers causal LM (Qwen3 / Qwen3-MoE tested).

    Args:
        config: PretrainedConfig, config.json mapping (see `megapkl.models.spec.hf_config_dict`),
            config.json path or local checkpoint directory.
        device, dtype: where and in what precision the engine's copy of the weights lives.
        seed: seeds the running torch.Generator that seeds unseeded calls (SamplingParams.seed or
            prompt_seeds name a call's draws instead; rollout/seeds.py).
        eos_token_ids: default stop tokens (default: the config's eos_token_id, else the
            tokenizer's; none at all means responses stop only at max_new_tokens).
        pad_token_id: filler for left padding and finished rows (never attended to).
        tokenizer: optional; anything with `decode(ids)`, used to fill Sample.response_text.
        max_batch_size: rows (prompt x response) decoded together.
        fp8: compute as a block-FP8 (W8A8) engine: every pushed linear weight is quantized (or
            arrives quantized, with its `weight_scale_inv`) and dequantized into `dtype`, and each
            linear layer's input is quantized per token in 128-wide groups (megapkl.rollout.fp8).
            A checkpoint whose config.json has an FP8 quantization_config turns it on.
        kv_cache_dtype: "auto" (the engine's dtype) or "bf16" (keys and values rounded to bf16 when
            written to the cache, as an engine storing a bf16 cache reads them back).
    The model starts without weights: push them with `update_weights` (the first push must cover
    every parameter) or use `from_pretrained` / `from_model`.
    """

    def __init__(self, config: ConfigLike, *, device: Union[str, torch.device] = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 eos_token_ids: Optional[Sequence[int]] = None, pad_token_id: Optional[int] = None,
                 tokenizer: Any = None, max_batch_size: int = 256,
                 attn_implementation: str = "sdpa", fp8: bool = False,
                 kv_cache_dtype: str = "auto"):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.config = load_hf_config(config)
        self.fp8_block = self._fp8_block(fp8)
        self.kv_dtype = _kv_dtype(kv_cache_dtype)
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(self.config,
                                                     attn_implementation=attn_implementation)
        _unfuse_experts(model)
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.eos_token_ids = self._default_eos(eos_token_ids, tokenizer)
        self.pad_token_id = self._default_pad(pad_token_id, tokenizer)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._act_hooks = []
        if self.fp8_block is not None:  # an unhandled layer is an error now, not a BF16 layer later
            FP8.check_fp8_model({n: tuple(p.shape) for n, p in self._params.items()},
                                block=self.fp8_block)
            self._act_hooks = self._quantize_activations()
        self._version: Optional[int] = None
        # After a streamed write failed half-way: (parameters written since, what failed).
        self._torn: Optional[tuple[set[int], str]] = None
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._recorder = self._make_recorder()

    # ---- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike], version: int = 0,
                        **kwargs: Any) -> "EmbeddedEngine":
        """Config and safetensors weights of a local HF checkpoint, loaded via `update_weights`."""
        engine = cls(directory, **kwargs)
        engine.update_weights(iter_safetensors(directory), version=version)
        return engine

    @classmethod
    def from_model(cls, model: nn.Module, version: int = 0, **kwargs: Any) -> "EmbeddedEngine":
        """An engine with a copy of a transformers model's config and current weights."""
        kwargs.setdefault("dtype", next(model.parameters()).dtype)
        engine = cls(model.config, **kwargs)
        engine.update_weights(checkpoint_tensors(model), version=version)
        return engine

    def _fp8_block(self, fp8: bool) -> Optional[tuple[int, int]]:
        """The FP8 block size: the checkpoint's quantization_config, else (128, 128) when `fp8`."""
        source = getattr(self.config, "name_or_path", "") or "config"
        qc = getattr(self.config, "quantization_config", None)
        if qc is not None:
            qc = qc if isinstance(qc, dict) else qc.to_dict()
            block = FP8.read_quantization_config({"quantization_config": qc},
                                                 f"{source}/config.json")
            del self.config.quantization_config  # dequantized here, not by transformers
            return block
        return FP8.BLOCK if fp8 else None

    def _quantize_activations(self) -> list:
        """W8A8 as a block-FP8 engine runs it: each quantized linear layer's input is quantized
        per token in groups of the block's input side (megapkl.rollout.fp8.fake_quant_activation)."""
        group = self.fp8_block[1]

        def hook(module, args):
            return (FP8.fake_quant_activation(args[0], group),) + tuple(args[1:])

        return [m.register_forward_pre_hook(hook) for name, m in self.model.named_modules()
                if isinstance(m, nn.Linear)
                and FP8.quantized_name(name + ".weight", tuple(m.weight.shape))]

    @property
    def fp8(self) -> bool:
        return self.fp8_block is not None

    def _default_eos(self, eos: Optional[Sequence[int]], tokenizer: Any) -> tuple[int, ...]:
        """Explicit ids, else the config's eos_token_id, else the tokenizer's."""
        for source in (eos, getattr(self.config, "eos_token_id", None),
                       getattr(tokenizer, "eos_token_id", None)):
            if source is not None:
                return (int(source),) if isinstance(source, int) else tuple(int(i) for i in source)
        return ()

    def _default_pad(self, pad: Optional[int], tokenizer: Any) -> int:
        for source in (pad, getattr(self.config, "pad_token_id", None),
                       getattr(tokenizer, "pad_token_id", None)):
            if source is not None:
                return int(source)
        return self.eos_token_ids[0] if self.eos_token_ids else 0  # never attended to anyway

    def _make_recorder(self) -> Optional[_ExpertRecorder]:
        experts = getattr(self.config, "num_experts", None)
        top_k = getattr(self.config, "num_experts_per_tok", None)
        gates = [m for name, m in self.model.named_modules() if name.endswith("mlp.gate")]
        if not experts or not top_k or not gates:
            return None
        return _ExpertRecorder(gates, int(top_k))

    @property
    def is_moe(self) -> bool:
        return self._recorder is not None

    # ---- interface: state ---------------------------------------------------------------------
    @property
    def version(self) -> Optional[int]:
        return self._version

    def health(self) -> dict[str, Any]:
        self._check_alive()
        return {"ok": True, "engine": "embedded", "version": self._version,
                "weights_loaded": self._version is not None and self._torn is None,
                "device": str(self.device),
                "model_type": getattr(self.config, "model_type", None), "moe": self.is_moe}

    def close(self) -> None:
        if not self._closed and self._recorder is not None:
            self._recorder.remove()
        self.model = None  # type: ignore[assignment]
        self._params = {}
        super().close()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._generator.set_state(state["rng"])

    def _check_ready(self) -> None:
        self._check_alive()
        if self._version is None:
            raise RolloutEngineError("EmbeddedEngine holds no weights yet: push them with "
                                     "update_weights(named_tensors, version) first")
        if self._torn is not None:
            raise RolloutEngineError(f"EmbeddedEngine's weights are torn: an update failed after "
                                     f"writing part of them ({self._torn[1]}); push every "
                                     f"parameter again")

    # ---- interface: weights ---------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *,
                       copy: bool = True, streamed: bool = False) -> None:
        """Check every incoming tensor (a parameter's name and shape, floating point, finite) and
        write it into the engine's weights (megapkl.rollout.weight_write). Staged by default:
        all are checked (and copied to the engine's device and dtype) before any is written, so
        a bad stream leaves the previous weights and version untouched. The copy matters when the
        trainer keeps updating its own tensors after the push; a caller handing over tensors
        nobody else writes passes copy=False and they are staged as they are when device and
        dtype already match. `streamed` checks and writes each tensor a piece at a time (one
        read of the bytes instead of two; a server's decoded request): a bad value found after a
        piece was written leaves the weights torn, and the engine refuses to generate until
        every parameter has been written again."""
        self._check_alive()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise WeightUpdateError(f"version must be an int >= 0, got {version!r}")
        if isinstance(named_tensors, StoredVersion):
            copy = False  # each tensor is read from the file into memory nobody else holds
        if self.fp8:
            named_tensors = FP8.fake_quant_fp8(named_tensors, self.dtype, self.fp8_block)
        else:  # an FP8 stream (weight + weight_scale_inv) is dequantized, plain tensors pass
            named_tensors = FP8.dequantize_stream(named_tensors, self.dtype)
        if streamed and self._version is not None:
            written = self._write_streamed(named_tensors)
        else:  # the first push is staged: it must cover every parameter before it counts
            written = self._write_staged(named_tensors, copy)
        if self._torn is not None:
            self._torn[0].update(written)
            if len(self._torn[0]) == len({id(p) for p in self._params.values()}):
                self._torn = None
        self._version = version

    def _write_staged(self, named_tensors: Iterable[tuple[str, Tensor]], copy: bool) -> set[int]:
        staged: dict[int, tuple[nn.Parameter, Tensor]] = {}
        for name, tensor in named_tensors:
            param = self._lookup(name)
            staged[id(param)] = (param, WW.staged_value(name, tensor, param, copy))
        if not staged:
            raise WeightUpdateError("update_weights received no tensors")
        if self._version is None:
            self._check_complete(staged)
        with torch.no_grad():
            for param, value in staged.values():
                param.copy_(value)
        return set(staged)

    def _write_streamed(self, named_tensors: Iterable[tuple[str, Tensor]]) -> set[int]:
        written: set[int] = set()

        def targets() -> Iterator[tuple[str, Tensor, nn.Parameter]]:
            for name, tensor in named_tensors:
                param = self._lookup(name)
                written.add(id(param))
                yield name, tensor, param

        writer = WW.StreamedWrite(WW.write_threads(self.device))
        try:
            writer.run(WW.streamed_jobs(targets()))
        except BaseException as exc:  # only a refusal before the first piece leaves them whole
            refused = isinstance(exc, (WeightUpdateError, FP8.FP8Error))
            if writer.written or not refused or isinstance(exc, WW.TornWrite):
                self._torn = (set(), str(exc) or type(exc).__name__)
            raise
        if not written:
            raise WeightUpdateError("update_weights received no tensors")
        return written

    def _lookup(self, name: str) -> nn.Parameter:
        param = self._params.get(name)
        if param is None:
            close = difflib.get_close_matches(name, list(self._params), n=3)
            hint = f"; closest names: {close}" if close else ""
            raise WeightUpdateError(f"unknown weight '{name}': not a parameter of the engine's "
                                    f"{type(self.model).__name__}{hint}")
        return param

    def _check_complete(self, staged: dict[int, tuple[nn.Parameter, Tensor]]) -> None:
        # Keyed by parameter identity, so a tied lm_head counts as covered by embed_tokens.
        missing = [n for n, p in self._params.items() if id(p) not in staged]
        if missing:
            raise WeightUpdateError(f"the first weight push must cover every parameter; missing "
                                    f"{len(missing)}, e.g. {missing[:5]}")

    # ---- interface: generation --------------------------------------------------------------------
    def generate(self, prompts: Sequence[PromptItem], n: int, sampling: SamplingParams,
                 turns: Optional["TurnDriver"] = None) -> list[Sample]:
        self._check_ready()
        check_generate_args(prompts, n, sampling)
        self._check_lengths(prompts, sampling)
        if sampling.return_routed_experts and not self.is_moe:
            raise ValueError("return_routed_experts needs a mixture-of-experts model")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer (it decodes the output's "
                             "last tokens to find them)")
        if sampling.topk_logprobs > self.config.vocab_size:
            raise ValueError(f"topk_logprobs ({sampling.topk_logprobs}) exceeds the vocabulary "
                             f"({self.config.vocab_size})")
        seeds = self._prompt_seeds(len(prompts), sampling)
        draws = row_seeds(seeds, n, self.device)  # each response's own random stream
        group_ids, uids = self._allocate_ids(len(prompts), n)
        if turns is not None:  # multi-turn: rounds over one KV cache (rollout/embedded_turns.py)
            from megapkl.rollout.embedded_turns import generate_trajectories

            return generate_trajectories(self, prompts, n, sampling, turns, draws, group_ids, uids)
        rows = [(p, g) for p, g in zip(prompts, group_ids) for _ in range(n)]
        samples: list[Sample] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start:start + self.max_batch_size]
            # the rows where a prompt's n responses begin (a chunk may start inside a group)
            firsts = [r for r in range(len(chunk)) if r == 0 or (start + r) % n == 0]
            outs = self._generate_rows([p.prompt_ids for p, _ in chunk], sampling,
                                       draws[start:start + len(chunk)], firsts)
            for (prompt, group), uid, out in zip(chunk, uids[start:], outs):
                samples.append(self._make_sample(prompt, group, uid, out, sampling))
        return samples

    def _prompt_seeds(self, count: int, sampling: SamplingParams) -> list[int]:
        """The call's seed per prompt (SamplingParams.seed_of); an unseeded call takes its seed
        from the engine's running generator, so successive calls differ and resume exactly."""
        if sampling.seed is None and sampling.prompt_seeds is None:
            call = int(torch.randint(0, 2**62, (1,), generator=self._generator,
                                     device=self.device))
            sampling = dataclasses.replace(sampling, seed=call)
        return [sampling.seed_of(i) for i in range(count)]

    def _check_lengths(self, prompts: Sequence[PromptItem], sampling: SamplingParams) -> None:
        limit = getattr(self.config, "max_position_embeddings", None)
        for i, p in enumerate(prompts):
            if limit is not None and p.prompt_ids.numel() + sampling.max_new_tokens > limit:
                raise ValueError(f"prompts[{i}]: {p.prompt_ids.numel()} prompt tokens + "
                                 f"max_new_tokens {sampling.max_new_tokens} exceed the model's "
                                 f"max_position_embeddings ({limit})")
        ids = torch.cat([p.prompt_ids.reshape(-1) for p in prompts])
        low, high = torch.aminmax(ids) if ids.numel() else (0, 0)  # one read for the call
        if int(low) >= 0 and int(high) < self.config.vocab_size:
            return
        for i, p in enumerate(prompts):
            bad = (p.prompt_ids < 0) | (p.prompt_ids >= self.config.vocab_size)
            if bool(bad.any()):
                raise ValueError(f"prompts[{i}]: token ids outside the vocabulary "
                                 f"[0, {self.config.vocab_size})")

    def _make_sample(self, prompt: PromptItem, group: int, uid: int, out: dict,
                     sampling: SamplingParams) -> Sample:
        text = None
        if self.tokenizer is not None:  # special tokens dropped: the text is for rewards and logs
            text = self.tokenizer.decode(out["response_ids"].tolist(), skip_special_tokens=True)
        return Sample(uid=uid, group_id=group, prompt_ids=prompt.prompt_ids,
                      response_ids=out["response_ids"], logp_behav=out["logp"],
                      version=self._version, finish_reason=out["finish"],
                      matched=out.get("matched"),
                      temperature=sampling.logprob_temperature, topk_ids=out.get("topk_ids"),
                      topk_logp=out.get("topk_logp"), routed_experts=out.get("experts"),
                      prompt_text=prompt.text, response_text=text, answer=prompt.answer,
                      metadata=dict(prompt.metadata))

    @torch.no_grad()  # not inference_mode: Sample tensors must be usable in autograd later
    def _generate_rows(self, prompt_ids: list[Tensor], sampling: SamplingParams,
                       draws: Tensor, firsts: list[int]) -> list[dict]:
        """Decode one left-padded batch; returns per row the response and its per-token records.
        `draws`: int64 [rows], each row's seed (its step-t uniform: seeds.uniforms(draws, t)).
        `firsts`: the rows where a run of rows with one prompt begins (a group's responses);
        each such prompt is prefilled once and its cache copied to its rows."""
        batch = len(prompt_ids)
        want_experts = sampling.return_routed_experts
        if self._recorder is not None:
            self._recorder.reset(active=want_experts)
        stop = self._stop_ids(sampling)
        strings = StopStrings(sampling.stop, self.tokenizer)
        matched: list[Optional[str]] = [None] * batch
        steps: list[dict[str, Tensor]] = []
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros_like(finished)
        lengths = torch.zeros(batch, dtype=torch.int64, device=self.device)
        out, mask, pos = self._prefill(prompt_ids, firsts)
        for t in range(sampling.max_new_tokens):
            logp = step_logprobs(out.logits[:, -1], sampling)
            token = draw(logp, sampling, None if sampling.greedy else uniforms(draws, t))
            token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
            steps.append(self._record_step(logp, token, sampling))
            lengths += (~finished).long()
            hit = ~finished & torch.isin(token, stop) if stop.numel() else torch.zeros_like(finished)
            if strings:  # checked first, as SGLang does: a string beats a stop token
                hit |= self._stop_strings_hit(strings, steps, finished, matched)
            stopped |= hit
            finished |= hit
            if bool(finished.all()) or t == sampling.max_new_tokens - 1:
                break  # the last token is never fed: SGLang's prompt + response - 1 expert rows
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            pos = pos[:, -1:] + 1
            out = self._forward(token[:, None], mask, pos, cache=out.past_key_values)
        rows = self._split_rows(prompt_ids, steps, lengths, stopped, want_experts)
        for row, m in zip(rows, matched):
            row["matched"] = m
        return rows

    def _stop_strings_hit(self, strings: StopStrings, steps: list[dict[str, Tensor]],
                          finished: Tensor, matched: list[Optional[str]]) -> Tensor:
        """[B] bool: the rows still going whose output now ends in a stop string (recorded in
        `matched`); a row's output is its sampled tokens so far (rollout/stops.py)."""
        hit = torch.zeros_like(finished)
        window = torch.stack([s["token"] for s in steps[-strings.window:]], dim=1)
        for b in (~finished).nonzero().flatten().tolist():
            m = strings.match(window[b].tolist())
            if m is not None:
                matched[b], hit[b] = m, True
        return hit

    def _prefill(self, prompt_ids: list[Tensor], firsts: list[int]):
        """The prompts' forward pass, once per distinct prompt (rows `firsts`), then its cache,
        last logits, attention mask and positions copied to every row of its run, as a prefix
        cache shares a prompt among its samples (SGLang's radix cache does). A row gets the
        values of a pass over all rows, up to the round-off by which two batch shapes differ
        already (bit for bit on the CPU demo's task; docs/engines.md). A mixture-of-experts
        model prefills every row: its experts multiply the tokens routed to them together, and
        with fewer rows the tiny MoE's log-probs moved even on the demo's task."""
        if self.is_moe:
            firsts = list(range(len(prompt_ids)))
        ids, mask, pos = self._left_pad([prompt_ids[r] for r in firsts])
        out = self._forward(ids, mask, pos, cache=None)
        if len(firsts) == len(prompt_ids):
            return out, mask, pos
        runs = torch.tensor(firsts[1:] + [len(prompt_ids)]) - torch.tensor(firsts)
        index = torch.repeat_interleave(torch.arange(len(firsts)), runs).to(self.device)
        out.past_key_values.batch_select_indices(index)
        out.logits = out.logits.index_select(0, index)
        return out, mask.index_select(0, index), pos.index_select(0, index)

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache):
        from transformers import DynamicCache

        if cache is None:
            cache = DynamicCache() if self.kv_dtype is None else _RoundedCache(self.kv_dtype)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        if self._recorder is not None:
            self._recorder.end_forward(ids.shape[0], ids.shape[1])
        return out

    def _left_pad(self, prompt_ids: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """input ids, attention mask and position ids [B, P_max] for left-padded prompts.
        Positions count real tokens only (0 at each row's first prompt token)."""
        lengths = torch.tensor([int(p.numel()) for p in prompt_ids])
        width = int(lengths.max())
        ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        # column c of a row holds a prompt token when c >= width - its length: one scatter
        mask = (torch.arange(width) >= width - lengths[:, None]).long()
        ids[mask.bool()] = torch.cat(list(prompt_ids)).to(torch.long)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def _stop_ids(self, sampling: SamplingParams) -> Tensor:
        ids = () if sampling.ignore_eos else (
            sampling.stop_token_ids if sampling.stop_token_ids is not None else self.eos_token_ids)
        return torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device)

    @staticmethod
    def _record_step(logp: Tensor, token: Tensor, sampling: SamplingParams) -> dict[str, Tensor]:
        step = {"token": token.cpu(), "logp": logp.gather(1, token[:, None]).squeeze(1).cpu()}
        if sampling.topk_logprobs:
            ids, values = top_logprobs(logp, sampling.topk_logprobs)
            step["topk_ids"], step["topk_logp"] = ids.cpu(), values.cpu()
        return step

    def _split_rows(self, prompt_ids: list[Tensor], steps: list[dict[str, Tensor]], lengths: Tensor,
                    stopped: Tensor, want_experts: bool) -> list[dict]:
        """Per-row dicts from the per-step batch records (each row keeps its first R_b steps)."""
        # each row's own copy (a view would carry the whole batch's storage wherever a sample
        # is pickled); a row that ran every step is copied whole, without a slice
        per_row = {key: torch.stack([s[key] for s in steps], dim=1).unbind(0) for key in steps[0]}
        own = lambda t, r: t.clone() if r == len(steps) else t[:r].clone()  # noqa: E731
        width = max(int(p.numel()) for p in prompt_ids)
        rows = []
        for b, (prompt, r, stop) in enumerate(zip(prompt_ids, lengths.tolist(), stopped.tolist())):
            row = {"response_ids": own(per_row["token"][b], r),
                   "logp": own(per_row["logp"][b], r),
                   "finish": "stop" if stop else "length"}
            if "topk_ids" in per_row:
                row["topk_ids"] = own(per_row["topk_ids"][b], r)
                row["topk_logp"] = own(per_row["topk_logp"][b], r)
            if want_experts:
                row["experts"] = self._row_experts(b, int(prompt.numel()), width, r)
            rows.append(row)
        return rows

    def _row_experts(self, b: int, prompt_len: int, width: int, response_len: int) -> Tensor:
        """[P + R - 1, layers, k]: prefill rows of the real prompt tokens, then one row per fed
        response token (decode forward t fed response token t)."""
        forwards = self._recorder.forwards
        prompt_rows = forwards[0][b, width - prompt_len:]
        fed = [forwards[1 + t][b, 0:1] for t in range(response_len - 1)]
        return torch.cat([prompt_rows, *fed], dim=0).contiguous()
