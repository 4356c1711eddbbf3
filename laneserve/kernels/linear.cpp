// linear (+ pack_linear_weight): the weight-streaming GEMM of every projection, AVX2 and
// AVX-512 variants with the same bits. Batch-invariance and fp-contraction notes: vec.h.
//
// One op family, kept in one file (~400 lines): both ISAs share the packed layout,
// LinearArgs, the tile-shape selection and the entry point's argument checks.

#include "ops.h"
#include "vec.h"

#include <type_traits>

namespace laneserve {
namespace {

// ----------------------------------------------------------------------------
// linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W packed as [N/16, K, 16]
// ----------------------------------------------------------------------------
//
// Packed layout: block b holds output columns 16b..16b+15; for each k the 16
// weights are contiguous, so one k step of the microkernel is one 64 B (fp32)
// or 32 B (bf16/fp16) load per block, streaming each block linearly. N is
// zero-padded to a multiple of 16.
//
// bf16 blocks store the 16 columns permuted as [0-3, 8-11, 4-7, 12-15] so that
// unpacklo/unpackhi_epi16(zero, v) of one 256-bit load yields columns 0-7 and
// 8-15 as fp32 directly (2 shuffles per 16 weights, no shifts).

constexpr int kMaxRows = 6;    // rows per microkernel tile (12 accumulators)
constexpr int64_t kGroup = 4;  // blocks walked together per row tile (L2 reuse)
constexpr int64_t kPrefetchBytes = 1024;  // weight prefetch distance per block stream

constexpr int kBf16Perm[kNB] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

struct LinearArgs {
  const float* x;     // [M, K] row-major
  const float* bias;  // [N] or nullptr
  const float* scale;  // [N] per output column (int8 weights), or nullptr
  float* out;         // [M, N] row-major
  int64_t M, K, N;
};

// R rows x C blocks (16 C columns) tile. Each output element is one FMA chain
// over k = 0..K-1 starting from 0, then * scale (int8 weights), then + bias.
// NOTE (invariance): that chain is the same for every (R, C), so the choice of
// tile never changes a result bit.
template <typename W, int R, int C>
void linear_tile(const LinearArgs& a, const W* wblk, int64_t m0, int64_t b0) {
  const int64_t K = a.K;
  const int64_t wstride = K * kNB;
  const float* x = a.x + m0 * K;
  const W* w = wblk + b0 * wstride;
  constexpr int64_t kPf = kPrefetchBytes / (kNB * static_cast<int64_t>(sizeof(W)));  // k rows

  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();

#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    __m256 wl[C], wh[C];
    // Software prefetch ~1 KiB ahead in each block stream: measured +15-25%
    // DRAM throughput for bf16 over the hardware prefetchers alone.
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(w + c * wstride + (k + kPf) * kNB), _MM_HINT_T0);
    for (int c = 0; c < C; ++c) load_w16(w + c * wstride + k * kNB, wl[c], wh[c]);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = _mm256_fmadd_ps(xb, wl[c], acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(xb, wh[c], acc[r][c][1]);
      }
    }
  }

  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (b0 + c) * kNB;
    const int64_t valid = std::min<int64_t>(kNB, a.N - n0);
    __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();
    alignas(32) float bias_buf[kNB] = {0};
    if (a.bias != nullptr) {
      std::memcpy(bias_buf, a.bias + n0, sizeof(float) * valid);
      b_lo = _mm256_load_ps(bias_buf);
      b_hi = _mm256_load_ps(bias_buf + 8);
    }
    alignas(32) float scale_buf[kNB] = {0};
    if (a.scale != nullptr) std::memcpy(scale_buf, a.scale + n0, sizeof(float) * valid);
    const __m256 s_lo = _mm256_load_ps(scale_buf), s_hi = _mm256_load_ps(scale_buf + 8);
    for (int r = 0; r < R; ++r) {
      __m256 lo = a.scale ? _mm256_mul_ps(acc[r][c][0], s_lo) : acc[r][c][0];
      __m256 hi = a.scale ? _mm256_mul_ps(acc[r][c][1], s_hi) : acc[r][c][1];
      if (a.bias) {
        lo = _mm256_add_ps(lo, b_lo);
        hi = _mm256_add_ps(hi, b_hi);
      }
      float* dst = a.out + (m0 + r) * a.N + n0;
      if (valid == kNB) {
        _mm256_storeu_ps(dst, lo);
        _mm256_storeu_ps(dst + 8, hi);
      } else {
        alignas(32) float buf[kNB];
        _mm256_store_ps(buf, lo);
        _mm256_store_ps(buf + 8, hi);
        std::memcpy(dst, buf, sizeof(float) * valid);
      }
    }
  }
}

