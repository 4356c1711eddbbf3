"""The C++-backed implementation of :class:`~laneserve.kernels.base.Kernels`.

:class:`CpuKernels` wraps the JIT-built extension (``torch.ops.laneserve``, sources beside
this file, built by ``build.py``): bf16 / fp16 / fp32 / int8 weights streamed once with
fp32 FMA accumulation; batch invariant as the protocol's module notes describe.
"""

from __future__ import annotations

import torch

from laneserve.kernels import q8, quant, scaled, weights
from laneserve.kernels.base import PAGED_ATTENTION_MAX_HEAD_DIM
from laneserve.kernels.build import KernelLib
from laneserve.kernels.quant import QuantWeight
from laneserve.kernels.reference import TorchKernels
from laneserve.kernels.scaled import ScaledWeight
from laneserve.kernels.weights import PackedWeight

# Output columns per packed weight block ([ceil(N/16), K, 16] layout).
PACK_BLOCK_N = 16

LAYOUT_BLOCKED = "blocked16"  # CpuKernels: [ceil(N/16), K, 16], zero padded
LAYOUT_BLOCKED_512 = "blocked16-avx512"  # the same; bf16 as row pairs, K padded to even
CAUSAL_ATTENTION_MAX_HEAD_DIM = 256  # causal_attention.cpp kMaxDv
_ISA_CODE = {"avx2": 0, "avx512": 1}  # linear.cpp kIsaAvx2 / kIsaAvx512
_ISA_LAYOUT = {"avx2": LAYOUT_BLOCKED, "avx512": LAYOUT_BLOCKED_512}
_HYPER_DTYPES = {torch.float32, torch.bfloat16}  # hyper.cpp's streams / outputs
# GGUF weights kept quantized (quant_linear.cpp, AVX-512 or AVX2; one record layout):
# layout name -> (the op's qtype, its isa)
_GGUF_LAYOUT = {
    f"gguf-{name}-{isa}": (code, _ISA_CODE[isa])
    for name, code in quant.QTYPE_CODE.items()
    for isa in _ISA_CODE
}
# ... with int8 activations (quant_linear_q8.cpp, AVX-512 VNNI)
_GGUF_Q8_LAYOUT = {f"gguf-{name}-q8-vnni": code for name, code in quant.QTYPE_CODE.items()}
# block-scaled fp8 / fp4 kept as stored (scaled_linear.cpp; AVX-512 or AVX2 by isa, one
# layout): layout -> the op's fmt. fp8 weights whose bytes hold no NaN (every weight the
# loader keeps: it refuses NaN) take fmt 2, which lets the AVX2 kernel skip the NaN check
# in its decode; "-nan" marks an fp8 weight with NaN bytes (fmt 0, NaN-aware decode).
_SCALED_ISA_VBMI = 2  # scaled_linear's isa: AVX-512 with fp8 decoded by VBMI permutes
_SCALED_LAYOUT = {
    "scaled-fp8-blocked16": 2,  # scaled_tiles.h kFmtFp8Finite
    "scaled-fp8-nan-blocked16": 0,  # kFmtFp8
    "scaled-fp4-blocked16": 1,  # kFmtFp4
}


