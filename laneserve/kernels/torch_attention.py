"""Paged attention and the KV-cache write in torch ops (TorchKernels: any device).

Attention takes one of two paths, chosen from tensor shapes alone:

- *gathered* (decode-like calls: at most GATHERED_MAX_QUERIES_PER_SEQ query tokens per
  sequence on average): every query token gathers its own sequence's keys through
  the block table, all `C = columns * block_size` of them, and one masked softmax
  covers the whole call. No device value is read on the host and every shape
  follows from the inputs' shapes, so a CUDA graph can capture it.
- *per sequence* (prompt-sized queries): each sequence's blocks are gathered once
  and SDPA runs with a bottom-right causal mask. It reads the lengths on the host.

The cache is allocated uninitialised and a block's tail may hold a previous owner's
values: the gathered path zeroes the values it masks (0 * NaN would leak).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Above this many query tokens per sequence (on average) a call is prompt-sized: the
# gathered path would copy every sequence's keys once per query token.
GATHERED_MAX_QUERIES_PER_SEQ = 8


def paged_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, Dk]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hk, Dv]
    block_tables: torch.Tensor,  # [S, C] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    last_slot: torch.Tensor | None = None,  # [S] int64 the last key's slot (-1: table)
) -> torch.Tensor:  # [T, Hq, Dv] q.dtype
    if q.shape[0] <= GATHERED_MAX_QUERIES_PER_SEQ * seq_lens.shape[0]:
        return gathered_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, last_slot
        )
    return per_sequence_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, last_slot
    )


def gathered_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    last_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """One masked softmax over every token's own keys; no host synchronisation."""
    t, hq, dk = q.shape
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    seq, pos, lens = _token_positions(t, seq_lens, query_start_loc)
    slots = _key_slots(block_tables, seq, k_cache.shape[1], k_cache.shape[0])  # [T, C]
    key_pos = torch.arange(slots.shape[1], device=q.device)
    if last_slot is not None:  # the sequence's last key from its own slot
        last = last_slot.index_select(0, seq)[:, None]  # [T, 1]
        swap = (key_pos[None, :] == lens[:, None] - 1) & (last >= 0)
        slots = torch.where(swap, last, slots)
    visible = key_pos[None, :] <= pos[:, None]  # [T, C] bottom-right causal
    keys = k_cache.flatten(0, 1)[slots].to(q.dtype)  # [T, C, Hk, Dk]
    values = v_cache.flatten(0, 1)[slots].to(q.dtype)
    values = values.masked_fill(~visible[:, :, None, None], 0)
    qg = q.view(t, hk, hq // hk, dk)
    scores = torch.einsum("thgd,tchd->thgc", qg, keys).float() * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.einsum("thgc,tchd->thgd", probs, values)
    return out.reshape(t, hq, dv)


def _token_positions(
    t: int, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T] each: sequence, position, seq_len
    """Query i of a sequence with q_len queries and seq_len keys sits at seq_len - q_len + i."""
    tok = torch.arange(t, device=seq_lens.device)
    ends = query_start_loc[1:].to(torch.int64)
    seq = torch.searchsorted(ends, tok, right=True).clamp(max=seq_lens.shape[0] - 1)
    lens = seq_lens.to(torch.int64).index_select(0, seq)
    return seq, lens - (ends.index_select(0, seq) - tok), lens


def _key_slots(
    block_tables: torch.Tensor, seq: torch.Tensor, block_size: int, num_blocks: int
) -> torch.Tensor:  # [T, C * block_size] int64 cache slot of each key position
    """Table entries past a sequence's blocks may hold anything: they are clamped into
    the cache (their keys are masked)."""
    table = block_tables.to(torch.int64).index_select(0, seq).clamp(0, num_blocks - 1)
    offsets = torch.arange(block_size, device=table.device)
    return (table[:, :, None] * block_size + offsets).flatten(1)


def per_sequence_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    last_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's blocks gathered once, SDPA with a bottom-right causal mask."""
    out = q.new_empty((*q.shape[:2], v_cache.shape[3]))
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hk
    starts = query_start_loc.tolist()
    lasts = last_slot.tolist() if last_slot is not None else [-1] * len(starts)
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        n_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :n_blocks].long()
        k = _gather_kv(k_cache, blocks, seq_len, group, q.dtype, lasts[s])
        v = _gather_kv(v_cache, blocks, seq_len, group, q.dtype, lasts[s])
        q_len = q1 - q0
        qpos = torch.arange(q_len, device=q.device) + (seq_len - q_len)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k, v, attn_mask=mask, scale=scale
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def _gather_kv(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    group: int,
    dtype: torch.dtype,
    last_slot: int = -1,
) -> torch.Tensor:  # [Hq, seq_len, D]
    hk, d = cache.shape[2], cache.shape[3]
    kv = cache[blocks].reshape(-1, hk, d)[:seq_len].to(dtype)
    if last_slot >= 0:
        kv[seq_len - 1] = cache.view(-1, hk, d)[last_slot].to(dtype)
    return kv.repeat_interleave(group, dim=1).transpose(0, 1)


def write_kv_cache(
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hk, Dv]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, Dk]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative: skipped
) -> None:
    """Scatter the step's K/V into their slots, without a host read: a skipped row
    writes the first kept row's slot with that row's values (the same bytes twice),
    or, when no row is kept, slot 0 with its own contents."""
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    keep = slots >= 0
    anchor = keep.to(torch.int32).argmax().view(1)  # the first kept row (0 when none)
    any_kept = keep.any()
    target = torch.where(keep, slots, torch.where(any_kept, slots.index_select(0, anchor), 0))
    for src, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        first = src.index_select(0, anchor).to(cache.dtype)
        fill = torch.where(any_kept, first, flat[:1])
        rows = torch.where(keep[:, None, None], src.to(cache.dtype), fill)
        flat.index_copy_(0, target, rows)