// Blocks per microkernel call for an R-row tile: keeps >= 8 independent FMA
// chains in flight (FMA latency 4 x 2 ports) within the 16 ymm registers.
template <int R>
constexpr int cols_for_rows() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}

template <typename W, int R>
void linear_row_tile(const LinearArgs& a, const W* w, int64_t m0, int64_t b0, int64_t b1) {
  constexpr int C = cols_for_rows<R>();
  int64_t b = b0;
  for (; b + C <= b1; b += C) linear_tile<W, R, C>(a, w, m0, b);
  for (; b < b1; ++b) linear_tile<W, R, 1>(a, w, m0, b);
}

template <typename W>
void linear_rows(const LinearArgs& a, const W* w, int64_t m0, int rows, int64_t b0, int64_t b1) {
  with_rows<kMaxRows>(rows, [&](auto r) {
    linear_row_tile<W, decltype(r)::value>(a, w, m0, b0, b1);
  });
}

template <typename W>
void linear_driver(const LinearArgs& a, const W* w) {
  const int64_t nblk = (a.N + kNB - 1) / kNB;
  // ~64k FMAs minimum per task so tiny problems stay single threaded.
  const int64_t per_block = std::max<int64_t>(1, a.M * a.K * kNB);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  // NOTE: parallel over output blocks only (never over K): the split cannot
  // change any result, and at M=1 both threads still stream half the weight.
  at::parallel_for(0, nblk, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; g += kGroup) {
      const int64_t ge = std::min(g + kGroup, hi);
      for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.M - m0));
        linear_rows<W>(a, w, m0, rows, g, ge);
      }
    }
  });
}

// ----------------------------------------------------------------------------
// linear, AVX-512 variant (picked at run time by the caller: isa = kIsaAvx512)
// ----------------------------------------------------------------------------
//
// One 16-column block is one zmm, so each (row, block) is one accumulator and
// the weights of a k row need no split. fp32 and fp16 use the AVX2 layout
// (fp16 unpermuted); bf16 uses a pair layout: K is padded to even and each
// 64 B holds k rows 2j and 2j+1 of a block as 4 lanes of
// [row 2j cols 4L..4L+3, row 2j+1 cols 4L..4L+3], so unpacklo/hi_epi16(zero, v)
// give both rows as fp32 in column order (one shuffle per 16 weights).
// NOTE (invariance): each output element is still one fp32 FMA chain over
// k = 0..K-1 from 0, then + bias, so this path gives the AVX2 path's bits.

constexpr int64_t kIsaAvx2 = 0;
constexpr int64_t kIsaAvx512 = 1;
constexpr int64_t kGroup512 = 8;  // blocks walked together per row tile when M > 6

