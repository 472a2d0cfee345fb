"""Block-wise FP8 (e4m3) weight quantization in the layout of Hugging Face FP8 checkpoints of Qwen3.

A linear layer's weight W [N, K] becomes
    `<name>.weight`            float8_e4m3fn [N, K]
    `<name>.weight_scale_inv`  float32 [ceil(N / 128), ceil(K / 128)]
with W ~= q * s block by block (s is called `weight_scale_inv` in the HF / SGLang layout: it is
the factor that dequantizes). The config.json carries `quantization_config = {quant_method: fp8,
fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}`. Only linear layers are
quantized: embeddings, lm_head, norms (1-D) and the MoE router (`mlp.gate`) keep their dtype.

Quantization of one block with largest magnitude a (computed in fp32):
    s = max(fp32(a / 448), 2^-126)          (all-zero block: s = 2^-126 and q = 0)
    q = e4m3(clamp(fp32(w / s), -448, 448))  round to nearest, ties to even; never inf / NaN
Error bound (checked by tests/rollout/test_fp8.py on random and adversarial tensors): for every
element, with s its block's scale,
    |w - dequantize(q, s)| <= 2^-4 * |w| * (1 + 2^-20) + 2^-10 * s
(2^-4: half an e4m3 ulp relative to the value, 3 mantissa bits; 2^-10 * s: half the subnormal step
2^-9 of e4m3 in the block's units; the 2^-20 slack covers the fp32 roundings of w / s and q * s).
Non-finite weights are errors (naming the weight), never quantized.

Callers:
    transform = FP8Transform()                 # the weight sync: (name, tensor) -> quantized stream
    engine.update_weights(transform(model.export_hf()), version)
    write_fp8_checkpoint(dir, named, hf_config)  # first launch of an engine from disk
    dequantize_stream(named)                   # an FP8 stream back to plain weights (embedded)
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from megapkl.errors import MegapklError
from megapkl.rollout import fp8_cpu

E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126  # smallest normal fp32: the scale of an all-zero (or vanishing) block
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}
ERROR_REL = 2.0 ** -4 * (1 + 2.0 ** -20)   # the bound above: ERROR_REL * |w| + ERROR_ABS * s
ERROR_ABS = 2.0 ** -10

# Linear layers of the Qwen3 / Qwen3-MoE HF layout; every other 2-D weight must be a known BF16 one.
_LINEAR = re.compile(r"(^|\.)(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj|"
                     r"mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")
_KEPT = re.compile(r"(^|\.)(embed_tokens|lm_head|mlp\.gate|mlp\.shared_expert_gate)\.weight$")


class FP8Error(MegapklError, ValueError):
    """A weight or checkpoint FP8 cannot handle; the message names the weight, key or file."""


# ---------------------------------------------------------------------------------- which weights

def quantized_name(name: str, shape: Sequence[int]) -> bool:
    """True for a linear layer's weight (quantized), False for a weight kept as is (embeddings,
    lm_head, norms, router, biases). Raises FP8Error for a weight FP8 does not know how to treat,
    so no layer silently stays in BF16."""
    if len(shape) <= 1:
        return False  # norms, biases
    if _KEPT.search(name):
        return False
    if _LINEAR.search(name):
        if len(shape) != 2:
            raise FP8Error(f"rollout.fp8: weight '{name}' has shape {list(shape)}; block FP8 needs "
                           "a 2-D linear weight")
        return True
    raise FP8Error(f"rollout.fp8: weight '{name}' (shape {list(shape)}) is neither a linear layer "
                   "megapkl quantizes (q/k/v/o_proj, gate/up/down_proj, experts) nor a weight it "
                   "keeps in BF16 (embed_tokens, lm_head, norms, mlp.gate); FP8 cannot handle "
                   "this model")


def check_fp8_model(shapes: Mapping[str, Sequence[int]], tp: int = 1,
                    block: Sequence[int] = BLOCK) -> int:
    """Validate a whole model for FP8 before any run starts; returns the number of quantized
    weights. With tensor parallelism tp > 1 the engine shards column-parallel layers (q/k/v,
    gate/up) by rows and row-parallel ones (o, down) by columns; each shard must hold whole blocks."""
    count = 0
    for name, shape in shapes.items():
        if not quantized_name(name, shape):
            continue
        count += 1
        if tp > 1:
            row_parallel = bool(re.search(r"(o_proj|down_proj)\.weight$", name))
            side = shape[1] if row_parallel else shape[0]
            if side % (tp * block[1 if row_parallel else 0]):
                raise FP8Error(f"rollout.fp8: weight '{name}' {list(shape)}: side {side} split "
                               f"over tensor parallel {tp} is not a multiple of the FP8 block "
                               f"{block[1 if row_parallel else 0]}")
    if count == 0:
        raise FP8Error("rollout.fp8: the model has no linear layer to quantize")
    return count


# ---------------------------------------------------------------------------------- the math

def _blocks(shape: Sequence[int], block: Sequence[int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _padded(w: Tensor, nr: int, nc: int, block: Sequence[int]) -> Tensor:
    rows, cols = w.shape
    if (rows, cols) == (nr * block[0], nc * block[1]):
        return w
    out = w.new_zeros(nr * block[0], nc * block[1])  # zeros never change a block's max |w|
    out[:rows, :cols] = w
    return out


# Bit patterns of |w| for the amax pass: the sign bit cleared, a non-negative float orders like its
# bits as an integer, and any pattern at or above +Inf's is Inf or NaN. Integer max reductions are
# vectorized where the float block reduction over two strided dims is not (3-4x faster on CPU).
_ABS_BITS = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
             torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}


def _block_amax(blocks: Tensor, name: str) -> Tensor:
    """fp32 [nr, nc] largest |w| of each block of `blocks` [nr, b0, nc, b1]; FP8Error on NaN/Inf."""
    nr, b0, nc, b1 = blocks.shape
    if blocks.dtype in _ABS_BITS and blocks.is_contiguous():
        itype, mask, inf = _ABS_BITS[blocks.dtype]
        bits = (blocks.view(itype) & mask).view(-1, b1).amax(-1).view(nr, b0, nc).amax(1)
        finite = bool((bits < inf).all())
        amax = bits.view(blocks.dtype).float()
    else:
        amax = torch.maximum(blocks.amax(dim=(1, 3)).float(), -blocks.amin(dim=(1, 3)).float())
        finite = bool(torch.isfinite(amax).all())
    if not finite:
        raise FP8Error(f"FP8 quantization of '{name}': it contains NaN or Inf")
    return amax


def _check_weight(weight: Tensor, name: str) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise FP8Error(f"FP8 quantization of '{name}': expected a 2-D float tensor, got "
                       f"{weight.dtype} {list(weight.shape)}")


def quantize_block_fp8(weight: Tensor, block: Sequence[int] = BLOCK, name: str = "weight"
                       ) -> tuple[Tensor, Tensor]:
    """(e4m3 weight [N, K], fp32 scale_inv [ceil(N/b0), ceil(K/b1)]) of a 2-D float weight.
    bf16 / fp32 weights on the CPU go through the compiled kernel (fp8_cpu: the same numbers,
    several times faster than torch's scalar float8 cast); everything else through torch."""
    _check_weight(weight, name)
    fast = fp8_cpu.quantize(weight.detach(), block)
    if fast is None:
        return quantize_block_fp8_torch(weight, block, name)
    q, scale, bad = fast
    if bad >= 0:
        raise FP8Error(f"FP8 quantization of '{name}': it contains NaN or Inf")
    return q, scale


def quantize_block_fp8_torch(weight: Tensor, block: Sequence[int] = BLOCK, name: str = "weight"
                             ) -> tuple[Tensor, Tensor]:
    """quantize_block_fp8 in torch operations: the path of GPU weights (and of CPUs without a C
    compiler); tests/rollout/test_fp8_cpu.py checks the kernel against it bit for bit."""
    _check_weight(weight, name)
    rows, cols = weight.shape
    nr, nc = _blocks(weight.shape, block)
    blocks = _padded(weight.detach().contiguous(), nr, nc, block).view(nr, block[0], nc, block[1])
    scale = (_block_amax(blocks, name) / E4M3_MAX).clamp_(min=MIN_SCALE)
    # One fp32 working copy, divided in place (correctly rounded fp32 division, as the bound
    # assumes); a mixed bf16 / fp32 broadcast division is several times slower on CPU.
    x = blocks.to(torch.float32, copy=True)
    x.div_(scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = x.to(torch.float8_e4m3fn).view(nr * block[0], nc * block[1])
    if q.shape != weight.shape:
        q = q[:rows, :cols].contiguous()
    return q, scale


def dequantize_block_fp8(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.bfloat16,
                         block: Sequence[int] = BLOCK, name: str = "weight") -> Tensor:
    """The weight an FP8 engine computes with: q * scale_inv per block, in `dtype`."""
    nr, nc = _blocks(q.shape, block) if q.dim() == 2 else (None, None)
    if q.dim() != 2 or tuple(scale_inv.shape) != (nr, nc):
        raise FP8Error(f"'{name}': scale_inv shape {list(scale_inv.shape)} does not fit weight "
                       f"{list(q.shape)} in {list(block)} blocks (expected [{nr}, {nc}])")
    fast = fp8_cpu.dequantize(q, scale_inv, dtype, block)
    if fast is not None:
        return fast
    return dequantize_block_fp8_torch(q, scale_inv, dtype, block)


def dequantize_block_fp8_torch(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.bfloat16,
                               block: Sequence[int] = BLOCK) -> Tensor:
    """dequantize_block_fp8 in torch operations (GPUs, other dtypes, CPUs without a compiler)."""
    nr, nc = _blocks(q.shape, block)
    rows, cols = q.shape
    w = _padded(q.float(), nr, nc, block).view(nr, block[0], nc, block[1])
    w = (w * scale_inv.float()[:, None, :, None]).view(nr * block[0], nc * block[1])
    return w[:rows, :cols].to(dtype)


def fake_quant_activation(x: Tensor, group: int = BLOCK[1]) -> Tensor:
    """Dynamic activation quantization of a block-FP8 linear layer (activation_scheme dynamic):
    per token, each group of `group` input features gets s = max(amax / 448, 2^-126) and the values
    e4m3(x / s) * s, returned in x's dtype (what the layer's FP8 GEMM effectively multiplies): the
    weight quantizer with [1, group] blocks, then its dequantization."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_block_fp8(flat, (1, group), "activation")
    return dequantize_block_fp8(q, scale, x.dtype, (1, group)).reshape(x.shape)


# ---------------------------------------------------------------------------------- streams

class FP8Transform:
    """`transform(named_tensors) -> named_tensors` for the weight sync (any mode, any bucketing):
    each linear `X.weight` becomes `X.weight` (e4m3) followed by `X.weight_scale_inv` (fp32);
    other tensors pass through, cast to `keep_dtype` when given. Lazy: one weight at a time."""

    def __init__(self, block: Sequence[int] = BLOCK, keep_dtype: Optional[torch.dtype] = None):
        self.block = tuple(int(b) for b in block)
        self.keep_dtype = keep_dtype

    def __call__(self, named_tensors: Iterable[tuple[str, Tensor]]
                 ) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in named_tensors:
            if name.endswith(SCALE_SUFFIX) or tensor.dtype == torch.float8_e4m3fn:
                raise FP8Error(f"FP8 transform: '{name}' is already quantized")
            if quantized_name(name, tuple(tensor.shape)):
                q, s = quantize_block_fp8(tensor, self.block, name)
                yield name, q
                yield name + SCALE_SUFFIX, s
            elif self.keep_dtype is not None and tensor.is_floating_point():
                yield name, tensor.detach().to(self.keep_dtype)
            else:
                yield name, tensor


def dequantize_stream(named_tensors: Iterable[tuple[str, Tensor]], dtype: torch.dtype,
                      block: Sequence[int] = BLOCK) -> Iterator[tuple[str, Tensor]]:
    """Plain (name, tensor) from a stream where FP8 weights come with their `_scale_inv` (in either
    order); other tensors pass through. An FP8 weight without its scale (or the reverse) is an
    error naming it."""
    weights: dict[str, Tensor] = {}
    scales: dict[str, Tensor] = {}
    for name, tensor in named_tensors:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in weights:
                yield base, dequantize_block_fp8(weights.pop(base), tensor, dtype, block, base)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, dequantize_block_fp8(tensor, scales.pop(name), dtype, block, name)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    left = [f"'{n}' (no {n}{SCALE_SUFFIX})" for n in weights] + \
           [f"'{n}{SCALE_SUFFIX}' (no {n})" for n in scales]
    if left:
        raise FP8Error(f"FP8 stream: unpaired tensors {', '.join(left[:4])}")


def fake_quant_fp8(named_tensors: Iterable[tuple[str, Tensor]], dtype: torch.dtype,
                   block: Sequence[int] = BLOCK) -> Iterator[tuple[str, Tensor]]:
    """What an FP8 engine computes with, from any stream: plain linear weights are quantized and
    dequantized, FP8 pairs dequantized, everything else passes through."""
    def quantize_plain():
        for name, tensor in named_tensors:
            if tensor.dtype != torch.float8_e4m3fn and not name.endswith(SCALE_SUFFIX) \
                    and quantized_name(name, tuple(tensor.shape)):
                q, s = quantize_block_fp8(tensor, block, name)
                yield name, dequantize_block_fp8(q, s, dtype, block, name)
            else:
                yield name, tensor
    return dequantize_stream(quantize_plain(), dtype, block)


def sync_transform(block: Sequence[int] = BLOCK):
    """The weight sync's per-bucket transform under rollout.fp8: plain linear weights are quantized
    exactly as FP8Transform (and so write_fp8_checkpoint) does; tensors already in the FP8 layout
    (e4m3 weights and their `_scale_inv`, e.g. versions the VersionStore saved quantized) pass."""
    quantize = FP8Transform(block)

    def transform(bucket: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        out: list[tuple[str, Tensor]] = []
        for name, tensor in bucket:
            if name.endswith(SCALE_SUFFIX) or tensor.dtype == torch.float8_e4m3fn:
                out.append((name, tensor))
            else:
                out.extend(quantize([(name, tensor)]))
        return out
    return transform


def check_fp8_stream(named_tensors: Iterable[tuple[str, Tensor]],
                     shapes: Mapping[str, Sequence[int]], block: Sequence[int] = BLOCK
                     ) -> Iterator[tuple[str, Tensor]]:
    """What a block-FP8 server accepts (`megapkl serve --quantization fp8`, like SGLang's FP8
    parameters): each quantized linear weight as e4m3 of the layer's shape, its `_scale_inv` as
    fp32 of the block grid's shape, every other weight not in e4m3. FP8Error names the weight;
    names the model does not have pass on (the engine refuses them with close matches)."""
    e4m3 = torch.float8_e4m3fn
    for name, tensor in named_tensors:
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        shape = shapes.get(base)
        quantized = shape is not None and quantized_name(base, tuple(shape))
        if name != base:
            if not quantized:
                raise FP8Error(f"weight '{name}': '{base}' is not a block-FP8 weight of this model")
            want = list(_blocks(shape, block))
            if tensor.dtype != torch.float32 or list(tensor.shape) != want:
                raise FP8Error(f"weight '{name}': expected float32 {want} (one scale per "
                               f"{list(block)} block of {list(shape)}), got {tensor.dtype} "
                               f"{list(tensor.shape)}")
        elif quantized and (tensor.dtype != e4m3 or list(tensor.shape) != list(shape)):
            raise FP8Error(f"weight '{name}': this server runs block FP8 and expects "
                           f"float8_e4m3fn {list(shape)} with '{name}{SCALE_SUFFIX}', got "
                           f"{tensor.dtype} {list(tensor.shape)}")
        elif not quantized and tensor.dtype == e4m3:
            raise FP8Error(f"weight '{name}': float8_e4m3fn for a weight this server keeps "
                           "unquantized")
        yield name, tensor


def byte_view(t: Tensor) -> Tensor:
    """`t` itself, or for a 1-byte float (FP8) the uint8 view of the same memory: gloo cannot
    broadcast FP8 dtypes, and the bytes on the wire are the same either way."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


# ---------------------------------------------------------------------------------- checkpoints

def unshared(tensor: Tensor, seen: set[int]) -> Tensor:
    """A contiguous CPU tensor owning its storage among those already written (safetensors refuses
    tensors sharing memory, e.g. a tied lm_head and embed_tokens)."""
    t = tensor.detach().contiguous().cpu()
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen:
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    seen.add(ptr)
    return t


def read_quantization_config(config: Mapping[str, Any], source: str = "config.json"
                             ) -> Optional[tuple[int, int]]:
    """The FP8 block of a HF config mapping (None when it is not quantized). Any other scheme is an
    error naming the key: megapkl never runs a quantized checkpoint as if it were BF16."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(qc, Mapping):
        raise FP8Error(f"{where} must be a mapping, got {type(qc).__name__}")
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    for key, want in expected.items():
        got = qc.get(key, want if key == "fmt" else None)
        if got != want:
            raise FP8Error(f"{where}.{key} is {got!r}: megapkl reads only block FP8 checkpoints "
                           "(quant_method fp8, fmt e4m3, activation_scheme dynamic, "
                           "weight_block_size [128, 128])")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise FP8Error(f"{where}.weight_block_size is {block!r}: expected two positive ints, "
                       "e.g. [128, 128]")
    return int(block[0]), int(block[1])


def write_fp8_checkpoint(directory: Union[str, os.PathLike],
                         named_tensors: Iterable[tuple[str, Tensor]], hf_config: Mapping[str, Any],
                         transform: Optional[FP8Transform] = None,
                         shard_bytes: int = 4 << 30) -> Path:
    """A HF FP8 checkpoint (sharded safetensors, index, config.json with quantization_config)
    from plain weights, quantized by `transform` exactly as the weight sync quantizes them."""
    from safetensors.torch import save_file

    transform = transform or FP8Transform()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    temp: list[Path] = []
    seen: set[int] = set()

    def flush() -> None:
        path = out / f".shard{len(temp):05d}.tmp"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        temp.append(path)

    for name, tensor in transform(named_tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][name] = unshared(tensor, seen)
        size += nbytes
    flush()
    weight_map = {}
    for i, path in enumerate(temp):
        final = f"model-{i + 1:05d}-of-{len(temp):05d}.safetensors"
        os.replace(path, out / final)
        weight_map.update({name: final for name in shards[i]})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = dict(hf_config)
    config["quantization_config"] = dict(QUANTIZATION_CONFIG,
                                         weight_block_size=list(transform.block))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
