"""The contract every kernels implementation meets: the :class:`Kernels` protocol.

Model code, the attention wrapper and the speculative-decoding helpers take a
``Kernels``; :func:`laneserve.kernels.get_kernels` returns one of

* :class:`~laneserve.kernels.cpu.CpuKernels` (the C++ extension; CPU tensors, float32
  activations; batch invariant, see below), or
* :class:`~laneserve.kernels.reference.TorchKernels` (torch composites; any device and
  float dtype; the reference the C++ ops are tested against).

Shapes below use T tokens, M rows, K input and N output features, H hidden size, Hq / Hk
query / key-value heads of size D, S sequences, R speculative rows with K drafts (or k)
and W alternatives each. "float" means float32 for CpuKernels; TorchKernels computes in
the activations' dtype.

NOTE (batch invariance): with CpuKernels, for ``M <= BATCH_INVARIANT_MAX_M`` rows, row
``m`` of every op's output is bitwise identical whatever the other rows contain and
however many there are; the same holds per query for ``paged_attention`` (independent of
``q_len`` and of the other sequences). Speculative decoding relies on this to give the
same greedy tokens with and without speculation. TorchKernels gives no such guarantee
(it inherits whatever torch / BLAS does). Prompt rows passed to ``linear`` with
``first_prefill`` may take other numerics (bf16 activations on AMX or avx512_bf16
CPUs), row invariant as well; decode-like rows never do (docs/kernels.md, the table of guarantees per row).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from laneserve.kernels.quant import QuantWeight
from laneserve.kernels.scaled import ScaledWeight
from laneserve.kernels.weights import PackedWeight

# Largest M for which CpuKernels.linear guarantees batch invariance. The current kernel
# uses one code path (and per-element FMA order) for every M, so it is in fact invariant
# beyond this too; the contract stops here so a faster prefill path may be added later.
BATCH_INVARIANT_MAX_M = 64
# Largest head_dim CpuKernels.paged_attention runs itself (attention_tile.h kMaxDV * 8):
# DeepSeek V3's MLA latent of 512 + 64 values. Larger ones take the reference.
PAGED_ATTENTION_MAX_HEAD_DIM = 576


@runtime_checkable
class Kernels(Protocol):
    """The ops of a decoder forward and of speculative decoding (see the module notes)."""

    name: str  # "cpu" | "torch"

    def pack_linear_weight(self, w: torch.Tensor, quantize: str | None = None) -> PackedWeight:
        """Prepare a [N, K] float32 / bfloat16 / float16 weight once for :meth:`linear`,
        in this implementation's layout; ``quantize="int8"`` stores it weight-only int8
        (per output row scales). Raises ValueError / TypeError for other shapes, dtypes or
        quantizations. A PackedWeight is only valid for the object that packed it."""
        ...

    def pack_gguf_weight(self, w: QuantWeight) -> PackedWeight:
        """Prepare a GGUF block-quantized weight (q4_0 / q4_1 / q8_0 / q4_k, quant.py)
        for :meth:`linear`. CpuKernels keeps it quantized on AVX-512 CPUs; everywhere the
        result is bitwise that of ``pack_linear_weight(quant.dequantize(w))``. A weight with
        ``activations="q8"`` is multiplied by int8-rounded activations instead (q8.py):
        bitwise ``q8.reference_linear`` everywhere (AVX-512 VNNI kernel or torch)."""
        ...

    def pack_scaled_weight(self, w: ScaledWeight) -> PackedWeight:
        """Prepare a block-scaled FP8 / MXFP4 weight (scaled.py) for :meth:`linear`, kept
        in its stored bytes and scales. CpuKernels multiplies it natively, bitwise
        ``linear(x, pack_linear_weight(scaled.dequantize(w)))`` (batch invariant alike);
        TorchKernels dequantizes REFERENCE_ROWS output rows at a time and multiplies in
        fp32 (``scaled.reference_linear``), returning the activations' dtype."""
        ...

    def linear(
        self,
        x: torch.Tensor,
        w: PackedWeight,
        bias: torch.Tensor | None = None,
        first_prefill: int | None = None,
    ) -> torch.Tensor:
        """``x @ W^T + bias``: x [M, K] float, bias [N] or None; returns [M, N] in x's
        dtype. CpuKernels accumulates each output in fp32 as one FMA chain over K (the same
        bits on the AVX2 and AVX-512 paths). Batch invariant up to BATCH_INVARIANT_MAX_M.

        ``first_prefill``: rows ``[first_prefill, M)`` are prompt (prefill) rows, which an
        implementation may compute on a compute-bound path with other numerics: CpuKernels
        with bf16 weights rounds them to bf16 and uses AMX tiles, or AVX-512 BF16 dot
        products on CPUs without AMX (``linear_prefill``). That path is row invariant
        too (a row's result does not depend on the other rows or on M), and rows before ``first_prefill`` keep the decode
        kernel's bits exactly. None (the default): every row is decode-like."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF Llama RMSNorm: ``weight * (x / sqrt(mean(x^2, -1) + eps))`` with statistics
        in fp32. x [M, H], weight [H]; returns a new [M, H]. Row-wise, batch invariant."""
        ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: ``residual += x``, then ``x = rms_norm(residual)``. x and residual
        [M, H] (contiguous for CpuKernels), weight [H]. Row-wise, batch invariant."""
        ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        head_dim: int,
        cos_sin_cache: torch.Tensor,
    ) -> None:
        """NeoX / HF rotate_half rotary embedding, in place on q and k. positions [T]
        int64 (< max_pos); q [T, Hq*D] or [T, Hq, D], k [T, Hk*D] or [T, Hk, D] with each
        row's heads contiguous (any row stride: column slices of a fused qkv output are
        fine); cos_sin_cache [max_pos, D] float, cos in [:D/2] and sin in [D/2:].
        Unfused mul/mul/add per element, as HF's fp32 formula. Per token."""
        ...

    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """``silu(x[..., :I]) * x[..., I:]``: x [M, 2I] float; returns [M, I]. Row-wise.
        With ``limit`` L (DeepSeek V4's clamped SwiGLU): ``silu(min(x[..., :I], L)) *
        clamp(x[..., I:], -L, L)``."""
        ...

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
        """A hyper-connection's weights from N residual streams (DeepSeek V4; formulas in
        model/deepseek_v4/ops.py): streams [T, N, H] float32 / bfloat16 (contiguous), fn
        [(2 + N) N, N H], base [(2 + N) N] and scale [3] float32; ``iters`` Sinkhorn
        rounds. Returns post [T, N] and comb [T, N, N] float32, and the streams collapsed
        by the pre weights [T, H] in the streams' dtype. All fp32. Per token."""
        ...

    def hyper_post(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a sublayer: ``new_n = post_n * out + sum_j comb[j, n] *
        stream_j`` for streams [T, N, H], out [T, H] (float32 / bfloat16, contiguous) and
        hyper_pre's post / comb; float32 unless both inputs are bfloat16. Per token."""
        ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        last_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's queries over its keys in the paged cache.

        q [T, Hq, D] float (unit stride on D); k_cache / v_cache [num_blocks, block_size,
        Hk, D] float32 / bfloat16 / float16 (contiguous, same shape and dtype), Hq a
        multiple of Hk (GQA); block_tables [S, max_blocks] int32; seq_lens [S] int32, the
        keys of each sequence including this step's tokens; query_start_loc [S+1] int32,
        sequence s owning queries [qsl[s], qsl[s+1]). Bottom-right aligned: query i of a
        sequence with q_len L and n keys sits at position n - L + i and sees keys 0..that
        position. last_slot [S] int64, optional: where >= 0, the cache slot read for the
        sequence's last key instead of the table's (speculative side rows). Returns
        [T, Hq, D] in q's dtype. Per query, independent of q_len and of the other
        sequences (CpuKernels, head_dim % 8 == 0 and <= 576; other head sizes use the
        reference)."""
        ...

    def causal_attention_bf16(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Causal attention of a long prompt chunk over its context and its own keys, in bf16.

        q [n, Hq, Dk], k [nk, Hk, Dk], v [nk, Hk, Dv] with nk >= n (any float dtype; Hq a
        multiple of Hk): query i sits at position nk - n + i and sees keys 0 .. that
        position (a fresh chunk: nk = n). q, k, v and the probabilities are rounded to
        bf16, sums are fp32. Returns [n, Hq, Dv] float32. For prompt rows whose cache is bf16 only: the
        rounding differs from paged_attention's, and from one implementation to another
        (CpuKernels: blocked avx512_bf16 dot products; TorchKernels: torch's SDPA in bf16)."""
        ...

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """``cache[slot] = k / v`` for each token, converted to the cache dtype with
        round-to-nearest-even (torch's ``.to``). k, v [T, Hk, D] float (rows may be strided
        views of a qkv output); caches [num_blocks, block_size, Hk, D]; slot_mapping [T]
        int64 = block * block_size + offset, negative slots skipped (padding)."""
        ...

    def verify_greedy(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        num_valid: torch.Tensor,
        alternatives: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Greedy verification of dense speculative rows (sample/rejection_sampler.py).

        logits [R * (K + 1) + R * W, V] float: each row's K + 1 positions, then each row's
        W alternatives' rows; drafts [R, K] int64 (K >= 1); num_valid [R] int64 real drafts
        per row; alternatives [R, W] int64 (W may be 0), distinct from drafts[:, 0].
        Accept d_j while it equals argmax_j (torch.argmax: first maximum, NaN highest);
        when a real d_0 is rejected, accept the alternative equal to argmax_0 (if any),
        followed by its own row's argmax. Returns (tokens [R, K + 1] int64: the argmaxes,
        column 1 replaced on a hit; accepted [R] int64; hit [R] bool; choice [R] int64)."""
        ...

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
    ) -> None:
        """Token tree: where ``hit[r]``, the accepted alternative ``choice[r]`` becomes the
        request's token at p + 1: its K/V are copied from its scratch slot
        ``side_slots[r, choice[r]]`` into ``real_slot[r]`` in every layer of k_stack /
        v_stack [L, blocks, bs, Hk, D], and its row of side_hidden [R * W, H] replaces row
        ``first_draft[r]`` of hidden [T, H]. Rows without a hit are untouched. side_slots
        [R, W], real_slot / choice / first_draft [R] int64, hit [R] bool. CpuKernels checks
        every row before writing any (RuntimeError, nothing changed)."""
        ...

    def ngram_lookup(
        self,
        history: torch.Tensor,
        committed: torch.Tensor,
        slots: torch.Tensor,
        width: int,
        k: int,
        n_min: int,
        n_max: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt lookup. history [S, W] int64 every state slot's tokens, committed [S]
        int64 known tokens per slot (<= width <= W), slots [R] int64 the rows' slots. For
        each row: its last n tokens (n from n_max down to n_min), their latest earlier
        occurrence in its history (ending before the suffix starts) and the up to k tokens
        that followed it. Returns (drafts [R, k] int64, num [R] int64; 0 = no match, the
        drafts then arbitrary). No host synchronisation in the reference."""
        ...

    def slot_mapping(
        self, table: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Paged KV slot of each token: ``table[row, p // bs] * bs + p % bs``. table
        [R, blocks] int32 or int64, token_row / positions [T] int64; returns [T] int64."""
        ...

    def top_tokens(
        self, logits: torch.Tensor, n: int, vocab: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's n best columns, best first (NaN ranks highest, as torch.argmax),
        mapped through vocab [V] int64 when given (a draft vocabulary). logits [N, V]
        float32, 1 <= n <= V (else ValueError / RuntimeError); returns [N, n] int64. Ties:
        the lower column first for n = 1 and in CpuKernels; for n > 1 the reference
        follows torch.topk's order."""
        ...

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
    ) -> None:
        """The next step's drafts into the rows' state slots, in place. State: drafts
        [S, K], num_drafts [S], side_drafts [S, W], all int64. slots [R] int64; chain
        [R, k] the head's drafts (k <= K); found [R, k] / num [R] lookup drafts (given
        together; num 0 = none): row r gets found[r] (num[r] of them) where the lookup
        found any, else chain[r] (k). top [R, 1 + A] (A <= W), optional: side_drafts[s, :A]
        = the best A of top[r] other than the row's first draft (a token tree's candidates
        must all differ)."""
        ...
