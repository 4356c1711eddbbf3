"""Paged attention over a step's flattened tokens.

Glossary:
- *decode-like* sequence: few query tokens (a decode, or a speculative verify
  of 1 + k tokens) whose K/V are read straight from the paged cache by the
  attention kernel. They come first in the step's token order.
- *prefill* sequence: a prompt chunk. On the CPU kernels it reads the paged cache
  through the same attention kernel as decode rows (per query the same arithmetic),
  except a chunk of more than PAGED_PREFILL_MAX_TOKENS tokens on a bf16 cache, which
  attends over its context and its own K/V with kernels.causal_attention_bf16 (blocked
  bf16 dot products on CPU), and a fresh chunk that long on an fp32 cache, which runs
  torch SDPA. Elsewhere (torch kernels, CUDA) a fresh chunk runs SDPA and a chunk
  with context (a later chunk, or a prefix-cache hit) gathers its blocks once and runs
  SDPA with a bottom-right causal mask.

The K/V of every token in the step are written to the cache first, so a
decode-like query at position p sees keys 0..p through its block table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laneserve.kernels import Kernels

# Prompt chunks up to this many tokens take the paged attention kernel on CPU (a decode
# row's bits, whatever the chunking); longer ones, where attention's quadratic cost
# dominates, the blocked bf16 kernel (2000 tokens, 9 heads of 64 on the Zen 4 VM: 19 ms
# against the paged kernel's 59; 1100 tokens 6.2 ms, the paged kernel 12.7 at 1024).
PAGED_PREFILL_MAX_TOKENS = 1024


@dataclass(frozen=True)
class PrefillSpan:
    token_start: int  # first row of this sequence in the step's tokens
    num_tokens: int  # query tokens (the chunk)
    context_len: int  # tokens already in the cache before the chunk
    block_ids: torch.Tensor  # [num_blocks] int64, covers context_len + num_tokens

    @functools.cached_property
    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block table [1, nb] int32, seq_lens [1], query_start_loc [2]) for
        Kernels.paged_attention: made once per step, read by every layer."""
        device = self.block_ids.device
        total = self.context_len + self.num_tokens
        return (
            self.block_ids[None].to(torch.int32),
            torch.tensor([total], dtype=torch.int32, device=device),
            torch.tensor([0, self.num_tokens], dtype=torch.int32, device=device),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decode-like
    decode_block_tables: torch.Tensor | None  # [num_decode_seqs, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decode_seqs] int32 (keys incl. this step)
    decode_query_start_loc: torch.Tensor | None  # [num_decode_seqs + 1] int32
    prefills: tuple[PrefillSpan, ...]
    # [num_decode_seqs] int64: slot holding the sequence's last key instead of its table
    # (-1: the table); speculative side rows, see worker/side_rows.py
    decode_last_slot: torch.Tensor | None = None


def _decode_attention(
    kernels: Kernels,
    q: torch.Tensor,  # [Td, Hq, D] the decode-like rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    tables, lens, starts = (
        meta.decode_block_tables,
        meta.decode_seq_lens,
        meta.decode_query_start_loc,
    )
    # NOTE: the input builder sets all three whenever a step has decode-like rows
    assert tables is not None and lens is not None and starts is not None, "no decode tables"
    return kernels.paged_attention(
        q, k_cache, v_cache, tables, lens, starts, scale, meta.decode_last_slot
    )


def paged_attention(
    kernels: Kernels,
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hk, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    k_cache, v_cache = kv_cache
    kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if not meta.prefills:
        return _decode_attention(kernels, q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(kernels, q[:nd], k_cache, v_cache, meta, scale)
    paged = kernels.name == "cpu" and q.shape[-1] % 8 == 0
    bf16_cpu = k_cache.dtype == torch.bfloat16 and q.device.type == "cpu"
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        short = span.num_tokens <= PAGED_PREFILL_MAX_TOKENS
        if paged and (short or (span.context_len > 0 and not bf16_cpu)):
            table, lens, starts = span.kernel_args
            out[rows] = kernels.paged_attention(
                q[rows], k_cache, v_cache, table, lens, starts, scale
            )
            continue
        out[rows] = _prefill_attention(
            kernels, q[rows], k[rows], v[rows], k_cache, v_cache, span, scale, bf16_cpu
        )
    return out


def _prefill_attention(
    kernels: Kernels,
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [n, Hk, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    bf16_cpu: bool,  # a bf16 cache on CPU
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    total = span.context_len + span.num_tokens
    if bf16_cpu and (span.context_len == 0 or span.num_tokens > PAGED_PREFILL_MAX_TOKENS):
        # NOTE: a bf16 cache stores these K/V rounded to bf16 anyway, and prompt rows'
        # numerics are already their own (docs/kernels.md). fp32 models stay fp32.
        if span.context_len:
            k = _gather(k_cache, span.block_ids, total, k_cache.dtype)
            v = _gather(v_cache, span.block_ids, total, v_cache.dtype)
        return kernels.causal_attention_bf16(q, k, v, scale)
    if span.context_len == 0:
        return _sdpa(q, k, v, group, scale, mask=None)
    keys = _gather(k_cache, span.block_ids, total, q.dtype)
    values = _gather(v_cache, span.block_ids, total, q.dtype)
    # NOTE: bottom-right causal: query i sits at position context_len + i.
    q_pos = torch.arange(span.context_len, total, device=q.device)
    mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
    return _sdpa(q, keys, values, group, scale, mask=mask)


def _gather(
    cache: torch.Tensor, block_ids: torch.Tensor, total: int, dtype: torch.dtype
) -> torch.Tensor:  # [total, Hk, D]
    blocks = cache.index_select(0, block_ids)  # [nb, block_size, Hk, D]
    return blocks.flatten(0, 1)[:total].to(dtype)


def _sdpa(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [L, Hk, D]
    v: torch.Tensor,
    group: int,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:  # [n, Hq, D]
    if group > 1 and mask is not None:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=group > 1 and mask is None,  # no repeated K/V copies
    )
    return out.squeeze(0).transpose(0, 1)


@dataclass(frozen=True)
class TokenTableMetadata:
    """The step metadata of a model that reads every cache group through each token's
    row's table (DeepSeek V4), besides ids and positions."""

    tables: tuple[torch.Tensor, ...]  # per cache group: [T, C] int64, the token's row's table
    max_len: int  # host bound: every position in the step is below it
    # host: (first token, tokens, first position) of each prefill row; their queries
    # attend in blocks (DeepSeek V4: `PREFILL_QUERY_BLOCK`), every other token on its own
    spans: tuple[tuple[int, int, int], ...] = ()

    @property
    def first_prefill(self) -> int | None:
        """The first prompt token (they follow the decode-like ones), for Linear."""
        return self.spans[0][0] if self.spans else None

    def rows(self, start: int, stop: int) -> TokenTableMetadata:
        """The metadata of tokens start .. stop - 1 attended one by one."""
        return TokenTableMetadata(tuple(t[start:stop] for t in self.tables), self.max_len)
