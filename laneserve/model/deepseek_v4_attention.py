"""DeepSeek V4 attention: sliding window + compressed streams over paged caches.

One K = V head per token (`wkv`, normed, rope on its trailing `rope_dim` channels),
query heads from a q LoRA with an unweighted per-head RMSNorm, a learned sink logit per
head, the inverse rope on the output and a grouped low-rank output projection.

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
rollback only lowers the committed count. See `deepseek_v4_compressor.py`.

Every step first writes its tokens' K = V and compressor state, then the entries its
closing tokens complete, then reads; all reads are per token through its row's block
tables, so decode, verify, chunked prefill and batches share one path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laneserve.model.deepseek_v4_compressor import (
    Compressor,
    additive_mask,
    entry_slots,
    gather_entries,
)
from laneserve.model.deepseek_v4_config import SLIDING, DeepseekV4Params
from laneserve.model.deepseek_v4_ops import InterleavedRope, Norm, WeightGetter, rms_unweighted
from laneserve.model.layers import Kernels, Linear


@dataclass(frozen=True)
class V4StepMetadata:
    """What a V4 forward reads about the step besides ids and positions."""

    tables: tuple[torch.Tensor, ...]  # per cache group: [T, C] int64, the token's row's table
    max_len: int  # host bound: every position in the step is below it


@dataclass(frozen=True)
class LayerCaches:
    """One layer's cache tensors ([blocks, entries per block, 1, X]) and their groups."""

    swa: torch.Tensor
    swa_group: int
    state: torch.Tensor | None = None  # the compressor's per-token projections
    state_group: int = -1
    entries: torch.Tensor | None = None  # compressed entries
    entries_group: int = -1


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
    ) -> None:
        self.p, self.layer_type, self.rope, self.eps = p, layer_type, rope, eps
        self.heads = get(f"{prefix}.wq_b.weight").shape[0] // p.head_dim

        def lin(name: str) -> Linear:
            return Linear(kernels, get(f"{prefix}.{name}.weight"), None)

        self.wq_a, self.wq_b, self.wkv, self.wo_b = (
            lin("wq_a"),
            lin("wq_b"),
            lin("wkv"),
            lin("wo_b"),
        )
        self.q_norm = Norm(get(f"{prefix}.q_norm.weight", torch.float32), eps)
        self.kv_norm = Norm(get(f"{prefix}.norm.weight", torch.float32), eps)
        wo_a = get(f"{prefix}.wo_a.weight")  # [G * R, H * D / G]
        self.wo_a = wo_a.view(p.o_groups, p.o_lora_rank, -1)  # [G, R, H * D / G]
        self.sinks = get(f"{prefix}.attn_sink", torch.float32)  # [H]
        self.scale = p.head_dim**-0.5
        self.compressor = None
        if layer_type != SLIDING:
            self.compressor = Compressor(p, kernels, get, prefix, layer_type, rope, eps)

    def __call__(
        self,
        x: torch.Tensor,  # [T, H_model] normed input
        positions: torch.Tensor,  # [T]
        cache: LayerCaches,
        meta: V4StepMetadata,
    ) -> torch.Tensor:
        p, t = self.p, x.shape[0]
        xq = self.q_norm(self.wq_a(x))  # [T, q_lora_rank]
        q = self.wq_b(xq).view(t, self.heads, p.head_dim)
        q = self.rope(rms_unweighted(q, self.eps), positions)
        kv = self.rope(self.kv_norm(self.wkv(x))[:, None], positions)[:, 0]  # [T, D]
        swa_table = meta.tables[cache.swa_group]
        flat = cache.swa.view(-1, p.head_dim)
        flat.index_copy_(
            0, entry_slots(swa_table, positions, 1, cache.swa.shape[1]), kv.to(flat.dtype)
        )
        keys, mask = self._window(flat, swa_table, positions, cache.swa.shape[1])
        if self.compressor is not None:
            ck, cmask = self.compressor(x, xq, positions, cache, meta)
            if ck is not None and cmask is not None:
                keys, mask = torch.cat([keys, ck], dim=1), torch.cat([mask, cmask], dim=1)
        o = self._attend(q, keys, mask)  # [T, H, D]
        o = self.rope(o, positions, inverse=True)
        grouped = o.reshape(t, p.o_groups, -1)
        y = (
            torch.einsum("tgi,gri->tgr", grouped.to(self.wo_a.dtype), self.wo_a)
            .reshape(t, -1)
            .to(x.dtype)
        )
        return self.wo_b(y)

    def _window(
        self, flat: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, epb: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys [T, W, D], additive mask [T, W]
        w = self.p.sliding_window
        kpos = positions[:, None] - (w - 1) + torch.arange(w, device=positions.device)
        valid = kpos >= 0
        keys = gather_entries(flat, table, kpos.clamp(min=0), epb, valid)
        return keys, additive_mask(valid)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax over the keys and a per-head sink logit (dropped after the softmax)."""
        t, h = q.shape[0], self.heads
        scores = torch.einsum("thd,tkd->thk", q, keys.to(q.dtype)) * self.scale
        scores = scores + mask[:, None, :]
        sinks = self.sinks.view(1, h, 1).expand(t, h, 1).to(scores.dtype)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("thk,tkd->thd", probs, keys.to(q.dtype))
