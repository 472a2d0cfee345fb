"""The training data path: the engine's Samples -> `MicroBatch` (the one packed representation,
built once per minibatch, moved to the device once) -> context-parallel shards -> the loss's
`TokenBatch` view of the local action tokens.

Micro-batches hold a fixed number of responses (`parallel.micro_batch_size`) or a token budget
(`parallel.max_tokens_per_micro_batch`, first-fit decreasing: `plan_by_tokens`).

Layout "bshd": one row per response (prompt + response, right-padded), so every row starts at position 0 and
megatron's RoPE and causal masking need no packing metadata:

    tokens     [b, S]  prompt ids, response ids, then `pad_id`
    labels     [b, S]  labels[i] = tokens[i + 1] on the FULL sequence, before any CP sharding
    loss_mask  [b, S]  True at the label positions of action tokens
    action_pos [b, S]  1-based position of that action token among its response's action
                       tokens (0 elsewhere)
    detached per-action-token fields (logp_behav, logp_prox, logp_init, topk_ids,
    topk_logp_behav) placed at the same label positions: response token r of a response with a
    P-token prompt is predicted by the logits at position P - 1 + r.

A multi-turn response interleaves actions with observations (`Sample.segments`): every token is
fed through the model (the observations are context for the next turn), but only action tokens
get a label, a loss-mask bit and an action position, and the per-action-token fields (one row per
action token in the Sample) are scattered to those positions alone. So the loss's `TokenBatch`
holds action tokens only, with positions 1..T_m counting action tokens (T_m = A): every
objective, normalizer and future-KL window skips observations by construction.

Why the shift must happen before sharding (the classic CP bug): CP rank r holds chunks r and
2cp-1-r of the sequence, so the local token after the last one of chunk r is the first of chunk
2cp-1-r, not the first of chunk r+1. Shifting the local tokens would pair the boundary logits with
the wrong next token.

S is a multiple of `pad_multiple(cp, tp, sequence_parallel)` = 2*cp (times tp with sequence
parallelism) so the 2*cp chunks (and the SP split of each) are equal. `shard_for_cp` applies
Megatron's load-balanced layout (`megatron.core.utils.get_batch_on_this_cp_rank` semantics) to
every [b, S, ...] tensor; per-response tensors (full lengths, advantages, group, uid) stay whole.
`token_batch` then lists this rank's action tokens in response order as a `TokenBatch`; a
response may have no local action token on a CP rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor

from megapkl.objectives.batch import TokenBatch

# Per-action-token detached fields of a micro-batch: name -> the Sample attribute it is read from.
SAMPLE_FIELDS = {"logp_behav": "logp_behav", "logp_prox": "logp_prox", "logp_init": "logp_init",
                 "topk_ids": "topk_ids", "topk_logp_behav": "topk_logp"}
TOKEN_FIELDS = tuple(SAMPLE_FIELDS)


class PackableSample(Protocol):
    """What packing reads from a response: `megapkl.rollout.sample.Sample` (the engine's type,
    with `advantage` set by the rollout stage and a per-batch `logp_prox` by the reference
    policies, megapkl.train.references)."""

    uid: int
    group_id: int
    prompt_ids: Tensor
    response_ids: Tensor
    action_mask: Tensor      # [R] bool (all True for a single-turn response)
    num_actions: int         # A = action_mask.sum()
    logp_behav: Tensor
    advantage: Optional[float]
    logp_prox: Optional[Tensor]
    logp_init: Optional[Tensor]
    topk_ids: Optional[Tensor]
    topk_logp: Optional[Tensor]
    routed_experts: Optional[Tensor]


@dataclass
class MicroBatch:
    """Megatron inputs of one micro-batch (full sequence, or one CP rank's shard of it): the one
    packed representation between the engine's Samples and the loss's `TokenBatch` view.

    Rows >= `num_responses` are padding rows (no action tokens), used to give every micro-batch
    of a pipeline-parallel step (or of every DP rank under the MoE all-gather dispatcher) the
    same [b, S].
    """

    tokens: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Tensor
    action_pos: Tensor
    lengths: Tensor          # [b] T_m, full responses' action tokens (0 for padding rows)
    advantages: Tensor       # [b]
    group: Tensor            # [b] prompt-group ids
    uid: Tensor              # [b] global response ids
    num_responses: int
    seq_length: int          # S of the full sequence (before CP sharding)
    fields: dict[str, Tensor] = field(default_factory=dict)   # TOKEN_FIELDS at label positions
    cp_rank: int = 0
    cp_size: int = 1
    # [b, S, L, k] experts to replay over the FULL sequence (R3), or None. Not CP-sharded here:
    # megapkl.parallel.replay slices it for the rank's CP chunks, TP/SP part and PP layers.
    routed: Optional[Tensor] = None
    # THD packing (`pack_thd`): the micro-batch is ONE row holding every response back to back,
    # each padded to a multiple of 2*cp. cu_seqlens_padded [n+1] int32 are the segment bounds in
    # the FULL row (Megatron/TE convention: global, before CP sharding), cu_seqlens [n+1] the
    # bounds of the unpadded prompt + response lengths, segment [1, S] the response index of
    # every position (-1 for padding). All None for the one-row-per-response (BSHD) layout.
    cu_seqlens: Optional[Tensor] = None
    cu_seqlens_padded: Optional[Tensor] = None
    segment: Optional[Tensor] = None

    @property
    def is_thd(self) -> bool:
        """One packed row with cu_seqlens (`pack_thd`), not one response per row."""
        return self.cu_seqlens_padded is not None

    @property
    def num_action_tokens(self) -> int:
        """Action tokens in this (shard of the) micro-batch."""
        return int(self.loss_mask.sum())

    def to(self, device) -> "MicroBatch":
        """Every tensor on `device` (the one place batches move to the GPU: `Learner.pack`)."""
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        out = {f.name: mv(getattr(self, f.name)) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, fields={k: mv(v) for k, v in self.fields.items()}, **out)


def pad_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Sequence length granularity: 2*cp equal CP chunks, each split over TP under SP."""
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def seq_len(s: PackableSample) -> int:
    """prompt + response tokens of one sample."""
    return int(s.prompt_ids.numel() + s.response_ids.numel())


# ----------------------------------------------------------------------------- packing

def check_samples(samples: Sequence[PackableSample], who: str) -> None:
    """The validation `pack` and `pack_thd` share: non-empty prompts and responses, an
    advantage, one row per action token in every carried field, consistent R3 routing."""
    if not samples:
        raise ValueError(f"{who}: no samples")
    first = samples[0]
    for s in samples:
        p, t = s.prompt_ids.numel(), s.response_ids.numel()
        if p < 1:
            raise ValueError(f"{who}: sample uid={s.uid} has an empty prompt; the first action "
                             "token needs a preceding token to be predicted from")
        a = s.num_actions
        if t < 1 or a < 1:
            raise ValueError(f"{who}: sample uid={s.uid} has no action tokens")
        if getattr(s, "advantage", None) is None:
            raise ValueError(f"{who}: sample uid={s.uid} has no advantage (set by the rollout stage)")
        for name, attr in SAMPLE_FIELDS.items():
            value, ref = getattr(s, attr, None), getattr(first, attr, None)
            if (ref is None) != (value is None) or (value is not None and value.shape[0] != a):
                raise ValueError(f"{who}: sample uid={s.uid}: {name} must have {a} rows (one per "
                                 f"action token) like every sample of the batch, got "
                                 f"{None if value is None else list(value.shape)}")
        _check_routed(s, first, who)


def _check_routed(s: PackableSample, first: PackableSample, who: str) -> None:
    if first.routed_experts is None and s.routed_experts is None:
        return
    rows = seq_len(s) - 1
    want = (rows, *first.routed_experts.shape[1:]) if first.routed_experts is not None else None
    if want is None or s.routed_experts is None or tuple(s.routed_experts.shape) != want:
        raise ValueError(f"{who}: sample uid={s.uid}: routed_experts must be [{rows}, layers, k] "
                         "(prompt + response - 1 rows) on every sample, got "
                         f"{None if s.routed_experts is None else list(s.routed_experts.shape)}")


def _fill(samples: Sequence[PackableSample], rows: Sequence[int], offsets: Sequence[int],
          b: int, s: int, pad_id: int) -> dict[str, Any]:
    """Place every sample at (row, offset) of [b, S] buffers; labels shifted per sequence.

    One scatter per buffer over every sample's positions (a micro-batch's samples, a few tensor
    ops each, were most of packing's time): position j of sample i (prompt p_i + response t_i
    tokens) sits at (rows[i], offsets[i] + j); its label is token j + 1 of the same sequence;
    the action labels are the j whose next token is an action token of the response (j = p_i -
    1 .. p_i + t_i - 2 when every response token is one)."""
    prompt = [int(x.prompt_ids.numel()) for x in samples]
    length = torch.tensor([p + int(x.response_ids.numel()) for p, x in zip(prompt, samples)])
    # built on the host, moved to the device with the micro-batch (a sample may hold either)
    seq = torch.cat([t.cpu() for x in samples for t in (x.prompt_ids, x.response_ids)]
                    ).to(torch.int64)
    n = len(samples)  # `rows` and `offsets` may go on (a THD row's trailing padding segment)
    at_row = torch.tensor(list(rows)[:n], dtype=torch.int64).repeat_interleave(length)
    starts = (torch.cumsum(length, 0) - length).repeat_interleave(length)
    j = torch.arange(seq.numel()) - starts
    at_col = torch.tensor(list(offsets)[:n], dtype=torch.int64).repeat_interleave(length) + j
    labelled = j < length.repeat_interleave(length) - 1          # every position but the last
    action = labelled & _next_is_action(samples, prompt, seq.numel())
    # 1-based rank of each action label among its sequence's action labels
    rank = torch.cumsum(action, 0)
    rank = rank - (rank - action.long()).index_select(0, torch.cumsum(length, 0) - length
                                                      ).repeat_interleave(length)
    ac_row, ac_col = at_row[action], at_col[action]

    tokens = torch.full((b, s), pad_id, dtype=torch.int64)
    tokens[at_row, at_col] = seq
    labels = torch.zeros(b, s, dtype=torch.int64)
    labels[ac_row, ac_col] = seq[1:][action[:-1]]  # only action positions keep a label
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[ac_row, ac_col] = True
    action_pos = torch.zeros(b, s, dtype=torch.int64)
    action_pos[ac_row, ac_col] = rank[action]
    first = samples[0]
    fields = {}
    for name, attr in SAMPLE_FIELDS.items():
        ref = getattr(first, attr)
        if ref is None:
            continue
        fields[name] = torch.zeros((b, s, *ref.shape[1:]), dtype=ref.dtype)
        fields[name][ac_row, ac_col] = torch.cat([getattr(x, attr).cpu().to(ref.dtype)
                                                  for x in samples])
    routed = None
    if first.routed_experts is not None:
        layers, k = first.routed_experts.shape[1:]
        # Rows the engine did not report (each sequence's last token, padding) route to experts
        # 0..k-1: their outputs feed no loss term (causal attention keeps them out of earlier tokens).
        routed = torch.arange(k, dtype=torch.int64).expand(b, s, layers, k).clone()
        routed[at_row[labelled], at_col[labelled]] = torch.cat(
            [x.routed_experts.cpu().to(torch.int64) for x in samples])
    m = len(samples)
    pad = max(b - m, 0)   # BSHD padding rows; a THD row holds all m responses
    per_resp = lambda vals, dtype: torch.cat([torch.tensor(vals, dtype=dtype),  # noqa: E731
                                             torch.zeros(pad, dtype=dtype)])
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, action_pos=action_pos,
                fields=fields, routed=routed, num_responses=m,
                lengths=per_resp([int(x.num_actions) for x in samples], torch.int64),
                advantages=per_resp([float(x.advantage) for x in samples], torch.float32),
                group=per_resp([int(x.group_id) for x in samples], torch.int64),
                uid=per_resp([int(x.uid) for x in samples], torch.int64))


