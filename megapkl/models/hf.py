"""Hugging Face checkpoints (Qwen3, Qwen3-MoE, Llama 3.x) into and out of the sharded megatron model.

Import (`load_hf_weights`): every rank reads, with safetensors' lazy slices, only the rows or
columns its own TP/EP shard needs, so no rank ever holds a full checkpoint. The checkpoint is
checked against the architecture first (missing/unexpected tensors, shapes, config.json), with
errors that name the tensor or key.

Export (`export_hf_weights`): an iterator of (HF name, full tensor) in checkpoint order,
produced one layer (and, for MoE, one expert per EP rank) at a time: TP shards are
all-gathered, experts gathered over EP, and with `gather_pp=True` each tensor is broadcast from
the pipeline stage that owns it, so every rank sees the whole model in the same order while
holding at most one layer's tensors. It is a collective: all ranks of the model must consume
it in lockstep. `bucketed` groups it into size-bounded lists for weight sync. Yielded tensors may
alias live parameters (replicated ones such as norms): copy what you keep past the next update.

Process groups: TP, PP, EP come from the `ParallelGroups` passed in; the expert-tensor-parallel
group is not part of that bundle and is read from megatron's parallel_state.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megapkl.errors import MegapklError
from megapkl.parallel.chunks import model_chunks
from megapkl.models import hf_mapping as hm
from megapkl.models.spec import ModelSpec, SpecError, hf_config_dict, spec_from_hf_config
from megapkl.parallel.groups import group_device

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpointError(MegapklError, ValueError):
    """A checkpoint does not fit the model: the message names the tensor (and both shapes)."""


# ------------------------------------------------------------------ reading


class HFCheckpoint:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._handles: dict[str, Any] = {}
        if not self.path.exists():
            raise FileNotFoundError(f"Hugging Face checkpoint {self.path} does not exist")
        if not self.path.is_dir():
            raise FileNotFoundError(f"Hugging Face checkpoint {self.path} is not a directory")
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.path} "
                                        "(only safetensors checkpoints are supported)")
            weight_map = {}
            for file in files:
                for name in self._open(file.name).keys():
                    weight_map[name] = file.name
        self.weight_map: dict[str, str] = weight_map

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise HFCheckpointError(f"tensor {name!r} is missing from checkpoint {self.path}")
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, piece: hm.Piece) -> torch.Tensor:
        """The whole tensor, or the slice [start, stop) along dim 0 or 1."""
        sl = self._slice(piece.name)
        if piece.dim is None:
            return sl[:]
        if piece.dim == 0:
            return sl[piece.start:piece.stop]
        return sl[:, piece.start:piece.stop]

    def config(self) -> Optional[dict]:
        file = self.path / "config.json"
        return json.loads(file.read_text()) if file.is_file() else None


# Spec fields a config.json must agree on (shapes alone do not show rope/eps/routing choices).
_CONFIG_KEYS = ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "head_dim", "ffn_hidden_size", "qk_layernorm", "rope_theta",
                "rope_type", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "num_experts", "moe_router_topk",
                "moe_ffn_hidden_size", "moe_norm_topk_prob")


def check_checkpoint(spec: ModelSpec, ckpt: HFCheckpoint, check_config: bool = True) -> None:
    """Raise `HFCheckpointError` listing every way `ckpt` does not match `spec`."""
    problems: list[str] = []
    if check_config and ckpt.config() is not None:
        try:
            theirs = spec_from_hf_config(ckpt.config())
        except SpecError as exc:
            raise HFCheckpointError(f"{ckpt.path}/config.json: {exc}") from None
        for key in _CONFIG_KEYS:
            if getattr(theirs, key) != getattr(spec, key):
                problems.append(f"config key {key}: checkpoint has {getattr(theirs, key)!r}, "
                                f"model config {spec.name!r} has {getattr(spec, key)!r}")
    expected = hm.expected_hf_shapes(spec)
    present = ckpt.names()
    for name, shape in expected.items():
        if name not in present:
            problems.append(f"tensor {name} is missing")
        elif ckpt.shape(name) != shape:
            problems.append(f"tensor {name} has shape {list(ckpt.shape(name))} in the checkpoint "
                            f"but the model config expects {list(shape)}")
    ignorable = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    unexpected = sorted(present - set(expected) - ignorable)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        problems.append(f"{len(unexpected)} checkpoint tensor(s) the model config does not have: "
                        f"{shown}")
    if problems:
        head = f"checkpoint {ckpt.path} does not match model config {spec.name!r}:\n  - "
        raise HFCheckpointError(head + "\n  - ".join(problems[:20])
                              + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20
                                 else ""))


# ------------------------------------------------------------------ groups


@dataclasses.dataclass(frozen=True)
class _Comm:
    tp: Any
    etp: Any
    ep: Any
    pp: Any

    @staticmethod
    def rank(group: Any) -> int:
        return 0 if group is None else dist.get_rank(group)

    @staticmethod
    def size(group: Any) -> int:
        return 1 if group is None else dist.get_world_size(group)


def _comm(groups: Any) -> _Comm:
    if groups is None and not (dist.is_available() and dist.is_initialized()):
        return _Comm(None, None, None, None)
    from megatron.core import parallel_state as ps

    if groups is None:
        from megapkl.parallel.groups import ParallelGroups

        groups = ParallelGroups.from_megatron()
    pgc = getattr(groups, "pg_collection", None)   # megatron's explicit groups when carried
    etp = (pgc.expt_tp if pgc is not None
           else ps.get_expert_tensor_parallel_group(check_initialized=False))
    return _Comm(groups.tp, etp, groups.ep, groups.pp)




def _spec_of(chunks: list, spec: Optional[ModelSpec]) -> ModelSpec:
    spec = spec or getattr(chunks[0], "megapkl_spec", None)
    if spec is None:
        raise ValueError("pass spec=...: the model was not built by megapkl.models.provider")
    return spec


@dataclasses.dataclass(frozen=True)
class _Param:
    kind: str
    layer: Optional[int]  # global layer index
    expert: Optional[int]  # local expert index
    tensor: torch.Tensor


def _inventory(chunk: Any, spec: ModelSpec) -> list[_Param]:
    """Each parameter of a chunk with its kind and global layer index."""
    layers = chunk.decoder.layers
    out = []
    for name, param in chunk.named_parameters():
        kind = hm.classify(name)
        layer = None if kind.layer is None else layers[kind.layer].layer_number - 1
        out.append(_Param(kind.kind, layer, kind.expert, param))
    return out


def _shard_coords(comm: _Comm, kind: str) -> tuple[int, int, Any]:
    group = comm.etp if kind in hm.EXPERT_KINDS else comm.tp
    return comm.rank(group), comm.size(group), group


# ------------------------------------------------------------------ import


def load_hf_weights(model: Any, path: str | os.PathLike | HFCheckpoint, *,
                    spec: Optional[ModelSpec] = None, groups: Any = None,
                    check_config: bool = True) -> None:
    """Copy a HF checkpoint into this rank's shard of `model` (a GPTModel, wrapper or chunk list).

    Raises FileNotFoundError for a missing path and HFCheckpointError when the checkpoint does not
    fit the model config. `groups` is a `ParallelGroups` (default: megatron's).
    """
    chunks = model_chunks(model)
    spec = _spec_of(chunks, spec)
    ckpt = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    check_checkpoint(spec, ckpt, check_config=check_config)
    comm = _comm(groups)
    ep_rank = comm.rank(comm.ep)
    with torch.no_grad():
        for chunk in chunks:
            for p in _inventory(chunk, spec):
                expert = None
                if p.expert is not None:
                    local = spec.num_experts // comm.size(comm.ep)
                    expert = ep_rank * local + p.expert
                names = hm.hf_names(spec, p.kind, p.layer, expert)
                rank, size, _ = _shard_coords(comm, p.kind)
                padded = p.tensor.shape[0] * size
                pieces = hm.local_pieces(spec, p.kind, names, rank, size, padded)
                value = hm.fuse(spec, p.kind, [ckpt.read(x) for x in pieces], p.tensor.shape[0])
                if tuple(value.shape) != tuple(p.tensor.shape):
                    raise HFCheckpointError(
                        f"tensor(s) {names} give a shard of shape {list(value.shape)} but the "
                        f"megatron parameter ({p.kind}, layer {p.layer}) has shape "
                        f"{list(p.tensor.shape)}")
                p.tensor.copy_(value)


# ------------------------------------------------------------------ export


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    if _Comm.size(group) == 1:
        return [t]
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def _unit_of(p: _Param) -> Any:
    if p.kind in (hm.EMBED, hm.FINAL_NORM, hm.OUTPUT):
        return p.kind
    return p.layer


def _local_units(chunks: list, spec: ModelSpec) -> dict[Any, list[_Param]]:
    units: dict[Any, list[_Param]] = {}
    for chunk in chunks:
        for p in _inventory(chunk, spec):
            if p.kind == hm.OUTPUT and spec.tie_word_embeddings:
                continue  # a tied output layer is the embedding, exported once
            units.setdefault(_unit_of(p), []).append(p)
    return units


def _unit_order(spec: ModelSpec) -> list[Any]:
    order: list[Any] = [hm.EMBED, *range(spec.num_layers), hm.FINAL_NORM]
    return order + ([] if spec.tie_word_embeddings else [hm.OUTPUT])


def _export_unit(spec: ModelSpec, params: list[_Param], comm: _Comm
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors of one unit (embedding, a layer, final norm, output) held by this stage."""
    by_kind: dict[str, list[_Param]] = {}
    for p in params:
        by_kind.setdefault(p.kind, []).append(p)
    kinds = [params[0].kind] if params[0].layer is None else hm.layer_kinds(spec)
    for kind in kinds:
        if kind == hm.EXPERT_FC2:
            continue  # exported with EXPERT_FC1, expert by expert
        if kind == hm.EXPERT_FC1:
            yield from _export_experts(spec, by_kind, comm)
            continue
        (p,) = by_kind[kind]
        _, _, group = _shard_coords(comm, kind)
        shards = _all_gather(p.tensor.detach(), group) if kind in hm.SPLIT_DIM else [p.tensor]
        yield from hm.unshard(spec, kind, [s.detach() for s in shards],
                              hm.hf_names(spec, kind, p.layer))


def _export_experts(spec: ModelSpec, by_kind: dict[str, list[_Param]], comm: _Comm
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    fc1 = sorted(by_kind[hm.EXPERT_FC1], key=lambda p: p.expert)
    fc2 = sorted(by_kind[hm.EXPERT_FC2], key=lambda p: p.expert)
    local = len(fc1)
    for w1, w2 in zip(fc1, fc2):
        # One local expert index at a time: ep_size experts in memory, not the whole layer.
        full1 = _gather_expert(spec, hm.EXPERT_FC1, w1, comm)
        full2 = _gather_expert(spec, hm.EXPERT_FC2, w2, comm)
        for ep_rank, (a, b) in enumerate(zip(full1, full2)):
            expert = ep_rank * local + w1.expert
            gate, up, down = hm.hf_names(spec, hm.EXPERT_FC1, w1.layer, expert) + \
                hm.hf_names(spec, hm.EXPERT_FC2, w1.layer, expert)
            yield from hm.unshard(spec, hm.EXPERT_FC1, a, [gate, up])
            yield from hm.unshard(spec, hm.EXPERT_FC2, b, [down])


def _gather_expert(spec: ModelSpec, kind: str, p: _Param, comm: _Comm
                   ) -> list[list[torch.Tensor]]:
    """[ep rank][etp rank] shards of the local expert `p.expert` of every EP rank."""
    etp_shards = _all_gather(p.tensor.detach(), comm.etp)
    stacked = torch.stack(etp_shards)  # one EP gather carries all ETP shards
    return [list(t.unbind(0)) for t in _all_gather(stacked, comm.ep)]


def export_hf_weights(model: Any, *, spec: Optional[ModelSpec] = None, groups: Any = None,
                      gather_pp: bool = True, dtype: Optional[torch.dtype] = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, one layer at a time (collective).

    `gather_pp=False`: each pipeline stage yields only the tensors it holds (no PP traffic).
    `dtype` converts on the way out (e.g. bf16 for a rollout engine).
    """
    chunks = model_chunks(model)
    spec = _spec_of(chunks, spec)
    comm = _comm(groups)
    units = _local_units(chunks, spec)
    owners = _owners(units, comm) if gather_pp else None
    pp_rank = comm.rank(comm.pp)
    shapes = hm.expected_hf_shapes(spec)
    wire_dtype = next(iter(units.values()))[0].tensor.dtype
    wire_device = group_device(comm.pp) if _Comm.size(comm.pp) > 1 else None
    for unit in _unit_order(spec):
        if owners is None:
            if unit in units:
                yield from _cast(_export_unit(spec, units[unit], comm), dtype)
            continue
        owner = owners[unit]
        if owner == pp_rank:
            produced = _export_unit(spec, units[unit], comm)
        else:
            # Receive buffers on the pipeline group's device (NCCL: this rank's GPU).
            produced = ((name, torch.empty(shapes[name], dtype=wire_dtype, device=wire_device))
                        for name in _unit_names(spec, unit, _Comm.size(comm.ep)))
        src = dist.get_global_rank(comm.pp, owner) if comm.pp is not None else 0
        for name, tensor in produced:
            if _Comm.size(comm.pp) > 1:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=src, group=comm.pp)
            yield name, (tensor if dtype is None else tensor.to(dtype))


def _cast(items: Iterable[tuple[str, torch.Tensor]], dtype: Optional[torch.dtype]):
    for name, tensor in items:
        yield name, (tensor if dtype is None else tensor.to(dtype))


def _unit_names(spec: ModelSpec, unit: Any, ep_size: int) -> list[str]:
    """HF names of a unit in the order `_export_unit` yields them."""
    if not isinstance(unit, int):
        return hm.hf_names(spec, unit)
    names: list[str] = []
    for kind in hm.layer_kinds(spec):
        if kind == hm.EXPERT_FC2:
            continue
        if kind != hm.EXPERT_FC1:
            names += hm.hf_names(spec, kind, unit)
            continue
        local = spec.num_experts // ep_size
        for i in range(local):  # the order of _export_experts
            for ep_rank in range(ep_size):
                expert = ep_rank * local + i
                names += hm.hf_names(spec, hm.EXPERT_FC1, unit, expert)
                names += hm.hf_names(spec, hm.EXPERT_FC2, unit, expert)
    return names


def _owners(units: dict[Any, list[_Param]], comm: _Comm) -> dict[Any, int]:
    """Pipeline rank holding each unit (the lowest one if several do)."""
    if _Comm.size(comm.pp) == 1:
        return {unit: 0 for unit in units}
    held = [None] * _Comm.size(comm.pp)
    dist.all_gather_object(held, sorted(units, key=str), group=comm.pp)
    owners: dict[Any, int] = {}
    for rank, names in enumerate(held):
        for unit in names:
            owners.setdefault(unit, rank)
    return owners


def bucketed(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20,
             joins: Optional[Callable[[str], bool]] = None
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (one oversize tensor
    forms its own bucket); a name for which `joins(name)` stays in its predecessor's bucket."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes and not (joins and joins(name)):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# What an export carries over from the checkpoint the run started from: its special token ids
# (LlamaConfig would otherwise default to BOS 1 / EOS 2), its generation config (Llama-3.2-Instruct
# lists its three stop ids there) and its tokenizer, so that the export is served as it was.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


def _carried(source: Optional[str | os.PathLike]) -> tuple[dict, list[Path]]:
    """(token id keys of the source's config.json, the source's files to copy)."""
    if not source or not Path(source).is_dir():
        return {}, []
    config = Path(source) / "config.json"
    ids = json.loads(config.read_text()) if config.is_file() else {}
    return ({k: ids[k] for k in TOKEN_ID_KEYS if ids.get(k) is not None},
            [Path(source) / f for f in CARRIED_FILES if (Path(source) / f).is_file()])


def save_hf_checkpoint(model: Any, path: str | os.PathLike, *, spec: Optional[ModelSpec] = None,
                       groups: Any = None, dtype: Optional[torch.dtype] = None,
                       shard_bytes: int = 2 << 30, writer_rank: int = 0,
                       source: Optional[str | os.PathLike] = None) -> None:
    """Export to a HF safetensors directory (collective; global rank `writer_rank` writes).
    `source`: the Hugging Face checkpoint the run started from, whose token ids, generation
    config and tokenizer files the export carries."""
    import shutil

    from safetensors.torch import save_file

    chunks = model_chunks(model)
    spec = _spec_of(chunks, spec)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    out = Path(path)
    writes = rank == writer_rank
    if writes:
        out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    items = export_hf_weights(chunks, spec=spec, groups=groups, dtype=dtype)
    files = []
    for i, bucket in enumerate(bucketed(items, shard_bytes)):
        if not writes:
            continue
        file = f"model-{i + 1:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in bucket}, str(out / file),
                  metadata={"format": "pt"})
        files.append(file)
        weight_map.update({n: file for n, _ in bucket})
    if not writes:
        return
    torch_dtype = str(dtype or next(iter(chunks[0].parameters())).dtype).replace("torch.", "")
    ids, files = _carried(source)
    (out / "config.json").write_text(json.dumps(hf_config_dict(spec, torch_dtype, **ids),
                                                indent=2))
    for file in files:
        shutil.copyfile(file, out / file.name)
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                             indent=2))