// Weight prefetch of this path: into L2 (T1) while one row tile (M <= 6) streams each
// weight once, into L1 (T0) when several row tiles reuse it. Measured on Zen 4 (one
// process, the two hints alternated over 128-token decodes, docs/kernels.md): T1 made
// batch-1 decode 1.04-1.32x faster (median 1.13x) and MTP k=1 decode, whose head weights
// are cold every step, 1.06-1.27x (median 1.19x); at batch 8 it was even and at batch 32
// about 1.5 % slower. The AVX2 path keeps T0: there T1 was even for plain decode and slower
// for MTP.
inline void prefetch_weight512(const void* p, bool l2) {
  if (l2)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  else
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

inline __m512 load_w16_512(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_w16_512(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_w16_512(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <typename W, int R, int C>
void linear_tile512(const LinearArgs& a, const W* wblk, int64_t m0, int64_t b0) {
  constexpr bool kPair = std::is_same_v<W, at::BFloat16>;
  const int64_t K = a.K;
  const int64_t wstride = (kPair ? K + (K & 1) : K) * kNB;
  const float* x = a.x + m0 * K;
  const W* w = wblk + b0 * wstride;
  constexpr int64_t kPf = kPrefetchBytes / (kNB * static_cast<int64_t>(sizeof(W)));  // k rows
  const bool l2 = a.M <= kMaxRows;  // one row tile: no reuse of the weights from L1

  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();

  if constexpr (kPair) {
    const __m512i z = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      for (int c = 0; c < C; ++c)
        prefetch_weight512(w + c * wstride + (k + kPf) * kNB, l2);
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(w + c * wstride + k * kNB);
        const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
        const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), lo, acc[r][c]);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + 1]), hi, acc[r][c]);
      }
    }
    if (k < K) {  // odd K: the last row's pair partner is zero padding, never used
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(w + c * wstride + k * kNB);
        const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), lo, acc[r][c]);
      }
    }
  } else {
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; ++k) {
      for (int c = 0; c < C; ++c)
        prefetch_weight512(w + c * wstride + (k + kPf) * kNB, l2);
      for (int c = 0; c < C; ++c) {
        const __m512 wv = load_w16_512(w + c * wstride + k * kNB);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wv, acc[r][c]);
      }
    }
  }

  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (b0 + c) * kNB;
    const int64_t valid = std::min<int64_t>(kNB, a.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 b = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    const __m512 s = a.scale ? _mm512_maskz_loadu_ps(mask, a.scale + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 v = a.scale ? _mm512_mul_ps(acc[r][c], s) : acc[r][c];
      if (a.bias) v = _mm512_add_ps(v, b);
      _mm512_mask_storeu_ps(a.out + (m0 + r) * a.N + n0, mask, v);
    }
  }
}

// Blocks per tile: >= 8 independent FMA chains, accumulators + broadcasts
// within the 32 zmm registers.
template <int R>
constexpr int cols_for_rows512() {
  return R <= 3 ? 8 : (R == 4 ? 6 : 4);
}

template <typename W, int R>
void linear_row_tile512(const LinearArgs& a, const W* w, int64_t m0, int64_t b0, int64_t b1) {
  constexpr int C = cols_for_rows512<R>();
  int64_t b = b0;
  for (; b + C <= b1; b += C) linear_tile512<W, R, C>(a, w, m0, b);
  for (; b < b1; ++b) linear_tile512<W, R, 1>(a, w, m0, b);
}

template <typename W>
void linear_rows512(const LinearArgs& a, const W* w, int64_t m0, int rows, int64_t b0,
                    int64_t b1) {
  with_rows<kMaxRows>(rows, [&](auto r) {
    linear_row_tile512<W, decltype(r)::value>(a, w, m0, b0, b1);
  });
}

template <typename W>
void linear_range512(const LinearArgs& a, const W* w, int64_t lo, int64_t hi) {
  // one row tile: the whole range at once (no weight reuse to group for)
  const int64_t step = a.M <= kMaxRows ? hi - lo : kGroup512;
  for (int64_t g = lo; g < hi; g += step) {
    const int64_t ge = std::min(g + step, hi);
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.M - m0));
      linear_rows512<W>(a, w, m0, rows, g, ge);
    }
  }
}

#pragma GCC pop_options

template <typename W>
void linear_driver512(const LinearArgs& a, const W* w) {
  const int64_t nblk = (a.N + kNB - 1) / kNB;
  const int64_t per_block = std::max<int64_t>(1, a.M * a.K * kNB);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  at::parallel_for(0, nblk, grain,
                   [&](int64_t lo, int64_t hi) { linear_range512<W>(a, w, lo, hi); });
}