def _next_is_action(samples: Sequence[PackableSample], prompt: Sequence[int], total: int
                    ) -> Tensor:
    """[total] bool over the concatenated sequences: is token j + 1 of the same sequence an
    action token? (The last position of a sequence reads the next sequence's first token: the
    caller masks it with `labelled`.)"""
    is_action = torch.cat([t for p, x in zip(prompt, samples)
                           for t in (torch.zeros(p, dtype=torch.bool), x.action_mask.cpu())])
    return torch.cat([is_action[1:], is_action.new_zeros(1)])


def pack(samples: Sequence[PackableSample], multiple: int, *, seq_length: Optional[int] = None,
         rows: Optional[int] = None, pad_id: int = 0) -> MicroBatch:
    """Right-padded [rows, S] megatron inputs of `samples`, labels shifted on the full sequence.

    S = `seq_length` if given (must fit and be a multiple of `multiple`), else the longest
    prompt + response rounded up to `multiple`. `rows` >= len(samples) adds padding rows.
    """
    check_samples(samples, "pack")
    b = len(samples) if rows is None else rows
    if b < len(samples):
        raise ValueError(f"pack: rows={rows} < {len(samples)} samples")
    longest = max(seq_len(x) for x in samples)
    s = round_up(longest, multiple) if seq_length is None else seq_length
    if s < longest or s % multiple:
        raise ValueError(f"pack: seq_length {s} must be >= {longest} and a multiple of {multiple}")
    parts = _fill(samples, range(len(samples)), [0] * len(samples), b, s, pad_id)
    return MicroBatch(position_ids=torch.arange(s).expand(b, s).clone(), seq_length=s, **parts)


