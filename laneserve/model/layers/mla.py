"""Multi-head latent attention (MLA) over a paged latent cache.

Per token the cache keeps one entry of `kv_lora_rank + qk_rope_head_dim` values:
the normed latent c (shared by all heads) and the rotated rope key k_pe.

```
 q      = q_b(norm(q_a(x)))  or  q_proj(x)          [T, H, nope + rope]
 c, kpe = split(kv_a(x));  c = norm(c);  kpe = rope(kpe)
 k_h    = [W_uk_h c ; kpe],   v_h = W_uv_h c          (W_uk, W_uv: rows of kv_b_proj)
```
A prompt chunk expands K and V from the latents and runs SDPA (as transformers
does). A decode-like row uses the absorbed form, which never expands the cache:
score_j = (W_uk_h^T q_nope_h) . c_j + q_pe_h . kpe_j and out_h = W_uv_h (sum_j p_j c_j).
The glossary of decode-like / prefill rows is in `attention.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import Kernels
from laneserve.kernels.base import PAGED_ATTENTION_MAX_HEAD_DIM
from laneserve.kernels.quant import cat_rows
from laneserve.model.arch import ArchConfig
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.model.layers.linear import Linear, linear_weight
from laneserve.model.layers.norm import RMSNorm
from laneserve.model.layers.parallel import RowParallelLinear, column_weight, row_weight
from laneserve.model.layers.rope import MlaRotary, softmax_scale
from laneserve.model.layers.weights import WeightGetter


class MlaAttention:
    """With tensor parallelism (`tp`) a rank holds its heads' rows of q_b (or V2's
    q_proj) and kv_b, and their columns of o_proj (all-reduced); q_a, kv_a, their norms
    and the latent cache are whole on every rank (the latent is per token, not per head)."""

    def __init__(
        self,
        arch: ArchConfig,
        kernels: Kernels,
        get: WeightGetter,
        prefix: str,
        rotary: MlaRotary,
        tp: TensorParallel = SINGLE,
    ) -> None:
        p = arch.deepseek
        assert p is not None
        self.p, self.rotary, self.heads = p, rotary, arch.num_heads // tp.size  # this rank's
        eps = arch.rms_norm_eps
        a = f"{prefix}.self_attn"

        def bias(name: str) -> torch.Tensor | None:
            return get(f"{a}.{name}.bias") if p.attention_bias else None

        # q LoRA (q_a -> norm -> q_b) or a plain q_proj. With q LoRA, q_a and kv_a read
        # the same input: one fused projection (each output is the same FMA chain).
        self.q_norm: RMSNorm | None = None
        kv_a = linear_weight(get, f"{a}.kv_a_proj_with_mqa.weight")
        kv_a_bias = bias("kv_a_proj_with_mqa")
        self.q_a_rank = 0
        if p.q_lora_rank is None:
            q = f"{a}.q_proj"
            w = (
                linear_weight(get, f"{q}.weight")
                if tp.size == 1
                else _heads(get, q, arch, p.qk_head_dim, tp)
            )
            self.q_proj = Linear(kernels, w, None)
            self.in_proj = Linear(kernels, kv_a, kv_a_bias)
        else:
            self.q_a_rank = p.q_lora_rank
            self.q_norm = RMSNorm(kernels, get(f"{a}.q_a_layernorm.weight"), eps)
            q = f"{a}.q_b_proj"
            w = (
                linear_weight(get, f"{q}.weight")
                if tp.size == 1
                else _heads(get, q, arch, p.qk_head_dim, tp)
            )
            self.q_proj = Linear(kernels, w, None)
            q_a_bias = bias("q_a_proj")
            fused_bias = None
            if q_a_bias is not None and kv_a_bias is not None:
                fused_bias = torch.cat([q_a_bias, kv_a_bias])
            q_a = linear_weight(get, f"{a}.q_a_proj.weight")
            self.in_proj = Linear(kernels, cat_rows([q_a, kv_a]), fused_bias)
        self.kv_norm = RMSNorm(kernels, get(f"{a}.kv_a_layernorm.weight"), eps)
        # [H * (nope + v), r] (its rows for this rank's heads)
        kv_b = _heads(get, f"{a}.kv_b_proj", arch, p.qk_nope_head_dim + p.v_head_dim, tp)
        self.kv_b = Linear(kernels, kv_b, None)
        w = kv_b.view(self.heads, p.qk_nope_head_dim + p.v_head_dim, p.kv_lora_rank)
        act = rotary.cos.dtype  # the absorbed decode multiplies activations by these
        self.w_uk = w[:, : p.qk_nope_head_dim].to(act).contiguous()  # [H, nope, r]
        # [H, r, v]: the right operand of the per-head output matmul
        self.w_uv = w[:, p.qk_nope_head_dim :].transpose(1, 2).to(act).contiguous()
        # The absorbed decode is multi-query attention with one latent "head" of
        # r + rope values, keys and values both read from the latent entries: the
        # kernels' paged attention runs it when it takes that head size (CPU, <= 576).
        self.kernels = kernels
        self.paged_decode = (
            kernels.name == "cpu"
            and p.latent_dim % 8 == 0
            and p.latent_dim <= PAGED_ATTENTION_MAX_HEAD_DIM
        )
        if tp.size == 1:  # the checkpoint's fp8 kept as stored where the getter keeps it
            o_proj = linear_weight(get, f"{a}.o_proj.weight")
            self.o_proj: Linear | RowParallelLinear = Linear(kernels, o_proj, bias("o_proj"))
        else:
            self.o_proj = _o_proj(kernels, get, a, arch, bias("o_proj"), tp)
        self.scale = softmax_scale(arch.rope_scaling or {}, p.qk_head_dim)

    def __call__(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, H_model] normed input
        cache: tuple[torch.Tensor, ...],  # (latent [blocks, bs, 1, r + rope],)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        _, q_nope, q_pe, latent = self.project(positions, x)
        store = self.write(latent, cache, meta)
        out = torch.empty(
            (x.shape[0], self.heads, self.p.v_head_dim), dtype=x.dtype, device=x.device
        )
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], store, meta)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], latent[rows], store, span)
        return self.output(out)

    def project(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q LoRA output after its norm (x itself without q LoRA) [T, q_lora_rank],
        q_nope [T, H, nope], rotated q_pe [T, H, rope], cache entries [T, r + rope])."""
        p, t = self.p, x.shape[0]
        proj = self.in_proj(x)  # [T, q_lora_rank + r + rope] (or [T, r + rope])
        q_in = x if self.q_norm is None else self.q_norm(proj[:, : self.q_a_rank])
        ckv = proj[:, self.q_a_rank :]
        q = self.q_proj(q_in).view(t, self.heads, p.qk_head_dim)
        q_nope = q[..., : p.qk_nope_head_dim]
        # one rotation for the query heads and the latent's rope key (the same per-element math)
        pe = torch.cat([q[..., p.qk_nope_head_dim :], ckv[:, None, p.kv_lora_rank :]], dim=1)
        pe = self.rotary(positions, pe)  # [T, H + 1, rope]
        q_pe, k_pe = pe[:, : self.heads], pe[:, self.heads]
        c = self.kv_norm(ckv[:, : p.kv_lora_rank])
        return q_in, q_nope, q_pe, torch.cat([c, k_pe], dim=-1)

    def write(
        self, latent: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
    ) -> torch.Tensor:  # the layer's store [blocks, bs, 1, r + rope]
        (store,) = cache
        flat = store.view(-1, self.p.latent_dim)
        flat.index_copy_(0, meta.slot_mapping, latent.to(store.dtype))
        return store

    def output(self, out: torch.Tensor) -> torch.Tensor:  # [T, H, v] -> [T, H_model]
        return self.o_proj(out.view(out.shape[0], self.heads * self.p.v_head_dim))

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:  # [n, H, nope] -> [n, H, r]
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def expand(self, o_lat: torch.Tensor) -> torch.Tensor:  # [n, H, r] -> [n, H, v]
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv).transpose(0, 1)

    def _prefill(
        self,
        q_nope: torch.Tensor,  # [n, H, nope]
        q_pe: torch.Tensor,  # [n, H, rope]
        latent: torch.Tensor,  # [n, r + rope] this chunk's entries
        store: torch.Tensor,
        span: PrefillSpan,
    ) -> torch.Tensor:  # [n, H, v]
        p, mask = self.p, None
        if span.context_len:
            total = span.context_len + span.num_tokens
            blocks = store.index_select(0, span.block_ids).flatten(0, 1)  # [nb * bs, 1, D]
            latent = blocks[:total, 0].to(q_nope.dtype)
            q_pos = torch.arange(span.context_len, total, device=q_nope.device)
            mask = torch.arange(total, device=q_nope.device)[None, :] <= q_pos[:, None]
        n_keys = latent.shape[0]
        kv = self.kv_b(latent[:, : p.kv_lora_rank].contiguous())
        kv = kv.view(n_keys, self.heads, p.qk_nope_head_dim + p.v_head_dim)
        k_pe = latent[:, None, p.kv_lora_rank :].expand(-1, self.heads, -1)
        k = torch.cat([kv[..., : p.qk_nope_head_dim], k_pe], dim=-1)
        v = kv[..., p.qk_nope_head_dim :]
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return o.squeeze(0).transpose(0, 1)

    def _decode(
        self,
        q_nope: torch.Tensor,  # [nd, H, nope]
        q_pe: torch.Tensor,  # [nd, H, rope]
        store: torch.Tensor,  # [blocks, bs, 1, r + rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [nd, H, v]
        """Absorbed form: q_lat = W_uk^T q_nope per head, attention over the latents,
        out = W_uv o_lat per head. No host synchronisation."""
        assert meta.decode_query_start_loc is not None and meta.decode_seq_lens is not None
        assert meta.decode_block_tables is not None  # a decode step has them all
        q_lat = self.absorb(q_nope)  # [nd, H, r]
        if self.paged_decode:
            q = torch.cat([q_lat, q_pe], dim=-1)  # [nd, H, r + rope]
            o = self.kernels.paged_attention(
                q,
                store,
                store,  # values: the same entries; the rope part of the output is dropped
                meta.decode_block_tables,
                meta.decode_seq_lens,
                meta.decode_query_start_loc,
                self.scale,
                meta.decode_last_slot,  # side rows: their own entry from a scratch slot
            )
            o_lat = o[..., : self.p.kv_lora_rank]
        else:
            o_lat = self._decode_torch(q_lat, q_pe, store, meta)
        return self.expand(o_lat)

    def _decode_torch(
        self,
        q_lat: torch.Tensor,  # [nd, H, r]
        q_pe: torch.Tensor,  # [nd, H, rope]
        store: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [nd, H, r]
        """Attention over each row's blocks in torch ops (any device and head size)."""
        p, nd = self.p, q_lat.shape[0]
        assert meta.decode_query_start_loc is not None and meta.decode_seq_lens is not None
        assert meta.decode_block_tables is not None
        starts = meta.decode_query_start_loc.to(torch.int64)  # [S + 1]
        tok = torch.arange(nd, device=q_lat.device)
        seq = torch.searchsorted(starts[1:], tok, right=True)  # [nd] the token's sequence
        # keys visible to token i: seq_len - (tokens of its sequence after it)
        limit = meta.decode_seq_lens.to(torch.int64).index_select(0, seq) - (
            starts.index_select(0, seq + 1) - tok
        )  # [nd] = its position
        # table entries past a row's blocks may hold anything: clamped into the cache
        tables = meta.decode_block_tables.to(torch.int64).index_select(0, seq)  # [nd, nb]
        tables = tables.clamp(0, store.shape[0] - 1)
        keys = store.index_select(0, tables.flatten()).view(nd, -1, p.latent_dim)
        if meta.decode_last_slot is not None:
            _own_last_keys(keys, store, meta.decode_last_slot.index_select(0, seq), limit)
        visible = torch.arange(keys.shape[1], device=keys.device)[None, :] <= limit[:, None]
        return latent_attention(q_lat, q_pe, keys, visible, self.scale, p.kv_lora_rank)


def latent_attention(
    q_lat: torch.Tensor,  # [n, H, r] absorbed queries
    q_pe: torch.Tensor,  # [n, H, rope]
    keys: torch.Tensor,  # [n, L, r + rope] each query's own cache entries
    visible: torch.Tensor,  # [n, L] bool: which of them it attends to
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [n, H, r] the attention-weighted latents
    """Absorbed MLA attention of each query over its own entries."""
    # NOTE: entries not visible are zeroed: the cache is allocated uninitialised,
    # and a masked NaN would still reach the output as 0 x NaN
    keys = keys.to(q_lat.dtype).masked_fill(~visible[:, :, None], 0)
    c, k_pe = keys[..., :kv_lora_rank], keys[..., kv_lora_rank:]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))
    scores = (scores * scale).masked_fill(~visible[:, None, :], float("-inf"))
    return torch.bmm(scores.softmax(dim=-1), c)


def _heads(
    get: WeightGetter, name: str, arch: ArchConfig, head_rows: int, tp: TensorParallel
) -> torch.Tensor:
    """`name.weight` [heads * head_rows, in]: this rank's heads' rows (column-parallel)."""
    if tp.size == 1:
        return get(f"{name}.weight")
    return column_weight(
        get, [(f"{name}.weight", arch.num_heads, head_rows, "attention heads")], tp
    )


def _o_proj(
    kernels: Kernels,
    get: WeightGetter,
    a: str,
    arch: ArchConfig,
    bias: torch.Tensor | None,
    tp: TensorParallel,
) -> Linear | RowParallelLinear:
    """o_proj whole, or its columns of this rank's heads, all-reduced (the bias is added
    by rank 0 only: once in the sum)."""
    if tp.size == 1:
        return Linear(kernels, get(f"{a}.o_proj.weight"), bias)
    assert arch.deepseek is not None
    v = arch.deepseek.v_head_dim
    w = row_weight(get, f"{a}.o_proj.weight", arch.num_heads, v, "attention heads", tp)
    return RowParallelLinear(Linear(kernels, w, bias if tp.rank == 0 else None), tp)


def _own_last_keys(
    keys: torch.Tensor,  # [nd, L, r + rope] each token's gathered entries (written in place)
    store: torch.Tensor,  # [blocks, bs, 1, r + rope]
    last_slot: torch.Tensor,  # [nd] int64 the token's sequence's last-key slot (-1: table)
    limit: torch.Tensor,  # [nd] int64 the token's position
) -> None:
    """A token-tree side row's own entry lives in a scratch slot, not at its position in
    the request's table (which holds the first draft's): put it there. A sequence's last
    key is only visible to its last token, whose position is `limit`."""
    own = store.view(-1, store.shape[-1]).index_select(0, last_slot.clamp(min=0))
    rows = torch.arange(keys.shape[0], device=keys.device)
    cur = keys[rows, limit]
    keys[rows, limit] = torch.where((last_slot >= 0)[:, None], own, cur)
