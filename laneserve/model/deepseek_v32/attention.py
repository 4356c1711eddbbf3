"""DeepSeek Sparse Attention: MLA (`layers/mla.py`) over the past tokens the layer's
indexer (`indexer.py`) selects.

A query that sees at most `index_topk` tokens attends to all of them: a prompt chunk
whose last position is below `index_topk`, and decode rows whose block tables are no
wider than that, run MLA's own paths unchanged (the V3 computation). Otherwise each
query gathers the cache entries of its selected positions and attends over them in
MLA's absorbed form (`mla.latent_attention`), prompt rows and decode rows alike.

The two cache groups have their own block tables: the indexer scores keys through the
indexer group's, and the selected positions are read through the latent group's.
"""

from __future__ import annotations

import torch

from laneserve.model.deepseek_v32.indexer import Indexer
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.model.layers.mla import MlaAttention, latent_attention

LayerCache = tuple[torch.Tensor, ...]


class SparseMlaAttention:
    def __init__(self, mla: MlaAttention, indexer: Indexer) -> None:
        self.mla, self.indexer = mla, indexer
        self.topk = indexer.topk

    def __call__(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, H] normed input
        cache: tuple[LayerCache, LayerCache],  # (MLA latents, indexer keys) of this layer
        meta: tuple[AttentionMetadata, AttentionMetadata],  # the two groups' metadata
    ) -> torch.Tensor:
        (latents,), (keys,) = cache
        lmeta, imeta = meta
        q_lora, q_nope, q_pe, latent = self.mla.project(positions, x)
        store = self.mla.write(latent, (latents,), lmeta)
        self.indexer.write_keys(positions, x, keys, imeta.slot_mapping)
        out = torch.empty(
            (x.shape[0], self.mla.heads, self.mla.p.v_head_dim), dtype=x.dtype, device=x.device
        )
        nd = lmeta.num_decode_tokens
        if nd and self._decode_is_dense(lmeta, store):
            out[:nd] = self.mla._decode(q_nope[:nd], q_pe[:nd], store, lmeta)
        elif nd:
            q, w = self.indexer.queries(positions[:nd], x[:nd], q_lora[:nd])
            rows = _DecodeRows(lmeta, imeta, store, keys, positions[:nd])
            chosen = self.indexer.select(q, w, rows.gather(keys, rows.index_slots), positions[:nd])
            out[:nd] = self._sparse(q_nope[:nd], q_pe[:nd], store, rows.latent_slots, chosen)
        for span, ispan in zip(lmeta.prefills, imeta.prefills, strict=True):
            r = slice(span.token_start, span.token_start + span.num_tokens)
            if span.context_len + span.num_tokens <= self.topk:
                out[r] = self.mla._prefill(q_nope[r], q_pe[r], latent[r], store, span)
            else:
                out[r] = self._sparse_prefill(
                    positions[r], x[r], q_lora[r], q_nope[r], q_pe[r], store, keys, span, ispan
                )
        return self.mla.output(out)

    def _decode_is_dense(self, meta: AttentionMetadata, store: torch.Tensor) -> bool:
        """Every decode row sees at most index_topk keys (its table's width bounds it)."""
        assert meta.decode_block_tables is not None
        assert meta.decode_last_slot is None, "no token-tree side rows here"
        return meta.decode_block_tables.shape[1] * store.shape[1] <= self.topk

    def _sparse_prefill(
        self,
        positions: torch.Tensor,  # [n]
        x: torch.Tensor,
        q_lora: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        store: torch.Tensor,
        keys: torch.Tensor,
        span: PrefillSpan,  # the latent group's
        ispan: PrefillSpan,  # the indexer group's
    ) -> torch.Tensor:  # [n, H, v]
        total = span.context_len + span.num_tokens
        bs = store.shape[1]
        span_keys = keys.index_select(0, ispan.block_ids).flatten(0, 2)[:total][None]  # [1, L, Di]
        offsets = torch.arange(total, device=positions.device)
        slots = span.block_ids.index_select(0, offsets // bs) * bs + offsets % bs  # [L]
        out = torch.empty(
            (x.shape[0], self.mla.heads, self.mla.p.v_head_dim), dtype=x.dtype, device=x.device
        )
        step = self.indexer.rows_per_chunk(total)
        for s in range(0, x.shape[0], step):
            r = slice(s, s + step)
            q, w = self.indexer.queries(positions[r], x[r], q_lora[r])
            pos, ok = self.indexer.select(q, w, span_keys, positions[r])
            out[r] = self._sparse(
                q_nope[r], q_pe[r], store, slots[None].expand(pos.shape[0], -1), (pos, ok)
            )
        return out

    def _sparse(
        self,
        q_nope: torch.Tensor,  # [n, H, nope]
        q_pe: torch.Tensor,  # [n, H, rope]
        store: torch.Tensor,  # [blocks, bs, 1, r + rope]
        slots: torch.Tensor,  # [n, L] each query's latent slot per position
        chosen: tuple[torch.Tensor, torch.Tensor],  # (positions [n, k], selected [n, k])
    ) -> torch.Tensor:  # [n, H, v]
        pos, ok = chosen
        p = self.mla.p
        picked = slots.gather(1, pos)  # [n, k]
        entries = store.view(-1, p.latent_dim).index_select(0, picked.flatten())
        entries = entries.view(pos.shape[0], pos.shape[1], p.latent_dim)
        o_lat = latent_attention(
            self.mla.absorb(q_nope), q_pe, entries, ok, self.mla.scale, p.kv_lora_rank
        )
        return self.mla.expand(o_lat)


class _DecodeRows:
    """Each decode-like token's slots per position, in both groups (its sequence's tables)."""

    def __init__(
        self,
        lmeta: AttentionMetadata,
        imeta: AttentionMetadata,
        latents: torch.Tensor,  # [blocks, bs, 1, r + rope]
        keys: torch.Tensor,  # [blocks', bs, 1, Di]
        positions: torch.Tensor,  # [nd]
    ) -> None:
        starts = lmeta.decode_query_start_loc
        ltab, itab = lmeta.decode_block_tables, imeta.decode_block_tables
        assert starts is not None and ltab is not None and itab is not None
        tok = torch.arange(positions.shape[0], device=positions.device)
        seq = torch.searchsorted(starts.to(torch.int64)[1:], tok, right=True)  # [nd]
        self.latent_slots = _slots(ltab, seq, latents)
        self.index_slots = _slots(itab, seq, keys)

    @staticmethod
    def gather(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [nd, L, D]
        flat = store.view(-1, store.shape[-1])
        return flat.index_select(0, slots.flatten()).view(slots.shape[0], slots.shape[1], -1)


def _slots(table: torch.Tensor, seq: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """[nd, nb * bs] slot of every position of each token's sequence's table. Entries
    past a row's blocks may hold anything: clamped into the cache, never selected."""
    bs = store.shape[1]
    rows = table.to(torch.int64).index_select(0, seq).clamp(0, store.shape[0] - 1)  # [nd, nb]
    offsets = torch.arange(bs, device=table.device)
    return (rows[:, :, None] * bs + offsets).flatten(1)