def pack_groups(groups: Sequence[Sequence[PackableSample]], multiple: int, pad_id: int = 0
                ) -> list[MicroBatch]:
    """`[pack(g, multiple, pad_id=pad_id) for g in groups]`, the same tensors, from one fill of
    every sample: each micro-batch is its own rows of that fill, cut to its own length and
    copied out. A fill per micro-batch (tens of small tensor operations each) was most of
    packing's time."""
    for g in groups:
        if not g:
            raise ValueError("pack: no samples")
    flat = [x for g in groups for x in g]
    check_samples(flat, "pack")
    widths = [round_up(max(seq_len(x) for x in g), multiple) for g in groups]
    parts = _fill(flat, range(len(flat)), [0] * len(flat), len(flat), max(widths), pad_id)
    out, start = [], 0
    for g, s in zip(groups, widths):
        rows = slice(start, start + len(g))
        start += len(g)
        cut = lambda t: t[rows, :s].clone(memory_format=torch.contiguous_format)  # noqa: E731
        own = lambda t: t[rows].clone()  # noqa: E731
        out.append(MicroBatch(
            tokens=cut(parts["tokens"]), labels=cut(parts["labels"]),
            loss_mask=cut(parts["loss_mask"]), action_pos=cut(parts["action_pos"]),
            fields={k: cut(v) for k, v in parts["fields"].items()},
            routed=None if parts["routed"] is None else cut(parts["routed"]),
            num_responses=len(g), lengths=own(parts["lengths"]),
            advantages=own(parts["advantages"]), group=own(parts["group"]), uid=own(parts["uid"]),
            position_ids=torch.arange(s).expand(len(g), s).clone(), seq_length=s))
    return out


