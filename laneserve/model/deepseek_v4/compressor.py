"""DeepSeek V4 compressors and the Lightning indexer over paged caches.

A compressor turns each window of m tokens into one entry: per channel, a softmax over
the window of (gate + position bias) weighs the window's kv projections; the sum is
RMS-normed and rotated at the window's first position. CSA (m = 4) uses overlapping
windows: each token projects two series, Ca (first half) and Cb (second half), and
entry w pools Ca of window w - 1 with Cb of window w (2m slots; window -1 is empty).

```
 state group   per token: [kv | gate] projections (CSA: both series, and the indexer's)
 entries group per m tokens: the entry (CSA: the attention entry, then the indexer's)
```
Every decode or verify token computes "the entry of the window it is in, as if it
closed it"; only the token that does close it (position % m == m - 1) stores it, the
others write to the row's scratch slot (its table's padding column). In a prompt row,
whose positions the host knows, only the closing tokens compute it. The entry depends
only on state at positions, so recomputing it is idempotent.

The indexer scores entry s for query t as sum_h w_{t,h} relu(q_{t,h} . k_s) and keeps
the top `index_topk` entries among those whose window has closed.
"""

from __future__ import annotations

import torch

from laneserve.kernels import Kernels
from laneserve.model.deepseek_v4.caches import LayerCaches
from laneserve.model.deepseek_v4.config import CSA, DeepseekV4Params
from laneserve.model.deepseek_v4.ops import InterleavedRope, Norm
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.weights import WeightGetter


def entry_slots(
    table: torch.Tensor,  # [T, C] the token's row's block table
    index: torch.Tensor,  # [T] or [T, K] entry indices
    tokens_per_entry: int,
    entries_per_block: int,
) -> torch.Tensor:
    """Flat cache slots of entries; columns past the table land on its last (padding)
    column, the group's scratch block."""
    e = index // tokens_per_entry
    col = (e // entries_per_block).clamp(max=table.shape[1] - 1)
    blocks = table.gather(1, col.reshape(table.shape[0], -1)).reshape(e.shape)
    return blocks * entries_per_block + e % entries_per_block


def scratch_slots(table: torch.Tensor, entries_per_block: int) -> torch.Tensor:  # [T]
    return table[:, -1] * entries_per_block


def gather_entries(
    flat: torch.Tensor,  # [slots, X]
    table: torch.Tensor,
    index: torch.Tensor,  # [T, K] entry indices
    entries_per_block: int,
    valid: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, K, X], zero where not valid (never-written memory stays out)
    rows = flat.index_select(0, entry_slots(table, index, 1, entries_per_block).flatten())
    rows = rows.view(*index.shape, flat.shape[-1])
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype))


class _Pool:
    """One compressor's weights: window -> entry (see the module doc)."""

    def __init__(self, get: WeightGetter, stem: str, kernels: Kernels, eps: float) -> None:
        self.stem = stem  # its wkv / wgate rows live in the Compressor's fused projection
        self.ape = get(f"{stem}.ape", torch.float32)  # [m, width]
        self.norm = Norm(get(f"{stem}.norm.weight", torch.float32), eps)
        self.width = int(self.ape.shape[1])

    def entries(
        self,
        state: torch.Tensor,  # [T, m, 2 width]: [kv | gate] of the token's window
        prev: torch.Tensor | None,  # [T, m, 2 width] of the window before (CSA)
        has_prev: torch.Tensor | None,  # [T] bool (window index >= 1)
    ) -> torch.Tensor:  # [T, d] unrotated
        w = self.width
        kv, gate = state[..., :w], state[..., w:] + self.ape
        if prev is not None:
            assert has_prev is not None
            d = w // 2
            pkv, pgate = prev[..., :d], prev[..., w : w + d] + self.ape[:, :d]
            keep = has_prev[:, None, None]
            pkv = torch.where(keep, pkv, torch.zeros((), dtype=pkv.dtype))
            pgate = torch.where(keep, pgate, torch.full((), float("-inf"), dtype=pgate.dtype))
            kv = torch.cat([pkv, kv[..., d:]], dim=1)
            gate = torch.cat([pgate, gate[..., d:]], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=1))


