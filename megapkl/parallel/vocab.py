"""Log-probabilities, entropy and top-K log-probs over tensor-parallel vocabulary shards.

Layout (megatron's): with TP size `tp`, rank r of `tp_group` holds logits for the vocabulary
slice [r * V_local, (r + 1) * V_local) as a [tokens, V_local] tensor. All quantities are of the
temperature-scaled distribution softmax(logits / temperature), the one rollouts sample from.

One pass over the logits computes any of:
  logp      [tokens]     log pi(target)                      (differentiable)
  entropy   [tokens]     -sum_v pi(v) log pi(v)              (differentiable)
  topk_logp [tokens, K]  log pi at given global token ids    (differentiable)

Cost model, why it looks like this:
- Tokens are processed in chunks through one or two fp32 [chunk, V_local] buffers allocated
  once per call (bf16 logits are upcast chunk by chunk), never an fp32 copy of all logits.
  Peak extra memory is the logits gradient itself (one logits tensor, in the logits dtype)
  plus those buffers plus O(tokens * (K + 4)) fp32 statistics.
- Each chunk is shifted by its *local* row max. Across TP ranks the partial sums are then
  rescaled to the global max after the loop, so the whole batch needs exactly two small
  collectives (a MAX of [tokens] and a SUM of [tokens, 3 + K]) however many chunks there are.
- Backward recomputes softmax chunk by chunk from the saved logits and the saved global
  log-sum-exp; it needs no communication. For fp32 logits it works directly in the gradient
  buffer. Gradient w.r.t. z = logits / T, with p = softmax(z):
      d logp / dz_j      = 1[j = target] - p_j
      d topk_k / dz_j    = 1[j = id_k]   - p_j
      d entropy / dz_j   = -p_j (log p_j + entropy)
  and d/dlogits = d/dz / T.

`tp_group=None` (or a group of size 1) means the logits hold the full vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megapkl.parallel.groups import ProcessGroup, group_rank, group_size

# fp32 bytes per chunk buffer when chunk_tokens is not given. On CPU a buffer that stays in
# cache wins (measured, 1 thread, 151936 vocab: 1-16 tokens per chunk are ~1.7x faster than
# 110); with several threads every op is a parallel region, so not too tiny either (8-16
# tokens beat 3). On GPU fewer, larger chunks amortise kernel launches (not measured here).
DEFAULT_CHUNK_BYTES = {"cpu": 8 * 2**20, "cuda": 64 * 2**20}


class VocabParallelOutput(NamedTuple):
    logp: Optional[torch.Tensor]  # [...] fp32, None when no targets were given
    entropy: Optional[torch.Tensor]  # [...] fp32, None unless need_entropy
    topk_logp: Optional[torch.Tensor]  # [..., K] fp32, None when no topk_ids were given


# At least this many chunks, so the (two) fp32 chunk buffers stay a small fraction of the
# logits even for small batches: <= 2/32 of an fp32 logits tensor, 4/32 of a bf16 one...
MIN_CHUNKS = 32
# ...unless a chunk would be smaller than this: below it the loop's per-chunk overhead (about
# ten small ops) costs more than the memory it saves. A 128-token vocabulary with 300 tokens
# took 32 chunks of 10 rows, 11 ms per call where one chunk takes well under 1 ms.
MIN_CHUNK_BYTES = 2**20


def default_chunk_tokens(vocab_local: int, device: torch.device | str = "cpu",
                         tokens: Optional[int] = None) -> int:
    """Tokens per chunk: one fp32 chunk buffer of about DEFAULT_CHUNK_BYTES, and at least
    MIN_CHUNKS chunks when the token count is known."""
    budget = DEFAULT_CHUNK_BYTES.get(torch.device(device).type, DEFAULT_CHUNK_BYTES["cuda"])
    chunk = max(1, budget // (4 * max(1, vocab_local)))
    if tokens is not None:
        floor = max(1, MIN_CHUNK_BYTES // (4 * max(1, vocab_local)))
        chunk = min(chunk, max(floor, -(-tokens // MIN_CHUNKS)))
    return chunk


def token_logprobs_entropy_topk(
    logits: torch.Tensor,
    targets: Optional[torch.Tensor],
    tp_group: ProcessGroup = None,
    temperature: float = 1.0,
    topk_ids: Optional[torch.Tensor] = None,
    need_entropy: bool = False,
    chunk_tokens: Optional[int] = None,
) -> VocabParallelOutput:
    """Target log-prob, entropy and top-K log-probs of softmax(logits / temperature).

    logits: [..., V_local] local vocabulary shard (any float dtype, ideally contiguous: a
        non-contiguous input is copied once by reshape).
    targets: [...] global token ids, or None to skip the log-prob.
    topk_ids: [..., K] global token ids, or None.
    Results are fp32 and differentiable w.r.t. `logits`. Collective over `tp_group`: every
    rank of the group must call it with the same token shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_local = logits.shape[-1]
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, vocab_local)
    flat_targets = None if targets is None else _flat_ids(targets, lead, "targets")
    flat_topk = None if topk_ids is None else _flat_ids(topk_ids, lead, "topk_ids", topk=True)
    chunk = chunk_tokens or default_chunk_tokens(vocab_local, logits.device, flat.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logp, entropy, topk = _VocabParallelStats.apply(
        flat, flat_targets, flat_topk, tp_group, float(temperature), int(chunk), need_entropy
    )
    return VocabParallelOutput(
        logp=None if logp is None else logp.view(lead),
        entropy=None if entropy is None else entropy.view(lead),
        topk_logp=None if topk is None else topk.view(*lead, topk.shape[-1]),
    )


def vocab_parallel_logprobs(logits, targets, tp_group=None, temperature=1.0, chunk_tokens=None):
    """log softmax(logits / temperature)[target], [...] fp32."""
    return token_logprobs_entropy_topk(
        logits, targets, tp_group, temperature, chunk_tokens=chunk_tokens
    ).logp


def vocab_parallel_entropy(logits, tp_group=None, temperature=1.0, chunk_tokens=None):
    """Entropy of softmax(logits / temperature) over the full vocabulary, [...] fp32."""
    return token_logprobs_entropy_topk(
        logits, None, tp_group, temperature, need_entropy=True, chunk_tokens=chunk_tokens
    ).entropy


def vocab_parallel_topk_logprobs(logits, topk_ids, tp_group=None, temperature=1.0,
                                 chunk_tokens=None):
    """log softmax(logits / temperature) at the global ids `topk_ids`, [..., K] fp32."""
    return token_logprobs_entropy_topk(
        logits, None, tp_group, temperature, topk_ids=topk_ids, chunk_tokens=chunk_tokens
    ).topk_logp


# ---------------------------------------------------------------- helpers


def _flat_ids(ids: torch.Tensor, lead: torch.Size, name: str, topk: bool = False) -> torch.Tensor:
    expected = tuple(lead) + ((ids.shape[-1],) if topk else ())
    if tuple(ids.shape) != expected or (topk and ids.dim() == 0):
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, logits need {expected}")
    ids = ids.to(torch.long)
    return ids.reshape(-1, ids.shape[-1]) if topk else ids.reshape(-1)


def _local_ids(ids: torch.Tensor, start: int, vocab_local: int):
    """Global ids -> (local column, clamped to be a valid index; mask of ids held here)."""
    local = ids - start
    held = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), held