def split_responses(responses: Sequence, num_micro: int) -> list[list]:
    """Contiguous, near-equal split into `num_micro` micro-batches (the first get the extra)."""
    if not 1 <= num_micro <= len(responses):
        raise ValueError(f"split_responses: cannot split {len(responses)} responses into {num_micro}")
    base, extra = divmod(len(responses), num_micro)
    out, start = [], 0
    for i in range(num_micro):
        n = base + (i < extra)
        out.append(list(responses[start:start + n]))
        start += n
    return out


def make_micro_batches(samples: Sequence[PackableSample], parts: Union[int, Sequence[Sequence[int]]],
                       multiple: int, *, same_shape: bool = False, shape: Optional[tuple[int, int]] = None,
                       pad_id: int = 0, layout: str = "bshd") -> list[MicroBatch]:
    """Pack `samples` into micro-batches. `parts` is a number of contiguous near-equal
    micro-batches or an explicit plan (lists of sample indices, e.g. `plan_by_tokens`).
    `same_shape=True` pads every micro-batch to one [b, S] (pipeline parallelism sends
    activations of a fixed shape between stages); `shape` = (rows, S) pads to a given larger
    shape (agreed across ranks, `micro_batch_shape`).

    layout="bshd" (default): one response per row (`pack`). layout="thd": each micro-batch is
    one packed row with cu_seqlens (`pack_thd`); `multiple` is then the per-sequence padding
    (`pad_multiple(cp, tp, sp)`), and `same_shape` pads every row to one total length."""
    if layout not in ("bshd", "thd"):
        raise ValueError(f"make_micro_batches: layout must be 'bshd' or 'thd', got {layout!r}")
    if isinstance(parts, int):
        groups = split_responses(samples, parts)
    else:
        groups = [[samples[i] for i in part] for part in parts]
    if shape is None and same_shape:
        shape = micro_batch_shape(groups, multiple, layout)
    if layout == "thd":
        return [pack_thd(p, multiple, total_length=None if shape is None else shape[1], pad_id=pad_id)
                for p in groups]
    if shape is None:
        return pack_groups(groups, multiple, pad_id=pad_id)
    return [pack(p, multiple, seq_length=shape[1], rows=shape[0], pad_id=pad_id) for p in groups]


