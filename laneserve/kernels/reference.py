"""The torch composite implementation of :class:`~laneserve.kernels.base.Kernels`.

The reference the C++ ops are tested against and the fallback where the extension is
unavailable: plain torch ops, so it runs on any device (CUDA included) and float dtype.
No batch-invariance guarantee (it inherits whatever torch / BLAS does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.kernels import q8, quant, scaled, torch_attention, weights
from laneserve.kernels.quant import QuantWeight
from laneserve.kernels.scaled import ScaledWeight
from laneserve.kernels.weights import PackedWeight

LAYOUT_TORCH = "torch"  # TorchKernels: plain [N, K] for F.linear (fp32 on CPU)
SCALED_LAYOUT = "scaled-{}-torch"  # block-scaled fp8 / fp4 as stored (scaled.py)


def unpacked(w: PackedWeight) -> ScaledWeight:
    """The ScaledWeight a TorchKernels block-scaled PackedWeight holds."""
    assert w.scale is not None and w.group is not None
    fmt = w.layout.split("-")[1]
    return ScaledWeight(w.data, w.scale, fmt, w.in_features, w.group)


class TorchKernels:
    """Pure-torch implementations (reference and fallback; any device, any float dtype).

    Computes in the activations' dtype (float32 on CPU; the weight dtype on CUDA).
    """

    name = "torch"

    def pack_linear_weight(self, w: torch.Tensor, quantize: str | None = None) -> PackedWeight:
        # NOTE: the weight is stored in the dtype linear() computes in. On CPU the
        # activations are fp32, so bf16/fp16 weights are upcast once here (fp32 MKL GEMM
        # beats torch's emulated bf16 GEMM on AVX2; costs 2x memory). Elsewhere (CUDA)
        # activations are in the weight dtype and the weight is kept as is. An int8
        # weight is stored dequantized (q * scale): the same values, no speed gain.
        weights.check_weight(w, quantize)
        data, dtype = w.detach(), w.dtype
        if quantize == "int8":
            q, scale = weights.quantize_int8(data)
            deq = q.float() * scale[:, None]
            data, dtype = deq if deq.device.type == "cpu" else deq.to(data.dtype), torch.int8
        if data.device.type == "cpu":
            data = data.to(torch.float32)
        return PackedWeight(data.contiguous(), w.shape[0], w.shape[1], dtype, LAYOUT_TORCH)

    def pack_gguf_weight(self, w: QuantWeight) -> PackedWeight:
        if w.activations == "q8":  # the common form, for q8.reference_linear
            q, s, o = quant.common_form(w)
            n, k = w.shape
            layout = f"gguf-{w.qtype}{q8.TORCH_LAYOUT_SUFFIX}"
            return PackedWeight(q.contiguous(), n, k, torch.int16, layout, s, o)
        # The exact fp32 values the native kernel computes (quant.py), stored dense.
        return self.pack_linear_weight(quant.dequantize(w))

    def pack_scaled_weight(self, w: ScaledWeight) -> PackedWeight:
        n, k = w.shape
        layout = SCALED_LAYOUT.format(w.fmt)
        return PackedWeight(w.data, n, k, torch.uint8, layout, w.scale, group=w.group)

    def linear(
        self,
        x: torch.Tensor,  # [M, K] activations (float32 on CPU)
        w: PackedWeight,
        bias: torch.Tensor | None = None,  # [N]
        first_prefill: int | None = None,  # unused: every row takes the same path here
    ) -> torch.Tensor:  # [M, N], x.dtype
        if w.layout.endswith(q8.TORCH_LAYOUT_SUFFIX):
            assert w.scale is not None
            return q8.reference_linear(x, w.data, w.scale, w.offset, bias)
        if w.group is not None:  # block-scaled: dequantized a row block at a time
            return scaled.reference_linear(x, unpacked(w), bias)
        weight = w.data if w.data.dtype == x.dtype else w.data.to(x.dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def rms_norm(
        self,
        x: torch.Tensor,  # [M, H]
        weight: torch.Tensor,  # [H]
        eps: float,
    ) -> torch.Tensor:  # [M, H]
        # HF LlamaRMSNorm: statistics in fp32, normalized x cast back, then * weight.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,  # [M, H], overwritten with the normed output
        residual: torch.Tensor,  # [M, H], overwritten with x + residual
        weight: torch.Tensor,  # [H]
        eps: float,
    ) -> None:
        residual.add_(x)
        x.copy_(self.rms_norm(residual, weight, eps))

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq*D] (row stride may exceed the width) or [T, Hq, D]
        k: torch.Tensor,  # [T, Hk*D] or [T, Hk, D]
        head_dim: int,
        cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:D/2], sin in [D/2:]
    ) -> None:
        half = head_dim // 2
        cs = cos_sin_cache[positions.long()]
        cos = cs[:, None, :half]
        sin = cs[:, None, half:]
        for t in (q, k):
            heads = t.view(t.shape[0], -1, head_dim)
            x1, x2 = heads[..., :half], heads[..., half:]
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            x1.copy_(o1)
            x2.copy_(o2)

    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        i = x.shape[-1] // 2  # [M, 2I] -> [M, I]
        if limit is None:
            return F.silu(x[..., :i]) * x[..., i:]
        return F.silu(x[..., :i].clamp(max=limit)) * x[..., i:].clamp(min=-limit, max=limit)

    def hyper_pre(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        iters: int,
        eps: float,
        rms_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, n = streams.shape[:2]
        flat = streams.reshape(t, -1).float()
        normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
        mix = F.linear(normed, fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        s_pre, s_post, s_comb = scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(t, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    def hyper_post(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        dtype = torch.promote_types(streams.dtype, out.dtype)
        mixed = torch.matmul(comb.transpose(-1, -2), streams.float())
        return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(dtype)

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D] (float32 on CPU)
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        seq_lens: torch.Tensor,  # [S] int32
        query_start_loc: torch.Tensor,  # [S+1] int32
        scale: float,
        last_slot: torch.Tensor | None = None,  # [S] int64: the last key's slot (-1: table)
    ) -> torch.Tensor:  # [T, Hq, D], q.dtype
        return torch_attention.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, last_slot
        )

    def causal_attention_bf16(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:  # [n, Hq, Dv] float32
        n, nk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
        mask = None
        if nk > n:  # bottom-right aligned: query i sits at position nk - n + i
            mask = (
                torch.arange(nk, device=q.device)
                <= torch.arange(nk - n, nk, device=q.device)[:, None]
            )
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.bfloat16().transpose(0, 1).unsqueeze(0),
            k.bfloat16().transpose(0, 1).unsqueeze(0),
            v.bfloat16().transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1 and mask is None,
        )
        return out.squeeze(0).transpose(0, 1).float()

    def write_kv_cache(
        self,
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64; slot = block * block_size + offset; <0 skip
    ) -> None:
        torch_attention.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def verify_greedy(
        self,
        logits: torch.Tensor,  # [R * (K + 1) + R * W, V]: rows' positions, then alternatives
        drafts: torch.Tensor,  # [R, K] int64, K >= 1
        num_valid: torch.Tensor,  # [R] int64 real drafts per row
        alternatives: torch.Tensor,  # [R, W] int64 (W may be 0), distinct from drafts[:, 0]
    ) -> tuple[torch.Tensor, ...]:  # tokens [R, K + 1], accepted [R], hit [R], choice [R]
        """Greedy verification of dense speculative rows (see sample/rejection_sampler.py):
        accept d_j while it equals argmax_j; when d_0 is rejected, accept the alternative
        equal to argmax_0 (if any), followed by its own row's argmax."""
        r, k = drafts.shape
        argmax = logits.argmax(dim=-1)
        tokens = argmax[: r * (k + 1)].view(r, k + 1)
        ok = (drafts == tokens[:, :k]) & (
            torch.arange(k, device=drafts.device) < num_valid[:, None]
        )
        accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
        if alternatives.shape[1] == 0:
            return tokens, accepted, torch.zeros_like(ok[:, 0]), torch.zeros_like(accepted)
        bonus = argmax[r * (k + 1) :].view(r, -1)
        retry = (num_valid >= 1) & ~ok[:, 0]  # a real first draft, rejected
        alt_ok = (alternatives == tokens[:, :1]) & retry[:, None]
        hit = alt_ok.any(dim=1)
        choice = alt_ok.to(torch.int64).argmax(dim=1)
        tokens[:, 1] = torch.where(hit, bonus.gather(1, choice[:, None]).squeeze(1), tokens[:, 1])
        return tokens, accepted.masked_fill_(hit, 1), hit, choice

    def commit_side_rows(
        self,
        k_stack: torch.Tensor,  # [L, blocks, bs, Hk, D] a cache group's keys, every layer
        v_stack: torch.Tensor,
        side_slots: torch.Tensor,  # [R, W] int64 each alternative's scratch slot
        real_slot: torch.Tensor,  # [R] int64 the request's slot at p + 1
        hit: torch.Tensor,  # [R] bool an alternative was accepted
        choice: torch.Tensor,  # [R] int64 which one
        hidden: torch.Tensor,  # [T, H] main rows' hidden, patched in place
        side_hidden: torch.Tensor,  # [R * W, H]
        first_draft: torch.Tensor,  # [R] int64 token row of each row's d1
    ) -> None:
        """Token tree: an accepted alternative becomes the request's token at p + 1 (its
        K/V copied into the request's slot in every layer, its hidden row over d1's)."""
        picked = side_slots.gather(1, choice[:, None]).squeeze(1)
        src = torch.where(hit, picked, real_slot)  # no hit: the slot onto itself
        for stack in (k_stack, v_stack):
            flat = stack.flatten(1, 2)  # [L, blocks * bs, Hk, D] (a view)
            flat.index_copy_(1, real_slot, flat.index_select(1, src))
        w = side_slots.shape[1]
        alt_h = side_hidden.view(-1, w, side_hidden.shape[1])
        alt_h = alt_h[torch.arange(alt_h.shape[0], device=alt_h.device), choice]
        own = hidden.index_select(0, first_draft)
        hidden.index_copy_(0, first_draft, torch.where(hit[:, None], alt_h, own))

    def ngram_lookup(
        self,
        history: torch.Tensor,  # [S, W] int64 every state slot's tokens
        committed: torch.Tensor,  # [S] int64 known tokens per slot (<= width)
        slots: torch.Tensor,  # [R] int64 the rows' slots
        width: int,  # host bound on every row's length (<= W)
        k: int,
        n_min: int,
        n_max: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [R, k], num [R] (0 = no match)
        """Prompt lookup: the row's last n tokens (n from n_max down to n_min), their latest
        earlier occurrence in its history (ending before the suffix starts), and the up to
        k tokens that followed it. Tensor ops only: no host synchronisation."""
        hist = history.index_select(0, slots)[:, :width]
        lengths = committed.index_select(0, slots)
        r, w = hist.shape
        device = hist.device
        best = torch.full((r,), -1, dtype=torch.int64, device=device)  # index after the match
        for n in range(n_max, n_min - 1, -1):
            if w < n + 1:
                continue
            idx = (lengths[:, None] - n + torch.arange(n, device=device)[None, :]).clamp(min=0)
            suffix = hist.gather(1, idx)  # [R, n]
            windows = hist.unfold(1, n, 1)  # [R, W - n + 1, n]
            match = (windows == suffix[:, None, :]).all(dim=-1)
            starts = torch.arange(windows.shape[1], device=device)[None, :]
            # NOTE: an *earlier* occurrence: it must end before the suffix starts
            # over itself, i.e. at least one known token follows it.
            ok = match & (starts + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
            latest = torch.where(ok, starts, torch.full_like(starts, -1)).amax(dim=1)
            found = (latest >= 0) & (best < 0)
            best = torch.where(found, latest + n, best)
        cols = best[:, None].clamp(min=0) + torch.arange(k, device=device)[None, :]
        drafts = hist.gather(1, cols.clamp(max=w - 1))
        num = torch.where(best >= 0, (lengths - best).clamp(0, k), torch.zeros_like(best))
        return drafts, num

    def slot_mapping(
        self,
        table: torch.Tensor,  # [R, blocks] int32 or int64 block table per row
        token_row: torch.Tensor,  # [T] int64 each token's row
        positions: torch.Tensor,  # [T] int64
        block_size: int,
    ) -> torch.Tensor:  # [T] int64 KV cache slot of each token
        """Paged KV slot of each token: table[row, p // bs] * bs + p % bs."""
        block = table[token_row, torch.div(positions, block_size, rounding_mode="floor")]
        return block.to(torch.int64) * block_size + positions % block_size

    def top_tokens(
        self,
        logits: torch.Tensor,  # [N, V] float32
        n: int,
        vocab: torch.Tensor | None = None,  # [V] int64 token id of each column
    ) -> torch.Tensor:  # [N, n] int64
        """Each row's n best columns, best first (NaN ranks highest, as in torch.argmax),
        mapped through vocab when given. Ties: the lower column first for n = 1 and in the
        C++ op; here, for n > 1, in torch.topk's order (a full stable sort of a draft
        vocabulary costs ~0.4 ms on CPU)."""
        if not 1 <= n <= logits.shape[1]:
            raise ValueError(f"top_tokens: n = {n} outside [1, V = {logits.shape[1]}]")
        best = logits.argmax(dim=-1, keepdim=True) if n == 1 else logits.topk(n, dim=-1).indices
        return best if vocab is None else vocab[best]

    def write_drafts(
        self,
        drafts: torch.Tensor,  # [S, K] int64 state: each slot's drafts
        num_drafts: torch.Tensor,  # [S] int64 state
        side_drafts: torch.Tensor,  # [S, W] int64 state: alternatives to drafts[:, 0]
        slots: torch.Tensor,  # [R] int64 the rows' state slots
        chain: torch.Tensor,  # [R, k] int64 the head's drafts
        top: torch.Tensor | None = None,  # [R, 1 + A] the head's best first tokens
        found: torch.Tensor | None = None,  # [R, k] lookup drafts
        num: torch.Tensor | None = None,  # [R] lookup drafts found (0: none)
    ) -> None:
        """The next step's drafts into the rows' slots: found[r] (num[r] of them) where the
        lookup found any, else chain[r] (k); side_drafts[s, :A] = the best A of top[r]
        other than the row's first draft (a token tree's candidates must all differ)."""
        k = chain.shape[1]
        if (found is None) != (num is None):
            raise ValueError("write_drafts: found and num go together")
        first, count = chain, torch.full_like(slots, k)
        if found is not None and num is not None:  # both or neither (checked above)
            hit = num > 0
            first = torch.where(hit[:, None], found, chain)
            count = torch.where(hit, num, count)
        drafts[slots, :k] = first
        num_drafts.index_copy_(0, slots, count)
        if top is not None and top.shape[1] > 1:
            differ = top != first[:, :1]
            order = torch.sort((~differ).to(torch.int8), dim=1, stable=True).indices
            side_drafts[slots, : top.shape[1] - 1] = top.gather(1, order)[:, :-1]