def _scaled_chunk(rows: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """out <- fp32(rows) / temperature, matching `logits.float() / T` bit for bit."""
    if rows.dtype == torch.float32 and temperature != 1.0:
        return torch.div(rows, temperature, out=out)  # one pass instead of copy + divide
    out.copy_(rows)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _chunk_buffer(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """One fp32 [chunk, V_local] buffer reused by every chunk (row-sliced for the last one).

    Reuse matters: a fresh multi-MB allocation per chunk is a fresh mmap whose page faults
    cost more than the arithmetic, and a small reused buffer stays in cache.
    """
    return torch.empty(min(chunk, x.shape[0]), x.shape[1], dtype=torch.float32, device=x.device)


def _pick(z: torch.Tensor, local: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """z[row, local] where the id is held by this rank, else 0. local/held: [C, J]."""
    return torch.where(held, z.gather(1, local), torch.zeros((), dtype=z.dtype, device=z.device))


class _ChunkSums(NamedTuple):
    row_max: torch.Tensor  # [N] local max of z over this shard
    sum_exp: torch.Tensor  # [N] sum_j exp(z_j - row_max)
    sum_exp_z: torch.Tensor  # [N] sum_j exp(z_j - row_max) * (z_j - row_max)
    picks: torch.Tensor  # [N, J] z - row_max at the requested ids (0 where not held)
    held: torch.Tensor  # [N, J] bool


def _local_sums(x, ids, start, temperature, chunk, need_entropy) -> _ChunkSums:
    """One pass over the local shard: per-row partial sums, each relative to its local max."""
    n, vocab_local = x.shape
    local, held = _local_ids(ids, start, vocab_local)
    f32 = dict(dtype=torch.float32, device=x.device)
    row_max = torch.empty(n, **f32)
    sum_exp = torch.empty(n, **f32)
    sum_exp_z = torch.zeros(n, **f32)
    picks = torch.empty(n, ids.shape[1], **f32)
    z_buf = _chunk_buffer(x, chunk)
    e_buf = _chunk_buffer(x, chunk) if need_entropy else None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        z = _scaled_chunk(x[lo:hi], temperature, z_buf[: hi - lo])
        torch.amax(z, dim=1, out=row_max[lo:hi])
        z.sub_(row_max[lo:hi, None])
        picks[lo:hi] = _pick(z, local[lo:hi], held[lo:hi])
        if need_entropy:
            e = torch.exp(z, out=e_buf[: hi - lo])
            torch.sum(e, dim=1, out=sum_exp[lo:hi])
            torch.sum(e.mul_(z), dim=1, out=sum_exp_z[lo:hi])
        else:
            torch.sum(z.exp_(), dim=1, out=sum_exp[lo:hi])
    return _ChunkSums(row_max, sum_exp, sum_exp_z, picks, held)


def _global_sums(s: _ChunkSums, group: ProcessGroup):
    """Combine the shards: (global max M, S = sum exp(z - M), sum exp(z - M)(z - M), picks - M)."""
    if group_size(group) == 1:
        return s.row_max, s.sum_exp, s.sum_exp_z, s.picks
    big_max = s.row_max.clone()
    dist.all_reduce(big_max, op=dist.ReduceOp.MAX, group=group)
    shift = s.row_max - big_max  # <= 0
    scale = torch.exp(shift)
    # sum_j e^(z_j - M) (z_j - M) = scale * (sum_j e^(z_j - m)(z_j - m) + (m - M) sum_j e^(z_j - m))
    packed = torch.cat(
        [
            (s.sum_exp * scale).unsqueeze(1),
            (scale * (s.sum_exp_z + shift * s.sum_exp)).unsqueeze(1),
            torch.where(s.held, s.picks + shift.unsqueeze(1), torch.zeros(())),
        ],
        dim=1,
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return big_max, packed[:, 0], packed[:, 1], packed[:, 2:]


# ---------------------------------------------------------------- autograd


class _VocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, targets, topk_ids, group, temperature, chunk, need_entropy):
        n, vocab_local = x.shape
        start = group_rank(group) * vocab_local
        id_cols = [t for t in (None if targets is None else targets.unsqueeze(1), topk_ids)
                   if t is not None]
        ids = torch.cat(id_cols, dim=1) if id_cols else x.new_zeros(n, 0, dtype=torch.long)
        sums = _local_sums(x, ids, start, temperature, chunk, need_entropy)
        big_max, sum_exp, sum_exp_z, picks = _global_sums(sums, group)

        log_z = torch.log(sum_exp)  # log partition function relative to big_max
        picks_logp = picks - log_z.unsqueeze(1)
        logp = None if targets is None else picks_logp[:, 0].contiguous()
        topk = None if topk_ids is None else picks_logp[:, ids.shape[1] - topk_ids.shape[1]:]
        entropy = log_z - sum_exp_z / sum_exp if need_entropy else None

        ctx.save_for_backward(x, ids, big_max + log_z, entropy)
        ctx.meta = (start, temperature, chunk, targets is not None, topk_ids is not None)
        return logp, entropy, None if topk is None else topk.contiguous()

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_topk):
        x, ids, lse, entropy = ctx.saved_tensors
        start, temperature, chunk, has_target, has_topk = ctx.meta
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        # coefficient of each one-hot term, aligned with the columns of `ids`
        coefs = []
        if has_target:
            coefs.append(_or_zeros(g_logp, (x.shape[0],), x).unsqueeze(1))
        if has_topk:
            coefs.append(_or_zeros(g_topk, (x.shape[0], ids.shape[1] - len(coefs)), x))
        if not coefs:  # only the entropy was requested
            coefs.append(x.new_zeros(x.shape[0], 0, dtype=torch.float32))
        onehot = torch.cat(coefs, dim=1)
        grad = _logits_grad(x, ids, onehot, lse, entropy, g_entropy, start, temperature, chunk)
        return grad, None, None, None, None, None, None


def _or_zeros(g: Optional[torch.Tensor], shape, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(shape, dtype=torch.float32) if g is None else g.float()


def _logits_grad(x, ids, onehot, lse, entropy, g_entropy, start, temperature, chunk):
    """dL/dlogits, chunk by chunk: (onehots - p * (sum(onehot) + gH (log p + H))) / T."""
    n, vocab_local = x.shape
    local, held = _local_ids(ids, start, vocab_local)
    inv_t = 1.0 / temperature
    # Per-row coefficients with -1/T folded in, so each chunk costs few passes:
    #   grad = p * (slope * log p + offset) + onehots / T
    total = onehot.sum(1)  # every one-hot coefficient also multiplies -p
    use_entropy = g_entropy is not None and entropy is not None
    slope = -inv_t * g_entropy.float() if use_entropy else None
    offset = -inv_t * (total + g_entropy.float() * entropy if use_entropy else total)
    onehot_here = torch.where(held, onehot * inv_t, torch.zeros((), device=x.device))
    grad = torch.empty_like(x)
    in_place = x.dtype == torch.float32  # work directly in the gradient rows
    buf = None if in_place else _chunk_buffer(x, chunk)
    p_buf = _chunk_buffer(x, chunk) if use_entropy else None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        dst = grad[lo:hi]
        log_p = _scaled_chunk(x[lo:hi], temperature, dst if in_place else buf[: hi - lo])
        log_p.sub_(lse[lo:hi, None])
        if use_entropy:
            p = torch.exp(log_p, out=p_buf[: hi - lo])
            out = log_p.mul_(slope[lo:hi, None]).add_(offset[lo:hi, None]).mul_(p)
        else:
            out = log_p.exp_().mul_(offset[lo:hi, None])
        out.scatter_add_(1, local[lo:hi], onehot_here[lo:hi])
        if not in_place:
            dst.copy_(out)
    return grad
