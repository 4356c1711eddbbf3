"""DeepSeek V4 attention: sliding window + compressed streams over paged caches.

One K = V head per token (`wkv`, normed, rope on its trailing `rope_dim` channels),
query heads from a q LoRA with an unweighted per-head RMSNorm, a learned sink logit per
head, the inverse rope on the output and a grouped low-rank output projection. Under
tensor parallelism a rank holds its query heads and their output groups
(`deepseek_v4/parallel.py`); the K = V head, compressors and indexer are whole.

Each query at position q attends to
```
 sliding   keys at q - W + 1 .. q                       (the `swa` cache group)
 HCA       every compressed entry e < (q + 1) // m'     (entry e: tokens e m' .. e m' + m' - 1)
 CSA       the indexer's top-k among entries e < (q + 1) // m
```
A compressed entry is written when the token that closes its window is processed,
from the per-token compressor projections kept *by position* in a state group. It is
a function of those positions only, so recomputing it (a rejected draft that had
closed the window, a request resumed after preemption) gives the same entry: a
rollback only lowers the committed count. See `deepseek_v4/compressor.py`.

Every step first writes its tokens' K = V and compressor state, then the entries its
closing tokens complete, then reads. Decode and verify tokens read one by one through
their row's block tables. A prefill row's queries read in blocks of consecutive
positions: one gather of the window's keys (W + n - 1 of them, under a band mask) and
of HCA's entries serves the whole block, so a long prompt costs no per-query copy of
the window. Both give each query the same keys and the same masked softmax.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.model.deepseek_v4.caches import LayerCaches
from laneserve.model.deepseek_v4.compressor import (
    Compressor,
    additive_mask,
    entry_slots,
    gather_entries,
)
from laneserve.model.deepseek_v4.config import SLIDING, DeepseekV4Params
from laneserve.model.deepseek_v4.grouped import GroupedLinear
from laneserve.model.deepseek_v4.ops import InterleavedRope, Norm, rms_unweighted
from laneserve.model.deepseek_v4.parallel import GROUPS, HEADS, cols, rows
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.layers.linear import Linear, LinearWeight, linear_weight
from laneserve.model.layers.parallel import RowParallelLinear
from laneserve.model.layers.weights import WeightGetter

PREFILL_QUERY_BLOCK = 128  # queries of one prefill row sharing one gather of keys


class V4Attention:
    def __init__(
        self,
        p: DeepseekV4Params,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,  # "<layers>.N.attn"
        layer_type: str,
        rope: InterleavedRope,
        eps: float,
        num_heads: int,  # the model's query heads (a rank holds num_heads / tp.size)
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.p, self.layer_type, self.rope, self.eps = p, layer_type, rope, eps
        d, r = p.head_dim, p.o_lora_rank
        self.heads = num_heads // tp.size  # this rank's heads, and their output groups
        self.groups = p.o_groups // tp.size

        def lin(name: str) -> Linear:
            return Linear(kernels, linear_weight(get, f"{prefix}.{name}.weight"), None)

        self.wq_a, self.wkv = lin("wq_a"), lin("wkv")
        wo_a_name = f"{prefix}.wo_a.weight"  # [G R, H D / G]
        if tp.size == 1:  # the checkpoint's fp8 kept as stored where the getter keeps it
            self.wq_b = lin("wq_b")
            wo_a: LinearWeight = linear_weight(get, wo_a_name)
            self.wo_b: Linear | RowParallelLinear = lin("wo_b")
        else:
            wq_b = rows(get, f"{prefix}.wq_b.weight", num_heads, d, HEADS, tp)
            self.wq_b = Linear(kernels, wq_b, None)
            wo_a = rows(get, wo_a_name, p.o_groups, r, GROUPS, tp)
            wo_b = cols(get, f"{prefix}.wo_b.weight", p.o_groups, r, GROUPS, tp)
            self.wo_b = RowParallelLinear(Linear(kernels, wo_b, None), tp)
        self.wo_a = GroupedLinear(kernels, wo_a, self.groups)  # deepseek_v4/grouped.py
        self.q_norm = Norm(get(f"{prefix}.q_norm.weight", torch.float32), eps)
        # released: `attn.kv_norm`; transformers' save_pretrained writes `attn.norm`
        kv_norm = "norm" if prefix.startswith("model.") else "kv_norm"
        self.kv_norm = Norm(get(f"{prefix}.{kv_norm}.weight", torch.float32), eps)
        self.sinks = rows(get, f"{prefix}.attn_sink", num_heads, 1, HEADS, tp, torch.float32)
        assert self.sinks.shape == (self.heads,) and self.wq_b.out_features == self.heads * d
        assert self.wo_a.shape[:2] == (self.groups, r)
        self.scale = d**-0.5
        self.compressor = None
        if layer_type != SLIDING:
            self.compressor = Compressor(p, kernels, get, prefix, layer_type, rope, eps)

    def __call__(
        self,
        x: torch.Tensor,  # [T, H_model] normed input
        positions: torch.Tensor,  # [T]
        cache: LayerCaches,
        meta: TokenTableMetadata,
    ) -> torch.Tensor:
        p, t = self.p, x.shape[0]
        fp = meta.first_prefill
        xq = self.q_norm(self.wq_a(x, fp))  # [T, q_lora_rank]
        q = self.wq_b(xq, fp).view(t, self.heads, p.head_dim)
        q = self.rope(rms_unweighted(q, self.eps), positions)
        kv = self.rope(self.kv_norm(self.wkv(x, fp))[:, None], positions)[:, 0]  # [T, D]
        swa_table = meta.tables[cache.swa_group]
        flat = cache.swa.view(-1, p.head_dim)
        flat.index_copy_(
            0, entry_slots(swa_table, positions, 1, cache.swa.shape[1]), kv.to(flat.dtype)
        )
        if self.compressor is not None:
            self.compressor.write(x, positions, cache, meta, fp)
        outs = [
            self._tokens(q[a:b], x[a:b], xq[a:b], positions[a:b], cache, meta.rows(a, b))
            if first is None
            else self._block(q[a:b], x[a:b], xq[a:b], positions[a:b], first, cache, meta, a)
            for a, b, first in _segments(t, meta.spans)
        ]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, D]
        o = self.rope(o, positions, inverse=True)
        y = self.wo_a(o.reshape(t, self.groups, -1), fp)  # [T, G R]
        return self.wo_b(y, fp)

    def _tokens(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        xq: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCaches,
        meta: TokenTableMetadata,
    ) -> torch.Tensor:
        """Each token gathers its own keys through its row's tables (decode, verify)."""
        table = meta.tables[cache.swa_group]
        flat = cache.swa.view(-1, self.p.head_dim)
        keys, mask = self._window(flat, table, positions, cache.swa.shape[1])
        if self.compressor is not None:
            compressed = self.compressor.token_keys(x, xq, positions, cache, meta)
            if compressed is not None:
                keys = torch.cat([keys, compressed[0]], dim=1)
                mask = torch.cat([mask, compressed[1]], dim=1)
        return self._attend(q, [(keys, mask)])

    def _block(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        xq: torch.Tensor,
        positions: torch.Tensor,
        first: int,  # host: positions[0]
        cache: LayerCaches,
        meta: TokenTableMetadata,
        token: int,  # the block's first token in the step
    ) -> torch.Tensor:
        """Consecutive queries of one row: the window's keys are gathered once for the
        block ([W + n - 1, D] with a band mask), HCA's entries once, CSA's per query."""
        w, n, end = self.p.sliding_window, q.shape[0], first + q.shape[0]
        kpos = torch.arange(first - w + 1, end, device=q.device)
        behind = positions[:, None] - kpos[None, :]
        band = (kpos >= 0)[None, :] & (behind >= 0) & (behind < w)  # [n, W + n - 1]
        flat = cache.swa.view(-1, self.p.head_dim)
        table = meta.tables[cache.swa_group][token : token + 1]
        keys = gather_entries(flat, table, kpos.clamp(min=0)[None], cache.swa.shape[1],
                              (kpos >= 0)[None])[0]  # fmt: skip
        parts = [(keys, additive_mask(band))]
        if self.compressor is not None:
            table = meta.tables[cache.entries_group][token : token + 1]
            compressed = self.compressor.block_keys(x, xq, positions, end, cache, table)
            if compressed is not None:
                parts.append(compressed)
        assert all(m.shape[0] == n for _, m in parts)
        return self._attend(q, parts)

    def _window(
        self, flat: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, epb: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys [T, W, D], additive mask [T, W]
        w = self.p.sliding_window
        kpos = positions[:, None] - (w - 1) + torch.arange(w, device=positions.device)
        valid = kpos >= 0
        keys = gather_entries(flat, table, kpos.clamp(min=0), epb, valid)
        return keys, additive_mask(valid)

    def _attend(
        self, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Softmax over every part's keys and a per-head sink logit (dropped after the
        softmax). A part is keys [T, K, D] per query or [K, D] shared, with its additive
        mask [T, K]."""
        t, h = q.shape[0], self.heads
        keys = [k.to(q.dtype) for k, _ in parts]
        scores = [
            (torch.einsum(_eq(k, "thd,tkd->thk"), q, k) * self.scale) + m[:, None, :]
            for k, (_, m) in zip(keys, parts, strict=True)
        ]
        sinks = self.sinks.view(1, h, 1).expand(t, h, 1).to(scores[0].dtype)
        logits = torch.cat([*scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1).split([s.shape[-1] for s in scores] + [1], dim=-1)
        out = [
            torch.einsum(_eq(k, "thk,tkd->thd"), pr, k)
            for pr, k in zip(probs[:-1], keys, strict=True)
        ]
        o = out[0]
        for more in out[1:]:
            o = o + more
        return o


def _eq(keys: torch.Tensor, per_query: str) -> str:
    """The einsum of keys given per query, or of keys shared by the queries."""
    return per_query if keys.dim() == 3 else per_query.replace("tkd", "kd")


def _segments(
    num_tokens: int, spans: tuple[tuple[int, int, int], ...]
) -> Iterator[tuple[int, int, int | None]]:
    """(start, stop, first position or None) covering the step's tokens in order: prefill
    rows cut in blocks of `PREFILL_QUERY_BLOCK`, the tokens between them (None) whole."""
    at = 0
    for start, n, first in spans:
        if start > at:
            yield at, start, None
        for off in range(0, n, PREFILL_QUERY_BLOCK):
            yield start + off, start + min(off + PREFILL_QUERY_BLOCK, n), first + off
        at = start + n
    if at < num_tokens:
        yield at, num_tokens, None