class Compressor:
    def __init__(
        self,
        p: DeepseekV4Params,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        layer_type: str,
        rope: InterleavedRope,
        eps: float,
    ) -> None:
        self.p, self.rope, self.m = p, rope, p.rate(layer_type)
        self.csa = layer_type == CSA
        self.pools = [_Pool(get, f"{prefix}.compressor", kernels, eps)]
        if self.csa:
            self.pools.append(_Pool(get, f"{prefix}.indexer.compressor", kernels, eps))
            self.iq = Linear(kernels, linear_weight(get, f"{prefix}.indexer.wq_b.weight"), None)
            self.iw = Linear(kernels, get(f"{prefix}.indexer.weights_proj.weight"), None)
        names = [f"{pool.stem}.{w}.weight" for pool in self.pools for w in ("wkv", "wgate")]
        proj = torch.cat([get(n) for n in names])
        self.proj = Linear(kernels, proj, None)  # all [kv | gate] projections in one matmul

    def write(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCaches,
        meta: TokenTableMetadata,
        first_prefill: int | None,  # tokens [first_prefill, T) are prompt tokens
    ) -> None:
        """Store the step's compressor projections, then the entries its tokens close."""
        assert cache.state is not None and cache.entries is not None
        state_table = meta.tables[cache.state_group]
        state = cache.state.view(-1, cache.state.shape[-1])
        epb_s = cache.state.shape[1]
        state.index_copy_(
            0,
            entry_slots(state_table, positions, 1, epb_s),
            self.proj(x, first_prefill).to(state.dtype),
        )
        entries = cache.entries.view(-1, cache.entries.shape[-1])
        epb_e = cache.entries.shape[1]
        table = meta.tables[cache.entries_group]
        rows = closing_rows(positions.shape[0], meta.spans, self.m)
        if rows is not None:  # prompt rows: only the tokens that close a window
            if not rows:
                return
            idx = torch.tensor(rows, dtype=torch.int64, device=positions.device)
            state_table, positions = state_table.index_select(0, idx), positions[idx]
            table = table.index_select(0, idx)
        self._close_windows(state, state_table, epb_s, positions, entries, table, epb_e)

    def token_keys(
        self,
        x: torch.Tensor,  # [T, H_model]
        xq: torch.Tensor,  # [T, q_lora_rank]
        positions: torch.Tensor,
        cache: LayerCaches,
        meta: TokenTableMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # keys [T, K, D], additive mask [T, K]
        """Each token's compressed keys, gathered through its own row's table."""
        assert cache.entries is not None
        entries = cache.entries.view(-1, cache.entries.shape[-1])
        num = meta.max_len // self.m  # entries any row of the step can have
        if num == 0:
            return None
        idx = torch.arange(num, device=x.device).expand(x.shape[0], num)
        valid = idx < ((positions + 1) // self.m)[:, None]
        table = meta.tables[cache.entries_group]
        stored = gather_entries(entries, table, idx, cache.entries.shape[1], valid)
        d = self.p.head_dim
        if not self.csa:
            return stored, additive_mask(valid)
        top, top_valid = self._top(x, xq, positions, stored[..., d:], valid, None)
        keys = stored[..., :d].gather(1, top[..., None].expand(-1, -1, d))
        return keys, additive_mask(top_valid)

    def block_keys(
        self,
        x: torch.Tensor,  # [n, H_model] consecutive tokens of one row
        xq: torch.Tensor,
        positions: torch.Tensor,  # [n] first + 0 .. n - 1
        end: int,  # host: the last position + 1
        cache: LayerCaches,
        table: torch.Tensor,  # [1, C] the row's entries table
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Compressed keys of a block of one row's queries: HCA's entries once for the
        block ([E, D], mask [n, E]); CSA's top-k per query ([n, k, D], mask [n, k])."""
        assert cache.entries is not None
        num = end // self.m  # every entry of the block is written by now
        if num == 0:
            return None
        entries = cache.entries.view(-1, cache.entries.shape[-1])
        idx = torch.arange(num, device=x.device)[None]
        stored = gather_entries(entries, table, idx, cache.entries.shape[1], idx >= 0)[0]
        valid = idx < ((positions + 1) // self.m)[:, None]  # [n, E]
        d = self.p.head_dim
        if not self.csa:
            return stored, additive_mask(valid)
        top, top_valid = self._top(x, xq, positions, stored[:, d:], valid, 0)
        return stored[:, :d][top], additive_mask(top_valid)

    def _close_windows(
        self,
        state: torch.Tensor,
        state_table: torch.Tensor,
        epb_s: int,
        positions: torch.Tensor,
        entries: torch.Tensor,
        entry_table: torch.Tensor,
        epb_e: int,
    ) -> None:
        m = self.m
        window = positions // m
        offs = torch.arange(m, device=positions.device)
        wpos = window[:, None] * m + offs  # [T, m]
        cur = state.index_select(0, entry_slots(state_table, wpos, 1, epb_s).flatten())
        cur = cur.view(*wpos.shape, -1)
        prev = has_prev = None
        if self.csa:
            has_prev = window >= 1
            ppos = (wpos - m).clamp(min=0)
            prev = state.index_select(0, entry_slots(state_table, ppos, 1, epb_s).flatten())
            prev = prev.view(*wpos.shape, -1)
        parts, col = [], 0
        for pool in self.pools:
            span = slice(col, col + 2 * pool.width)
            p_prev = prev[..., span] if prev is not None else None
            parts.append(pool.entries(cur[..., span], p_prev, has_prev))
            col += 2 * pool.width
        start = window * m
        rotated = [self.rope(e[:, None], start)[:, 0] for e in parts]
        closes = (positions + 1) % m == 0
        dst = torch.where(
            closes,
            entry_slots(entry_table, window, 1, epb_e),
            scratch_slots(entry_table, epb_e),
        )
        entries.index_copy_(0, dst, torch.cat(rotated, dim=-1).to(entries.dtype))

    def _top(
        self,
        x: torch.Tensor,
        xq: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,  # [T, E, Di] the indexer's entries, or [E, Di] shared by all
        valid: torch.Tensor,  # [T, E]
        first_prefill: int | None,  # 0: prompt rows (a block), None: decode-like rows
    ) -> tuple[torch.Tensor, torch.Tensor]:  # top entries [T, k], and which are valid
        p, t = self.p, x.shape[0]
        q = self.iq(xq, first_prefill).view(t, p.index_n_heads, p.index_head_dim)
        q = self.rope(q, positions)
        eq = "thd,ted->the" if keys.dim() == 3 else "thd,ed->the"
        scores = torch.einsum(eq, q.float(), keys.float()).relu()
        scores = scores * p.index_head_dim**-0.5
        weights = self.iw(x, first_prefill).float() * p.index_n_heads**-0.5  # [T, Hi]
        total = (scores * weights[..., None]).sum(dim=1)  # [T, E]
        total = total.masked_fill(~valid, float("-inf"))
        top = total.topk(min(p.index_topk, total.shape[1]), dim=-1).indices
        return top, valid.gather(1, top)


def closing_rows(
    num_tokens: int, spans: tuple[tuple[int, int, int], ...], m: int
) -> list[int] | None:
    """The step's tokens that compute an entry: every token outside the prefill spans
    (their positions are not read on the host), and in a span only those at position
    m - 1 (mod m); None when every token does (no spans)."""
    if not spans:
        return None
    rows: list[int] = []
    at = 0
    for start, n, first in spans:
        rows.extend(range(at, start))
        rows.extend(range(start + (m - 1 - first) % m, start + n, m))
        at = start + n
    rows.extend(range(at, num_tokens))
    return rows


def additive_mask(valid: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    return torch.where(valid, zero, torch.full_like(zero, float("-inf")))