class CpuKernels:
    """AVX2/FMA/F16C kernels from the C++ extension (CPU tensors, float32 activations);
    ``linear`` and the quantized linears have AVX-512 variants, picked at load
    (``lib.isa``; ``scaled_isa`` for block-scaled weights), with the same results.

    Weights (linear) and KV caches may be float32, bfloat16 or float16; all arithmetic is
    fp32. Batch invariant as base.py describes, except paged_attention
    with head_dim % 8 != 0 or above PAGED_ATTENTION_MAX_HEAD_DIM, which falls back to
    TorchKernels.
    """

    name = "cpu"

    def __init__(self, lib: KernelLib) -> None:
        self.lib = lib
        ops = lib.ops
        # Bound op handles: saves an attribute lookup chain per call on the decode path.
        self._pack = ops.pack_linear_weight
        self._linear = ops.linear
        self._linear_prefill = ops.linear_prefill
        self._quant_linear = ops.quant_linear
        self._quant_linear_q8 = ops.quant_linear_q8
        self._scaled_linear = ops.scaled_linear
        self._rms_norm = ops.rms_norm
        self._fused_add_rms_norm = ops.fused_add_rms_norm
        self._rotary = ops.rotary_embedding
        self._silu_and_mul = ops.silu_and_mul
        self._hyper_pre = ops.hyper_pre
        self._hyper_post = ops.hyper_post
        self._paged_attention = ops.paged_attention
        self._causal_attention = ops.causal_attention_bf16
        self._write_kv_cache = ops.write_kv_cache
        self._verify_greedy = ops.verify_greedy
        self._commit_side_rows = ops.commit_side_rows
        self._ngram_lookup = ops.ngram_lookup
        self._slot_mapping = ops.slot_mapping
        self._top_tokens = ops.top_tokens
        self._write_drafts = ops.write_drafts
        self._fallback = TorchKernels()
        self.isa = lib.isa  # linear's instruction set; both give the same bits
        self._isa = _ISA_CODE[lib.isa]
        self.amx = lib.amx  # prefill rows of bf16 linears use AMX tiles (linear_amx.cpp)
        self.dpbf16 = lib.dpbf16  # ... or AVX-512 BF16 dot products (linear_dpbf16.cpp)
        self.vnni = lib.vnni  # GGUF weights with int8 activations natively (q8.py)
        self.bf16_dot = lib.bf16_dot  # long prompt chunks: causal_attention.cpp
        # scaled_linear's variant: AVX2, AVX-512, or AVX-512 decoding fp8 by VBMI permutes
        self.scaled_isa = _SCALED_ISA_VBMI if lib.vbmi and lib.isa == "avx512" else self._isa
        # linear_prefill's method: 0 AMX, 1 AVX-512 BF16; None: prompt rows as decode rows
        self._prefill_method = 0 if lib.amx else 1 if lib.dpbf16 else None

    def pack_linear_weight(self, w: torch.Tensor, quantize: str | None = None) -> PackedWeight:
        weights.check_weight(w, quantize)
        layout = _ISA_LAYOUT[self.isa]
        if quantize == "int8":  # int8 blocks in the fp32 layout; the scale applies per column
            q, scale = weights.quantize_int8(w)
            data = self._pack(q, self._isa)
            return PackedWeight(data, w.shape[0], w.shape[1], torch.int8, layout, scale)
        data = self._pack(w.detach(), self._isa)
        return PackedWeight(data, w.shape[0], w.shape[1], w.dtype, layout)

    def pack_gguf_weight(self, w: QuantWeight) -> PackedWeight:
        """A GGUF-quantized weight kept quantized (quant_linear.cpp's layout, AVX-512 or
        AVX2 by ``isa``); ``linear`` maps it to the bits of its exact fp32 dequantization."""
        n, k = w.shape
        if w.activations == "q8":  # int8 activations: VNNI, else the exact torch reference
            if not self.vnni:
                return self._fallback.pack_gguf_weight(w)
            return PackedWeight(q8.repack(w), n, k, torch.uint8, f"gguf-{w.qtype}-q8-vnni")
        return PackedWeight(quant.repack(w), n, k, torch.uint8, f"gguf-{w.qtype}-{self.isa}")

    def pack_scaled_weight(self, w: ScaledWeight) -> PackedWeight:
        """A block-scaled fp8 / fp4 weight in its stored bytes, byte-transposed into
        16-column blocks (scaled.repack) for scaled_linear.cpp."""
        n, k = w.shape
        data, scale = scaled.repack(w)
        nan = "-nan" if scaled.has_nan_values(w) else ""
        layout = f"scaled-{w.fmt}{nan}-blocked16"
        return PackedWeight(data, n, k, torch.uint8, layout, scale, group=w.group)

    def linear(
        self,
        x: torch.Tensor,  # [M, K] float32
        w: PackedWeight,
        bias: torch.Tensor | None = None,  # [N] float32
        first_prefill: int | None = None,  # rows [first_prefill, M) are prompt rows
    ) -> torch.Tensor:  # [M, N] float32
        if (
            first_prefill is not None
            and self._prefill_method is not None
            and w.dtype == torch.bfloat16
            and first_prefill < x.shape[0]
        ):
            return self._linear_prefill(
                x, w.data, w.out_features, bias, first_prefill, self._prefill_method
            )
        if w.group is not None:  # block-scaled fp8 / fp4 (pack_scaled_weight)
            fmt = _SCALED_LAYOUT[w.layout]
            return self._scaled_linear(
                x, w.data, w.scale, w.out_features, fmt, w.group, bias, self.scaled_isa
            )
        if w.dtype is torch.uint8:  # GGUF blocks (pack_gguf_weight)
            native = _GGUF_LAYOUT.get(w.layout)
            if native is not None:
                return self._quant_linear(x, w.data, w.out_features, native[0], bias, native[1])
            code = _GGUF_Q8_LAYOUT[w.layout]
            return self._quant_linear_q8(x, w.data, w.out_features, code, bias)
        if w.layout.endswith(q8.TORCH_LAYOUT_SUFFIX):  # no VNNI: the exact reference
            return self._fallback.linear(x, w, bias)
        return self._linear(x, w.data, w.out_features, bias, self._isa, w.scale)

    def rms_norm(
        self,
        x: torch.Tensor,  # [M, H] float32
        weight: torch.Tensor,  # [H] float32
        eps: float,
    ) -> torch.Tensor:  # [M, H]
        return self._rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,  # [M, H] float32, contiguous; overwritten with the normed output
        residual: torch.Tensor,  # [M, H] float32, contiguous; overwritten with x + residual
        weight: torch.Tensor,  # [H]
        eps: float,
    ) -> None:
        self._fused_add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq*D] any row stride, or [T, Hq, D]; float32, in place
        k: torch.Tensor,  # [T, Hk*D] / [T, Hk, D]
        head_dim: int,
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cos | sin
    ) -> None:
        # q/k may be column slices of a fused qkv output (row stride > width): the kernel
        # handles any row stride as long as each row's heads are contiguous.
        self._rotary(positions, q, k, head_dim, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        if x.dtype != torch.float32:  # [M, 2I] f32 -> [M, I]
            return self._fallback.silu_and_mul(x, limit)
        return self._silu_and_mul(x, limit)

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
        if streams.shape[-1] % 8 or streams.dtype not in _HYPER_DTYPES:
            return self._fallback.hyper_pre(streams, fn, base, scale, iters, eps, rms_eps)
        return self._hyper_pre(streams.contiguous(), fn, base, scale, iters, eps, rms_eps)

    def hyper_post(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        if streams.shape[-1] % 8 or {streams.dtype, out.dtype} - _HYPER_DTYPES:
            return self._fallback.hyper_post(streams, out, post, comb)
        return self._hyper_post(streams.contiguous(), out.contiguous(), post, comb)

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D] float32 (unit stride on D)
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] f32 | bf16 | f16, contiguous
        v_cache: torch.Tensor,  # same as k_cache
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        seq_lens: torch.Tensor,  # [S] int32, keys per sequence incl. this step's tokens
        query_start_loc: torch.Tensor,  # [S+1] int32
        scale: float,
        last_slot: torch.Tensor | None = None,  # [S] int64: the last key's slot (-1: table)
    ) -> torch.Tensor:  # [T, Hq, D] float32
        d = q.shape[-1]
        if d % 8 != 0 or d > PAGED_ATTENTION_MAX_HEAD_DIM:  # vectorized by 8, bounded state
            return self._fallback.paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, last_slot
            )
        return self._paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, last_slot
        )

    def causal_attention_bf16(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        dk, dv = q.shape[-1], v.shape[-1]
        if not self.bf16_dot or dk % 2 or dv % 16 or dv > CAUSAL_ATTENTION_MAX_HEAD_DIM:
            return self._fallback.causal_attention_bf16(q, k, v, scale)
        return self._causal_attention(q, k, v, scale)

    def write_kv_cache(
        self,
        k: torch.Tensor,  # [T, Hk, D] float32 (rows may be strided views of a qkv output)
        v: torch.Tensor,  # [T, Hk, D] float32
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D], converted with RNE
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset; < 0 skipped
    ) -> None:
        self._write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def verify_greedy(
        self,
        logits: torch.Tensor,  # [R * (K + 1) + R * W, V] float32
        drafts: torch.Tensor,  # [R, K] int64
        num_valid: torch.Tensor,  # [R] int64
        alternatives: torch.Tensor,  # [R, W] int64
    ) -> tuple[torch.Tensor, ...]:  # see Kernels.verify_greedy
        return self._verify_greedy(logits, drafts, num_valid, alternatives)

    def commit_side_rows(
        self,
        k_stack: torch.Tensor,
        v_stack: torch.Tensor,
        side_slots: torch.Tensor,
        real_slot: torch.Tensor,
        hit: torch.Tensor,
        choice: torch.Tensor,
        hidden: torch.Tensor,
        side_hidden: torch.Tensor,
        first_draft: torch.Tensor,
    ) -> None:  # see Kernels.commit_side_rows
        self._commit_side_rows(
            k_stack, v_stack, side_slots, real_slot, hit, choice, hidden, side_hidden, first_draft
        )

    def ngram_lookup(
        self,
        history: torch.Tensor,
        committed: torch.Tensor,
        slots: torch.Tensor,
        width: int,
        k: int,
        n_min: int,
        n_max: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # see Kernels.ngram_lookup
        return self._ngram_lookup(history, committed, slots, width, k, n_min, n_max)

    def slot_mapping(
        self, table: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor, block_size: int
    ) -> torch.Tensor:  # see Kernels.slot_mapping
        return self._slot_mapping(table, token_row, positions, block_size)

    def top_tokens(
        self, logits: torch.Tensor, n: int, vocab: torch.Tensor | None = None
    ) -> torch.Tensor:  # see Kernels.top_tokens
        return self._top_tokens(logits, n, vocab)

    def write_drafts(
        self,
        drafts: torch.Tensor,
        num_drafts: torch.Tensor,
        side_drafts: torch.Tensor,
        slots: torch.Tensor,
        chain: torch.Tensor,
        top: torch.Tensor | None = None,
        found: torch.Tensor | None = None,
        num: torch.Tensor | None = None,
    ) -> None:  # see Kernels.write_drafts
        self._write_drafts(drafts, num_drafts, side_drafts, slots, chain, top, found, num)