def micro_batch_shape(groups: Sequence[Sequence[PackableSample]], multiple: int,
                      layout: str) -> tuple[int, int]:
    """(rows, S) that holds every micro-batch of `groups` in `layout`."""
    if layout == "thd":
        return 1, max(thd_length(p, multiple) for p in groups)
    longest = max(seq_len(x) for p in groups for x in p)
    return max(len(p) for p in groups), round_up(longest, multiple)


# ----------------------------------------------------------------------------- context parallel

def cp_slice(x: Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> Tensor:
    """Chunks cp_rank and 2cp-1-cp_rank of 2*cp equal chunks along `dim` (Megatron's layout)."""
    if cp_size == 1:
        return x
    n = x.shape[dim]
    if n % (2 * cp_size):
        raise ValueError(f"cp_slice: length {n} is not a multiple of 2*cp = {2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def shard_for_cp(mb: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """This CP rank's shard: every per-position tensor sliced, per-response tensors kept whole.
    A THD micro-batch is sliced per packed sequence (`thd_cp_index`)."""
    if mb.cp_size != 1:
        raise ValueError("shard_for_cp: micro-batch is already a CP shard")
    if mb.is_thd:
        return _shard_thd(mb, cp_rank, cp_size)
    sl = lambda t: cp_slice(t, cp_rank, cp_size, dim=1)  # noqa: E731
    return dataclasses.replace(
        mb, tokens=sl(mb.tokens), position_ids=sl(mb.position_ids), labels=sl(mb.labels),
        loss_mask=sl(mb.loss_mask), action_pos=sl(mb.action_pos),
        fields={k: sl(v) for k, v in mb.fields.items()}, cp_rank=cp_rank, cp_size=cp_size)


# ----------------------------------------------------------------------------- action tokens

def action_labels(mb: MicroBatch) -> Tensor:
    """[N] sampled token ids of the local action tokens, in `token_batch` order."""
    return mb.labels[mb.loss_mask]


def action_topk_ids(mb: MicroBatch) -> Optional[Tensor]:
    """[N, K] behavior top-K ids of the local action tokens, or None."""
    ids = mb.fields.get("topk_ids")
    return None if ids is None else ids[mb.loss_mask]


def action_values(mb: MicroBatch, per_position: Tensor) -> Tensor:
    """Select the local action tokens of a [b, S_local, ...] tensor (e.g. logits), in order."""
    return per_position[mb.loss_mask]


def action_rows(mb: MicroBatch) -> Tensor:
    """[N] response index (row of the per-response tensors) of each local action token, in
    `token_batch` order: the row for one-response-per-row batches, the packed segment for THD."""
    if mb.is_thd:
        return mb.segment[mb.loss_mask]
    return mb.loss_mask.nonzero(as_tuple=True)[0]


def token_batch(mb: MicroBatch, logp: Tensor, *, topk_logp: Optional[Tensor] = None,
                entropy: Optional[Tensor] = None, step: int = 0) -> TokenBatch:
    """The local action tokens as a `TokenBatch` in response order (row-major over the mask).

    Within a row the local columns are chunk r then chunk 2cp-1-r, both increasing in global
    position, so row-major order is response order with increasing positions. A THD row holds
    sequence 0's two chunks, then sequence 1's, ...: again response order. `logp`,
    `topk_logp`, `entropy` are [N] / [N, K] in the same order (e.g. computed from
    `action_values(mb, logits)`).
    """
    mask = mb.loss_mask
    rows = action_rows(mb)
    m = mb.num_responses
    f = {k: v[mask] for k, v in mb.fields.items()}
    # The loss runs in fp32 (or fp64) whatever the model's dtype: bf16 log-probs are upcast
    # (the vocab-parallel op already returns fp32 from bf16 logits).
    logp, topk_logp, entropy = _fp32(logp), _fp32(topk_logp), _fp32(entropy)
    dtype = logp.dtype
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return TokenBatch(
        logp=logp, logp_behav=cast(f["logp_behav"]), advantages=mb.advantages.to(dtype)[rows],
        response_index=rows, group_index=mb.group[:m], positions=mb.action_pos[mask],
        logp_prox=cast(f.get("logp_prox")), logp_init=cast(f.get("logp_init")),
        token_ids=mb.labels[mask], topk_ids=f.get("topk_ids"),
        topk_logp_behav=cast(f.get("topk_logp_behav")), topk_logp=topk_logp,
        response_uid=mb.uid[:m], step=step, entropy=entropy)


def _fp32(t: Optional[Tensor]) -> Optional[Tensor]:
    return t if t is None or t.dtype in (torch.float32, torch.float64) else t.float()


def response_lengths(mb: MicroBatch) -> Tensor:
    """[M] full T_m of the micro-batch's responses (for `LossContext.response_lengths`)."""
    return mb.lengths[:mb.num_responses]



# ----------------------------------------------------------------------------- THD packing

# Several responses in ONE row, Megatron/Transformer Engine's packed ("thd") format:
#
#     tokens [1, S]  response 0 (prompt + response, padded to a multiple of 2*cp), response 1, ...
#     cu_seqlens_padded [n+1] int32  segment bounds in the full row; cu_seqlens [n+1] the bounds
#                    of the unpadded lengths (segment i holds cu_seqlens[i+1]-cu_seqlens[i] real
#                    tokens starting at cu_seqlens_padded[i])
#     position_ids   restart at 0 in every segment (megatron's THD RoPE restarts per segment)
#     labels         shifted within each sequence, on the full row, before any CP sharding
#
# Context parallelism (TE's THD layout, `thd_cp_index`): every segment is cut into 2*cp equal
# chunks and CP rank r holds chunks r and 2cp-1-r OF EACH SEGMENT, segment after segment, so
# each rank holds S / cp tokens and the same share of every response. The model gets megatron's
# `PackedSeqParams(qkv_format="thd", ...)` (`thd_packed_seq_params`); the attention is causal
# within a segment and never crosses segments (`megapkl.parallel.cp_attention`).

def thd_length(samples: Sequence[PackableSample], multiple: int) -> int:
    """Packed row length of `samples` (each prompt + response rounded up to `multiple`)."""
    return sum(round_up(seq_len(x), multiple) for x in samples)


def thd_cp_index(cu_seqlens_padded: Tensor, cp_rank: int, cp_size: int) -> Tensor:
    """[S / cp] positions in the full packed row held by `cp_rank`: chunks r and 2cp-1-r of each
    segment (TE's `thd_get_partitioned_indices` layout), in local order."""
    bounds = [int(x) for x in cu_seqlens_padded.tolist()]
    dev = cu_seqlens_padded.device
    if cp_size == 1:
        return torch.arange(bounds[-1], dtype=torch.int64, device=dev)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (b - a) % (2 * cp_size):
            raise ValueError(f"thd_cp_index: segment [{a}, {b}) is not a multiple of 2*cp = {2 * cp_size}")
        c = (b - a) // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(torch.arange(a + k * c, a + (k + 1) * c, dtype=torch.int64, device=dev))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=dev)


def pack_thd(samples: Sequence[PackableSample], multiple: int, *, total_length: Optional[int] = None,
             pad_id: int = 0) -> MicroBatch:
    """One packed [1, S] row of `samples` with cu_seqlens (THD), labels shifted per sequence.

    Each prompt + response is padded to a multiple of `multiple` (`pad_multiple(cp, tp, sp)`).
    `total_length` (a multiple of `multiple`, >= the packed length) appends one padding segment
    so that every micro-batch of a pipeline-parallel step has the same S.
    """
    check_samples(samples, "pack_thd")
    lens = [seq_len(x) for x in samples]
    padded = [round_up(n, multiple) for n in lens]
    s = sum(padded)
    if total_length is not None:
        if total_length < s or total_length % multiple:
            raise ValueError(f"pack_thd: total_length {total_length} must be >= {s} and a multiple "
                             f"of {multiple}")
        if total_length > s:
            lens.append(0)
            padded.append(total_length - s)
            s = total_length
    starts = [0]
    for n in padded:
        starts.append(starts[-1] + n)
    parts = _fill(samples, [0] * len(samples), starts[:-1], 1, s, pad_id)
    position_ids = torch.zeros(1, s, dtype=torch.int64)
    segment = torch.full((1, s), -1, dtype=torch.int64)
    for i, (start, n) in enumerate(zip(starts[:-1], padded)):
        position_ids[0, start:start + n] = torch.arange(n)
        if i < len(samples):
            segment[0, start:start + n] = i
    # cu_seqlens in TE's padded convention: segment i's real tokens are [cu_padded[i],
    # cu_padded[i] + (cu[i+1] - cu[i])), i.e. the unpadded lengths' cumulative sum.
    real = torch.tensor(lens, dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(real, 0).to(torch.int32)])
    return MicroBatch(position_ids=position_ids, seq_length=s, cu_seqlens=cu,
                      cu_seqlens_padded=torch.tensor(starts, dtype=torch.int32), segment=segment,
                      **parts)


def _shard_thd(mb: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """CP shard of a packed row: chunks r and 2cp-1-r of every segment; cu_seqlens stay global
    (megatron's THD RoPE and the attention read the full-row bounds)."""
    idx = thd_cp_index(mb.cu_seqlens_padded, cp_rank, cp_size)
    sl = lambda t: t.index_select(1, idx)  # noqa: E731
    return dataclasses.replace(
        mb, tokens=sl(mb.tokens), position_ids=sl(mb.position_ids), labels=sl(mb.labels),
        loss_mask=sl(mb.loss_mask), action_pos=sl(mb.action_pos), segment=sl(mb.segment),
        fields={k: sl(v) for k, v in mb.fields.items()}, cp_rank=cp_rank, cp_size=cp_size,
        routed=None if mb.routed is None else thd_routed_for_replay(mb.routed, mb.cu_seqlens_padded,
                                                                     cp_size))


def thd_routed_for_replay(routed: Tensor, cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """The packed row's [1, S, ...] replay targets reordered so that the BSHD slicing done by
    `megapkl.parallel.replay` (chunks r and 2cp-1-r of the whole row) yields, on every CP rank r,
    exactly the THD-local tokens `thd_cp_index(cu_seqlens_padded, r, cp)` in order."""
    if cp_size == 1:
        return routed
    s = routed.shape[1]
    c = s // (2 * cp_size)
    out = torch.empty_like(routed)
    for q in range(cp_size):
        idx = thd_cp_index(cu_seqlens_padded, q, cp_size)
        out[:, q * c:(q + 1) * c] = routed[:, idx[:c]]
        k = 2 * cp_size - 1 - q
        out[:, k * c:(k + 1) * c] = routed[:, idx[c:]]
    return out


def thd_packed_seq_params(mb: MicroBatch, cp_group=None):
    """megatron `PackedSeqParams(qkv_format="thd", ...)` of a packed micro-batch (or a CP shard
    of one): global cu_seqlens (int32), the padded bounds, max_seqlen = longest padded segment
    (megatron's RoPE table length; with several segments it stays below S, so megatron's THD
    RoPE takes its per-segment, restart-at-0 path)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not mb.is_thd:
        raise ValueError("thd_packed_seq_params: micro-batch is not THD-packed (pack_thd)")
    max_len = int(mb.cu_seqlens_padded.diff().max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
        cu_seqlens_q_padded=mb.cu_seqlens_padded, cu_seqlens_kv_padded=mb.cu_seqlens_padded,
        max_seqlen_q=max_len, max_seqlen_kv=max_len, cp_group=cp_group)