// bf16 [nblk, K, 16] (column order) -> the AVX-512 pair layout [nblk, K + K % 2, 16].
at::Tensor pair_layout_bf16(const at::Tensor& packed) {
  const int64_t nblk = packed.size(0), K = packed.size(1), Kp = K + (K & 1);
  at::Tensor p = packed;
  if (Kp != K) p = at::cat({p, at::zeros({nblk, 1, kNB}, p.options())}, 1);
  // [nblk, Kp/2, row, lane, 4] -> [nblk, Kp/2, lane, row, 4]
  return p.view({nblk, Kp / 2, 2, 4, 4}).permute({0, 1, 3, 2, 4}).contiguous().view({nblk, Kp, kNB});
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& w, int64_t isa) {
  TORCH_CHECK(isa == kIsaAvx2 || isa == kIsaAvx512, "pack_linear_weight: unknown isa ", isa);
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: expected a 2-D [N, K] weight");
  const auto dt = w.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kChar,
              "pack_linear_weight: weight must be float32, bfloat16, float16 or int8");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t nblk = (N + kNB - 1) / kNB;
  at::Tensor padded = at::zeros({nblk * kNB, K}, w.options().device(at::kCPU));
  padded.narrow(0, 0, N).copy_(w);
  at::Tensor packed = padded.view({nblk, kNB, K}).transpose(1, 2);  // [nblk, K, 16]
  if (dt == at::kBFloat16 && isa == kIsaAvx512) return pair_layout_bf16(packed.contiguous());
  if (dt == at::kBFloat16) {
    at::Tensor perm = at::empty({kNB}, at::kLong);
    for (int i = 0; i < kNB; ++i) perm[i] = kBf16Perm[i];
    packed = packed.index_select(2, perm);
  }
  return packed.contiguous();
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                  const std::optional<at::Tensor>& bias_in, int64_t isa,
                  const std::optional<at::Tensor>& scale_in) {
  TORCH_CHECK(isa == kIsaAvx2 || isa == kIsaAvx512, "linear: unknown isa ", isa);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kNB && w.is_contiguous(),
              "linear: w must come from pack_linear_weight");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const bool pair = isa == kIsaAvx512 && w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.size(1) == (pair ? K + (K & 1) : K), "linear: in_features mismatch: x has ", K,
              ", weight ", w.size(1));
  TORCH_CHECK(n_out > (w.size(0) - 1) * kNB && n_out <= w.size(0) * kNB,
              "linear: out_features inconsistent with the packed weight");
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == n_out,
                "linear: bias must be float32 [N]");
  }
  const bool int8 = w.scalar_type() == at::kChar;
  const bool has_scale = scale_in.has_value() && scale_in->defined();
  TORCH_CHECK(int8 == has_scale, "linear: int8 weights need a float32 [N] scale, others none");
  at::Tensor scale;
  if (has_scale) {
    scale = scale_in->contiguous();
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n_out,
                "linear: scale must be float32 [N]");
  }
  at::Tensor out = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return out;
  const LinearArgs a{x.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                     int8 ? scale.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K, n_out};
  if (isa == kIsaAvx512) {
    switch (w.scalar_type()) {
      case at::kFloat: linear_driver512<float>(a, w.data_ptr<float>()); break;
      case at::kBFloat16: linear_driver512<at::BFloat16>(a, w.data_ptr<at::BFloat16>()); break;
      case at::kHalf: linear_driver512<at::Half>(a, w.data_ptr<at::Half>()); break;
      case at::kChar: linear_driver512<int8_t>(a, w.data_ptr<int8_t>()); break;
      default: TORCH_CHECK(false, "linear: unsupported weight dtype");
    }
    return out;
  }
  switch (w.scalar_type()) {
    case at::kFloat: linear_driver<float>(a, w.data_ptr<float>()); break;
    case at::kBFloat16: linear_driver<at::BFloat16>(a, w.data_ptr<at::BFloat16>()); break;
    case at::kHalf: linear_driver<at::Half>(a, w.data_ptr<at::Half>()); break;
    case at::kChar: linear_driver<int8_t>(a, w.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "linear: unsupported weight dtype");
  }
  return out;
}

}  // namespace laneserve
