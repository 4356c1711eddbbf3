// laneserve CPU kernels (x86-64, AVX2 + FMA + F16C).
//
// Registered as torch.ops.laneserve.<name> (CPU dispatch key only). Built and
// loaded by laneserve/kernels/build.py; the Python wrappers live in
// laneserve/kernels/__init__.py and docs/kernels.md has the design notes.
//
// NOTE (batch invariance): every kernel here computes each output row with a
// fixed sequence of floating point operations that depends only on that row's
// inputs (and, for attention, on the absolute key positions), never on the
// number of rows, the tiling chosen for the batch, or the thread split. This is
// what lets speculative decoding verify 1+k tokens in one call and get bitwise
// the same numbers as k+1 single-token calls. Do not introduce reductions whose
// order depends on M, on the parallel partition, or on the tile shape.
//
// NOTE (fp contraction): build.py compiles with -ffp-contract=off so that the
// compiler never fuses a*b+c on its own; every FMA below is explicit. This keeps
// vector bodies and scalar tails bitwise consistent and matches torch's
// unfused elementwise formulas (rotary, rms_norm scaling).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace laneserve {
namespace {

// ----------------------------------------------------------------------------
// Small vector helpers
// ----------------------------------------------------------------------------

// Horizontal sum with a fixed tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Transposed horizontal sum: lane j of the result is the sum of a[j]'s lanes.
// Every lane uses the same addition tree and lanes never mix, so a key's score
// does not depend on which other keys share its group of 8.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for fp32 lanes, Cephes polynomial (~1-2 ulp). Inputs below
// -87.34 (results in the denormal range) flush to 0, inputs above 88.38
// overflow to +inf, NaN propagates. Used by silu and the attention softmax.
inline __m256 exp256(__m256 x) {
  const __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447504f), _CMP_LT_OQ);
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.3762626647949f), _CMP_GT_OQ);
  __m256 v = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  v = _mm256_max_ps(v, _mm256_set1_ps(-87.3365447504f));

  __m256 fx = _mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), v);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), v);
  const __m256 z = _mm256_mul_ps(v, v);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, v);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));

  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  e = _mm256_slli_epi32(e, 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));

  y = _mm256_andnot_ps(under, y);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), over);
  return _mm256_blendv_ps(y, x, nan_mask);
}

// Lane mask with lanes [0, n) set (n in 0..8).
inline __m256 prefix_mask(int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}

// ----------------------------------------------------------------------------
// Element loads / stores for the supported storage dtypes
// ----------------------------------------------------------------------------

// 8 consecutive elements -> 8 fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift left by 16 (exact).
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 fp32 lanes -> 8 consecutive elements, round-to-nearest-even like torch's
// .to(dtype) (bf16: NaN becomes 0x7fc0, exactly c10::BFloat16's rule).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Convert/copy n fp32 values to dst (vector body, exact same rounding in the
// tail via a padded staging buffer).
template <typename T>
inline void convert_row(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
  if (i < n) {
    alignas(32) float in[8] = {0};
    alignas(32) T out[8];
    std::memcpy(in, src + i, sizeof(float) * (n - i));
    store8(out, _mm256_load_ps(in));
    std::memcpy(dst + i, out, sizeof(T) * (n - i));
  }
}

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

constexpr int64_t kNB = 16;    // output columns per packed block
constexpr int kMaxRows = 6;    // rows per microkernel tile (12 accumulators)
constexpr int64_t kGroup = 4;  // blocks walked together per row tile (L2 reuse)
constexpr int64_t kPrefetchBytes = 1024;  // weight prefetch distance per block stream

constexpr int kBf16Perm[kNB] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// Loads one k row (16 columns) of a packed block as two fp32 vectors.
inline void load_w16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load_w16(const at::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
inline void load_w16(const at::Half* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
// int8 (weight-only quantized): the integer itself; the column scale is applied
// to the finished dot product (LinearArgs::scale).
inline void load_w16(const int8_t* p, __m256& lo, __m256& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
}

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

// Calls f(std::integral_constant<int, R>) for rows = R in 1..kMaxRows: the row
// count of a tile becomes a template argument (both linear ISAs use it).
template <typename F>
void with_rows(int rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return f(std::integral_constant<int, 6>{});
  }
}

template <typename W>
void linear_rows(const LinearArgs& a, const W* w, int64_t m0, int rows, int64_t b0, int64_t b1) {
  with_rows(rows, [&](auto r) { linear_row_tile<W, decltype(r)::value>(a, w, m0, b0, b1); });
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
  with_rows(rows, [&](auto r) { linear_row_tile512<W, decltype(r)::value>(a, w, m0, b0, b1); });
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

// ----------------------------------------------------------------------------
// RMSNorm (HF Llama semantics in fp32): y = w * (x * (1 / sqrt(mean(x^2) + eps)))
// ----------------------------------------------------------------------------

// Sum of squares of one row; fixed order (one 8-lane FMA chain, fixed tree,
// then the scalar tail), so the value depends only on the row.
inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline float inv_rms(float sum_sq, int64_t n, double eps) {
  const float var = sum_sq / static_cast<float>(n);
  return 1.0f / std::sqrt(var + static_cast<float>(eps));
}

// y = w * (x * r); same two roundings per element as HF's fp32 path.
inline void scale_row(const float* x, const float* w, float r, float* y, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), v));
  }
  for (; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// Rows per parallel task for row-wise ops: ~128k elements, so decode batches run
// on the calling thread (an OpenMP fork/join costs ~5 us here).
int64_t rows_grain(int64_t width) {
  return std::max<int64_t>(1, 131072 / std::max<int64_t>(1, width));
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, op,
              ": float32 tensors expected");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), op,
              ": weight must be [H] matching x's last dim");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm_args(x_in, w_in, "rms_norm");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(-1);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const float* xr = xp + m * H;
      scale_row(xr, wp, inv_rms(sum_squares(xr, H), H, eps), op + m * H, H);
    }
  });
  return out;
}

// residual += x; x = rms_norm(residual) (vLLM's fused_add_rms_norm, in place).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w_in, double eps) {
  check_norm_args(x, w_in, "fused_add_rms_norm");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.sizes() == x.sizes(),
              "fused_add_rms_norm: residual must match x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(),
              "fused_add_rms_norm: x and residual must be contiguous (updated in place)");
  const at::Tensor w = w_in.contiguous();
  const int64_t H = x.size(-1);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, rows, rows_grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      float* xr = xp + m * H;
      float* rr = rp + m * H;
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        _mm256_storeu_ps(rr + i, _mm256_add_ps(_mm256_loadu_ps(rr + i), _mm256_loadu_ps(xr + i)));
      for (; i < H; ++i) rr[i] = rr[i] + xr[i];
      scale_row(rr, wp, inv_rms(sum_squares(rr, H), H, eps), xr, H);
    }
  });
}

// ----------------------------------------------------------------------------
// Rotary embedding, NeoX / HF rotate_half style, in place
// ----------------------------------------------------------------------------

// One head: x1 = x[:D/2], x2 = x[D/2:]; x1' = x1*c - x2*s, x2' = x2*c + x1*s.
// NOTE: unfused mul/mul/add exactly as HF's q*cos + rotate_half(q)*sin in fp32.
inline void rotate_head(float* x, const float* cs, int64_t half) {
  const float* c = cs;
  const float* s = cs + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * s[i];
    x[half + i] = x2 * c[i] + x1 * s[i];
  }
}

// q / k may be [T, H*D] (any row stride, unit column stride: e.g. a column
// slice of a fused qkv output) or [T, H, D] with contiguous heads.
struct HeadView {
  float* data;
  int64_t row_stride;
  int64_t heads;
};

HeadView head_view(at::Tensor& t, int64_t tokens, int64_t head_dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "rotary_embedding: ", name, " must be float32");
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "rotary_embedding: ", name, " must be 2-D or 3-D");
  TORCH_CHECK(t.size(0) == tokens, "rotary_embedding: ", name, " has wrong number of tokens");
  const int64_t width = t.dim() == 2 ? t.size(1) : t.size(1) * t.size(2);
  TORCH_CHECK(width % head_dim == 0, "rotary_embedding: ", name, " width not a multiple of D");
  const bool heads_ok = t.dim() == 2 ? (t.size(1) <= 1 || t.stride(1) == 1)
                                     : ((t.size(2) <= 1 || t.stride(2) == 1) &&
                                        (t.size(1) <= 1 || t.stride(1) == t.size(2)));
  TORCH_CHECK(heads_ok, "rotary_embedding: ", name, " must have contiguous heads in each row");
  return HeadView{t.data_ptr<float>(), t.stride(0), width / head_dim};
}

void rotary_embedding(const at::Tensor& positions_in, at::Tensor& q, at::Tensor& k,
                      int64_t head_dim, const at::Tensor& cache_in) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cache_in.dim() == 2 && cache_in.size(1) == head_dim &&
                  cache_in.scalar_type() == at::kFloat,
              "rotary_embedding: cos_sin_cache must be float32 [max_pos, head_dim]");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor cache = cache_in.contiguous();
  const int64_t T = positions.numel();
  const HeadView qv = head_view(q, T, head_dim, "q");
  const HeadView kv = head_view(k, T, head_dim, "k");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cache.data_ptr<float>();
  const int64_t max_pos = cache.size(0);
  const int64_t half = head_dim / 2;
  at::parallel_for(0, T, rows_grain((qv.heads + kv.heads) * head_dim * 4),
                   [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position out of range");
      const float* row = cs + pos[t] * head_dim;
      for (int64_t h = 0; h < qv.heads; ++h)
        rotate_head(qv.data + t * qv.row_stride + h * head_dim, row, half);
      for (int64_t h = 0; h < kv.heads; ++h)
        rotate_head(kv.data + t * kv.row_stride + h * head_dim, row, half);
    }
  });
}

// ----------------------------------------------------------------------------
// silu_and_mul: y = silu(x[:, :I]) * x[:, I:]
// ----------------------------------------------------------------------------

inline __m256 silu_mul8(__m256 a, __m256 b) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
  return _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), b);
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) % 2 == 0,
              "silu_and_mul: float32 [..., 2I] expected");
  const at::Tensor x = x_in.contiguous();
  const int64_t I = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = I == 0 ? 0 : x.numel() / (2 * I);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_grain(I * 8), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const float* a = xp + m * 2 * I;
      const float* b = a + I;
      float* y = op + m * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(y + i, silu_mul8(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
      if (i < I) {  // tail through the same vector formula (padded)
        alignas(32) float ta[8] = {0}, tb[8] = {0}, ty[8];
        std::memcpy(ta, a + i, sizeof(float) * (I - i));
        std::memcpy(tb, b + i, sizeof(float) * (I - i));
        _mm256_store_ps(ty, silu_mul8(_mm256_load_ps(ta), _mm256_load_ps(tb)));
        std::memcpy(y + i, ty, sizeof(float) * (I - i));
      }
    }
  });
  return out;
}

// ----------------------------------------------------------------------------
// Paged attention (decode and short verify/prefill chunks)
// ----------------------------------------------------------------------------
//
// The query at absolute position `pos` attends keys 0..pos of its sequence,
// read in place through the block table (no gather). A task is up to 8
// consecutive queries of one sequence x a set of q heads (all heads, one GQA
// group or one head, see plan_tasks). Keys go in tiles of kKeyTile absolute
// positions; a tile's K/V rows are pulled into L1 once (software prefetch one
// tile ahead) and used by every query and head of the task. Softmax is an fp32
// online softmax (running max m, sum l, accumulator acc) updated per tile.
//
// NOTE (invariance): per (query, head) the arithmetic is fixed: tile
// boundaries are absolute key indices (0, 32, 64, ...), each key's score is
// its own FMA chain over d followed by a lane-independent reduction, and the
// softmax/PV updates run in key order. Nothing depends on q_len, on the other
// sequences, on the head grouping of the task, or on the thread split.
//
// Lane order: head_dim is processed in chunks of 16 loaded with load_w16; for
// bf16 that yields columns [0-3, 8-11] and [4-7, 12-15] (unpack trick, see
// linear). q and acc are kept in that same lane order, which is harmless for
// dot products and undone when the output is stored.

constexpr int kKeyTile = 32;
constexpr int kMaxDV = 64;            // head_dim <= 512
constexpr int kUnpackLaneCol[kNB] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

template <typename CT>
constexpr bool kPermutedLanes = std::is_same_v<CT, at::BFloat16>;

template <typename CT>
struct AttnArgs {
  const float* q;  // [T, Hq, D]
  const CT* k_cache;
  const CT* v_cache;  // [num_blocks, block_size, Hk, D]
  const int32_t* block_tables;
  const int32_t* seq_lens;  // [S]
  const int64_t* last_slot;  // [S] or null: cache slot of each sequence's last key (-1: table)
  float* out;  // [T, Hq, D]
  int64_t q_stride_t, q_stride_h;
  int64_t Hq, Hk, D, block_size, num_blocks, max_blocks;
  float scale;
};

// K and V token-row pointers of keys key0..key0+n-1 of one tile, walking the
// block table one block segment at a time. Entries n..round_up(n, 8)-1 repeat
// the last key so that score8 can always read 8 keys (those lanes are masked).
// A sequence's last key (position last_pos) is read from last_slot instead of
// the table when last_slot >= 0 (speculative side rows: an alternative token's
// key kept apart from the request's own slot; the arithmetic is unchanged).
template <typename CT>
inline void tile_ptrs(const AttnArgs<CT>& a, const int32_t* bt, int64_t key0, int n,
                      int64_t last_pos, int64_t last_slot, const CT** kp, const CT** vp) {
  const CT* kbase = a.k_cache;
  const CT* vbase = a.v_cache;
  const int64_t row_elems = a.Hk * a.D;
  int64_t bi = key0 / a.block_size;
  int64_t off = key0 - bi * a.block_size;
  int j = 0;
  while (j < n) {
    const int64_t blk = bt[bi++];
    TORCH_CHECK(blk >= 0 && blk < a.num_blocks, "paged_attention: block id out of range");
    const int take = static_cast<int>(std::min<int64_t>(n - j, a.block_size - off));
    const int64_t row0 = (blk * a.block_size + off) * row_elems;
    for (int t = 0; t < take; ++t) {
      kp[j + t] = kbase + row0 + t * row_elems;
      vp[j + t] = vbase + row0 + t * row_elems;
    }
    j += take;
    off = 0;
  }
  if (last_slot >= 0 && last_pos >= key0 && last_pos < key0 + n) {
    TORCH_CHECK(last_slot < a.num_blocks * a.block_size, "paged_attention: last_slot ",
                last_slot, " out of range");
    kp[last_pos - key0] = kbase + last_slot * row_elems;
    vp[last_pos - key0] = vbase + last_slot * row_elems;
  }
  for (; j % 8 != 0; ++j) {
    kp[j] = kp[n - 1];
    vp[j] = vp[n - 1];
  }
}

// Next-tile rows to prefetch into L1, a slice [begin, end) at a time: K/V rows
// sit at a (Hk * D) stride across shuffled blocks, which hardware prefetchers
// do not follow well, and issuing a whole tile at once overflows the miss
// queues, so each (head, query) step of the current tile issues one slice.
template <typename CT>
struct PrefetchSlice {
  const CT* const* k;
  const CT* const* v;
  int begin, end;
  int64_t col, bytes;  // byte span [col, col + bytes) of each row (col in elements)
};

template <typename CT>
inline void prefetch_rows(const CT* const* rows, int begin, int end, int64_t col, int64_t bytes) {
  const int64_t lines = (bytes + 63) / 64;
  for (int j = begin; j < end; ++j) {
    const char* p = reinterpret_cast<const char*>(rows[j] + col);
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
    _mm_prefetch(p + bytes - 1, _MM_HINT_T0);  // tail line when p is not 64 B aligned
  }
}

// Vector count of the per-head state: D/8 when known at compile time.
template <int DV_>
constexpr int state_lanes() {
  return DV_ > 0 ? DV_ : kMaxDV;
}

// Per (query, head) running state, kept in the cache's lane order.
template <int kArr>
struct HeadState {
  __m256 q[kArr];
  __m256 acc[kArr];
  float m;
  float l;
};

template <typename CT, int kArr>
void init_head(HeadState<kArr>& st, const float* qp, int dv) {
  const int npairs = dv / 2;
  for (int pr = 0; pr < npairs; ++pr) {
    if constexpr (kPermutedLanes<CT>) {
      alignas(32) float tmp[kNB];
      for (int L = 0; L < kNB; ++L) tmp[L] = qp[16 * pr + kUnpackLaneCol[L]];
      st.q[2 * pr] = _mm256_load_ps(tmp);
      st.q[2 * pr + 1] = _mm256_load_ps(tmp + 8);
    } else {
      st.q[2 * pr] = _mm256_loadu_ps(qp + 16 * pr);
      st.q[2 * pr + 1] = _mm256_loadu_ps(qp + 16 * pr + 8);
    }
  }
  if (dv & 1) st.q[dv - 1] = _mm256_loadu_ps(qp + 16 * npairs);
  for (int c = 0; c < dv; ++c) st.acc[c] = _mm256_setzero_ps();
  st.m = -std::numeric_limits<float>::infinity();
  st.l = 0.0f;
}

template <typename CT, int kArr>
void store_head(const HeadState<kArr>& st, float* op, int dv) {
  const __m256 lv = _mm256_set1_ps(st.l);
  const int npairs = dv / 2;
  for (int pr = 0; pr < npairs; ++pr) {
    const __m256 lo = _mm256_div_ps(st.acc[2 * pr], lv);
    const __m256 hi = _mm256_div_ps(st.acc[2 * pr + 1], lv);
    if constexpr (kPermutedLanes<CT>) {
      alignas(32) float tmp[kNB];
      _mm256_store_ps(tmp, lo);
      _mm256_store_ps(tmp + 8, hi);
      for (int L = 0; L < kNB; ++L) op[16 * pr + kUnpackLaneCol[L]] = tmp[L];
    } else {
      _mm256_storeu_ps(op + 16 * pr, lo);
      _mm256_storeu_ps(op + 16 * pr + 8, hi);
    }
  }
  if (dv & 1) _mm256_storeu_ps(op + 16 * npairs, _mm256_div_ps(st.acc[dv - 1], lv));
}

// Scores of 8 keys: s[j] = scale * sum_d q[d] k_j[d]. The 8 FMA chains are
// interleaved explicitly (a single chain per key is FMA-latency bound).
template <typename CT, int DV_, int kArr>
inline __m256 score8(const __m256* q, const CT* const* kp, int64_t col, int dv, __m256 scale) {
  const int npairs = dv / 2;
  __m256 d[8];
  for (int j = 0; j < 8; ++j) d[j] = _mm256_setzero_ps();
  for (int pr = 0; pr < npairs; ++pr) {
    for (int j = 0; j < 8; ++j) {
      __m256 x, y;
      load_w16(kp[j] + col + 16 * pr, x, y);
      d[j] = _mm256_fmadd_ps(q[2 * pr], x, d[j]);
      d[j] = _mm256_fmadd_ps(q[2 * pr + 1], y, d[j]);
    }
  }
  if (dv & 1)
    for (int j = 0; j < 8; ++j)
      d[j] = _mm256_fmadd_ps(q[dv - 1], load8(kp[j] + col + 16 * npairs), d[j]);
  return _mm256_mul_ps(hsum8(d), scale);
}

// One tile of n keys for one head: scores, online-softmax update, P @ V.
template <typename CT, int DV_, int kArr>
void attend_tile(HeadState<kArr>& st, const CT* const* kp, const CT* const* vp, int64_t col, int n,
                 int dv, __m256 scale, const PrefetchSlice<CT>& pf) {
  prefetch_rows(pf.k, pf.begin, pf.end, pf.col, pf.bytes);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 q[kArr];
  for (int c = 0; c < dv; ++c) q[c] = st.q[c];

  __m256 s[kKeyTile / 8];
  const int groups = (n + 7) / 8;
  __m256 tmax = neg_inf;
  for (int gi = 0; gi < groups; ++gi) {
    s[gi] = _mm256_blendv_ps(neg_inf, score8<CT, DV_, kArr>(q, kp + 8 * gi, col, dv, scale),
                             prefix_mask(n - gi * 8));
    tmax = _mm256_max_ps(tmax, s[gi]);
  }

  const float m_new = std::max(st.m, hmax(tmax));
  const float alpha = _mm256_cvtss_f32(exp256(_mm256_set1_ps(st.m - m_new)));  // 0 at start
  const __m256 mv = _mm256_set1_ps(m_new);
  alignas(32) float p[kKeyTile];
  __m256 psum = _mm256_setzero_ps();
  for (int gi = 0; gi < groups; ++gi) {
    const __m256 pg = exp256(_mm256_sub_ps(s[gi], mv));  // masked lanes: exp(-inf) = 0
    _mm256_store_ps(p + 8 * gi, pg);
    psum = _mm256_add_ps(psum, pg);
  }
  st.l = st.l * alpha + hsum(psum);
  st.m = m_new;

  // NOTE: local accumulators (not st.acc) so they live in registers: __m256
  // stores may alias the cache loads as far as the compiler knows.
  prefetch_rows(pf.v, pf.begin, pf.end, pf.col, pf.bytes);
  __m256 acc[kArr];
  const __m256 av = _mm256_set1_ps(alpha);
  for (int c = 0; c < dv; ++c) acc[c] = _mm256_mul_ps(st.acc[c], av);
  const int npairs = dv / 2;
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const CT* v = vp[j] + col;
    for (int pr = 0; pr < npairs; ++pr) {
      __m256 x, y;
      load_w16(v + 16 * pr, x, y);
      acc[2 * pr] = _mm256_fmadd_ps(pj, x, acc[2 * pr]);
      acc[2 * pr + 1] = _mm256_fmadd_ps(pj, y, acc[2 * pr + 1]);
    }
    if (dv & 1) acc[dv - 1] = _mm256_fmadd_ps(pj, load8(v + 16 * npairs), acc[dv - 1]);
  }
  for (int c = 0; c < dv; ++c) st.acc[c] = acc[c];
}

// One unit of work: queries q0..q0+nq-1 (consecutive tokens of one sequence,
// increasing positions) x q heads h0..h0+nh-1.
struct AttnTask {
  int64_t seq, q0, nq, h0, nh;
};

constexpr int64_t kMaxTaskQueries = 8;
constexpr int64_t kParallelMinPairs = 512;

template <typename CT, int DV_>
void attend_task(const AttnArgs<CT>& a, const AttnTask& task, const int64_t* tok_pos,
                 bool prefetch, std::vector<HeadState<state_lanes<DV_>()>>& states) {
  constexpr int kArr = state_lanes<DV_>();
  const int dv = DV_ > 0 ? DV_ : static_cast<int>(a.D / 8);
  const int64_t G = a.Hq / a.Hk;
  const int32_t* bt = a.block_tables + task.seq * a.max_blocks;
  const int64_t last_pos = a.seq_lens[task.seq] - 1;
  const int64_t last_slot = a.last_slot ? a.last_slot[task.seq] : -1;
  const __m256 scale = _mm256_set1_ps(a.scale);
  const int64_t pos_max = tok_pos[task.q0 + task.nq - 1];

  states.resize(task.nq * task.nh);
  for (int64_t qi = 0; qi < task.nq; ++qi)
    for (int64_t i = 0; i < task.nh; ++i)
      init_head<CT>(states[qi * task.nh + i],
                    a.q + (task.q0 + qi) * a.q_stride_t + (task.h0 + i) * a.q_stride_h, dv);

  // Columns of each token row this task reads: its kv groups' slices.
  const int64_t g_lo = task.h0 / G, g_hi = (task.h0 + task.nh - 1) / G;
  const int64_t pf_col = g_lo * a.D;
  const int64_t pf_bytes =
      prefetch ? (g_hi - g_lo + 1) * a.D * static_cast<int64_t>(sizeof(CT)) : 0;

  // Row pointers of the current and the next tile (double buffered): the next
  // tile's K/V rows are prefetched while the current one is computed.
  const CT* ptr_buf[2][2][kKeyTile];
  int cur = 0;
  const auto tile_len = [](int64_t pos, int64_t key0) {
    return static_cast<int>(std::min<int64_t>(kKeyTile, pos + 1 - key0));
  };
  const int n0 = tile_len(pos_max, 0);
  tile_ptrs(a, bt, 0, n0, last_pos, last_slot, ptr_buf[0][0], ptr_buf[0][1]);
  const int pf_n0 = prefetch ? n0 : 0;
  prefetch_rows(ptr_buf[0][0], 0, pf_n0, pf_col, pf_bytes);
  prefetch_rows(ptr_buf[0][1], 0, pf_n0, pf_col, pf_bytes);
  int64_t first_q = 0;  // queries before it have pos < key0 (positions increase)
  for (int64_t key0 = 0; key0 <= pos_max; key0 += kKeyTile) {
    while (tok_pos[task.q0 + first_q] < key0) ++first_q;
    const int64_t next0 = key0 + kKeyTile;
    const int nn = next0 <= pos_max ? tile_len(pos_max, next0) : 0;
    if (nn > 0)
      tile_ptrs(a, bt, next0, nn, last_pos, last_slot, ptr_buf[cur ^ 1][0], ptr_buf[cur ^ 1][1]);
    const int pf_n = prefetch ? nn : 0;
    const int64_t steps = task.nh * (task.nq - first_q);
    int64_t step = 0;
    for (int64_t i = 0; i < task.nh; ++i) {
      const int64_t col = ((task.h0 + i) / G) * a.D;
      for (int64_t qi = first_q; qi < task.nq; ++qi, ++step) {
        const int64_t pos = tok_pos[task.q0 + qi];
        const PrefetchSlice<CT> pf{ptr_buf[cur ^ 1][0], ptr_buf[cur ^ 1][1],
                                   static_cast<int>(pf_n * step / steps),
                                   static_cast<int>(pf_n * (step + 1) / steps), pf_col, pf_bytes};
        // NOTE: n is this query's own tile length; pointer entries beyond it
        // (later keys or padding) only feed lanes that are masked to -inf.
        attend_tile<CT, DV_, kArr>(states[qi * task.nh + i], ptr_buf[cur][0], ptr_buf[cur][1],
                                   col, tile_len(pos, key0), dv, scale, pf);
      }
    }
    cur ^= 1;
  }
  for (int64_t qi = 0; qi < task.nq; ++qi)
    for (int64_t i = 0; i < task.nh; ++i)
      store_head<CT>(states[qi * task.nh + i],
                     a.out + ((task.q0 + qi) * a.Hq + task.h0 + i) * a.D, dv);
}

// Splits the batch into tasks. Heads per task: all Hq (whole token rows
// streamed once, K/V tiles shared by every head from L1), else one GQA group,
// else one head, taking the coarsest that still gives each thread >= 4 tasks
// (so 2 threads are busy at batch 1). NOTE: the split never changes results.
std::vector<AttnTask> plan_tasks(const int32_t* qs, int64_t S, int64_t Hq, int64_t Hk,
                                 int64_t threads) {
  int64_t chunks = 0;  // query chunks of <= kMaxTaskQueries
  for (int64_t s = 0; s < S; ++s)
    chunks += (qs[s + 1] - qs[s] + kMaxTaskQueries - 1) / kMaxTaskQueries;
  const int64_t G = Hq / Hk;
  int64_t per_task = 1;
  if (chunks >= 4 * threads) {
    per_task = Hq;
  } else if (chunks * Hk >= 4 * threads) {
    per_task = G;
  }
  std::vector<AttnTask> tasks;
  tasks.reserve(chunks * (Hq / per_task));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t q0 = qs[s]; q0 < qs[s + 1]; q0 += kMaxTaskQueries)
      for (int64_t h0 = 0; h0 < Hq; h0 += per_task)
        tasks.push_back({s, q0, std::min<int64_t>(kMaxTaskQueries, qs[s + 1] - q0), h0, per_task});
  return tasks;
}

// Contiguous task ranges of about equal cost (queries x heads x keys), one per
// thread: sequences of very different lengths would unbalance an even split.
std::vector<int64_t> split_by_cost(const std::vector<AttnTask>& tasks,
                                   const std::vector<int64_t>& tok_pos, int64_t parts) {
  std::vector<double> prefix(tasks.size() + 1, 0.0);
  for (size_t t = 0; t < tasks.size(); ++t) {
    const AttnTask& k = tasks[t];
    const double keys = static_cast<double>(tok_pos[k.q0 + k.nq - 1] + 1);
    prefix[t + 1] = prefix[t] + static_cast<double>(k.nq * k.nh) * keys;
  }
  std::vector<int64_t> bounds(parts + 1, 0);
  size_t t = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const double target = prefix.back() * static_cast<double>(p) / static_cast<double>(parts);
    while (t < tasks.size() && prefix[t + 1] <= target) ++t;
    bounds[p] = static_cast<int64_t>(t);
  }
  bounds[parts] = static_cast<int64_t>(tasks.size());
  return bounds;
}

template <typename CT, int DV_>
void attention_driver(const AttnArgs<CT>& a, const std::vector<AttnTask>& tasks,
                      const std::vector<int64_t>& tok_pos, int64_t threads) {
  const std::vector<int64_t> bounds = split_by_cost(tasks, tok_pos, threads);
  // One index per thread (grain 1, `threads` indices), each runs its range.
  const int64_t G = a.Hq / a.Hk;
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<HeadState<state_lanes<DV_>()>> states;
    for (int64_t part = lo; part < hi; ++part)
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) {
        // A single-head task right after one of the same query chunk and kv
        // group finds that group's K/V rows in L2: skip its prefetches.
        const AttnTask& k = tasks[t];
        const bool warm = t > bounds[part] && k.nh == 1 && tasks[t - 1].q0 == k.q0 &&
                          (tasks[t - 1].h0 / G) == (k.h0 / G);
        attend_task<CT, DV_>(a, k, tok_pos.data(), !warm, states);
      }
  });
}

template <typename CT>
void attention_dispatch(const AttnArgs<CT>& a, const std::vector<AttnTask>& tasks,
                        const std::vector<int64_t>& tok_pos, int64_t threads) {
  switch (a.D) {
    case 32: return attention_driver<CT, 4>(a, tasks, tok_pos, threads);
    case 64: return attention_driver<CT, 8>(a, tasks, tok_pos, threads);
    case 128: return attention_driver<CT, 16>(a, tasks, tok_pos, threads);
    default: return attention_driver<CT, 0>(a, tasks, tok_pos, threads);
  }
}

void check_cache(const at::Tensor& c, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(c.dim() == 4 && c.is_contiguous(), name,
              " must be a contiguous [num_blocks, block_size, Hk, D] tensor");
  TORCH_CHECK(c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ||
                  c.scalar_type() == at::kHalf,
              name, " must be float32, bfloat16 or float16");
  TORCH_CHECK(c.sizes() == ref.sizes() && c.scalar_type() == ref.scalar_type(),
              "k_cache and v_cache must have the same shape and dtype");
}

// Absolute position of every query token (bottom-right aligned causal:
// query i of a sequence with q_len L and seq_len n sits at n - L + i); also
// returns the key x head pair count. Validated serially (S is small).
std::vector<int64_t> token_positions(const int32_t* qs, const int32_t* sl, int64_t S, int64_t T,
                                     int64_t max_keys, int64_t Hq, int64_t& pairs) {
  TORCH_CHECK(qs[0] == 0 && qs[S] == T, "paged_attention: query_start_loc must span 0..T");
  std::vector<int64_t> tok_pos(T);
  pairs = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ql = qs[s + 1] - qs[s];
    TORCH_CHECK(ql >= 0 && ql <= sl[s], "paged_attention: sequence ", s, " has q_len ", ql,
                " > seq_len ", sl[s]);
    TORCH_CHECK(sl[s] <= max_keys, "paged_attention: seq_len exceeds the block table");
    for (int64_t i = 0; i < ql; ++i) {
      tok_pos[qs[s] + i] = sl[s] - ql + i;
      pairs += (sl[s] - ql + i + 1) * Hq;
    }
  }
  return tok_pos;
}

template <typename CT>
void run_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const at::Tensor& bt, const at::Tensor& seq_lens, const at::Tensor& last_slot,
                   at::Tensor& out, double scale, const std::vector<AttnTask>& tasks,
                   const std::vector<int64_t>& tok_pos, int64_t threads) {
  AttnArgs<CT> a{};
  a.q = q.data_ptr<float>();
  a.k_cache = kc.data_ptr<CT>();
  a.v_cache = vc.data_ptr<CT>();
  a.block_tables = bt.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.last_slot = last_slot.defined() ? last_slot.data_ptr<int64_t>() : nullptr;
  a.out = out.data_ptr<float>();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.Hq = q.size(1);
  a.Hk = kc.size(2);
  a.D = q.size(2);
  a.block_size = kc.size(1);
  a.num_blocks = kc.size(0);
  a.max_blocks = bt.size(1);
  a.scale = static_cast<float>(scale);
  attention_dispatch(a, tasks, tok_pos, threads);
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                           const at::Tensor& seq_lens_in, const at::Tensor& qsl_in, double scale,
                           const std::optional<at::Tensor>& last_slot_in) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "paged_attention: q must be float32 [T, Hq, D]");
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor bt = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kInt).contiguous();
  const at::Tensor qsl = qsl_in.to(at::kInt).contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hk = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D, "paged_attention: head_dim mismatch");
  TORCH_CHECK(D % 8 == 0 && D / 8 <= kMaxDV, "paged_attention: head_dim must be a multiple of 8");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "paged_attention: Hq must be a multiple of Hk");
  TORCH_CHECK(bt.dim() == 2, "paged_attention: block_tables must be [S, max_blocks]");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(bt.size(0) >= S && qsl.numel() == S + 1,
              "paged_attention: block_tables / query_start_loc do not match seq_lens");
  at::Tensor last_slot;
  if (last_slot_in.has_value() && last_slot_in->defined()) {
    last_slot = last_slot_in->to(at::kLong).contiguous();
    TORCH_CHECK(last_slot.numel() == S, "paged_attention: last_slot must be [S]");
  }

  int64_t pairs = 0;
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const std::vector<int64_t> tok_pos =
      token_positions(qs, seq_lens.data_ptr<int32_t>(), S, T, bt.size(1) * bs, Hq, pairs);
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  if (T == 0) return out;
  // Below ~512 key x head pairs (a few us of work) the OpenMP fork/join costs
  // more than a second thread saves.
  const int64_t threads = pairs < kParallelMinPairs ? 1 : std::max(1, at::get_num_threads());
  const std::vector<AttnTask> tasks = plan_tasks(qs, S, Hq, Hk, threads);
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      run_attention<float>(q, k_cache, v_cache, bt, seq_lens, last_slot, out, scale, tasks,
                           tok_pos, threads);
      break;
    case at::kBFloat16:
      run_attention<at::BFloat16>(q, k_cache, v_cache, bt, seq_lens, last_slot, out, scale,
                                  tasks, tok_pos, threads);
      break;
    default:
      run_attention<at::Half>(q, k_cache, v_cache, bt, seq_lens, last_slot, out, scale, tasks,
                              tok_pos, threads);
  }
  return out;
}

// ----------------------------------------------------------------------------
// write_kv_cache: cache[slot] = k / v (converted); negative slots are skipped
// ----------------------------------------------------------------------------

template <typename CT>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, CT* kc, CT* vc,
                   const int64_t* slots, int64_t num_slots) {
  const int64_t T = k.size(0), Hk = k.size(1), D = k.size(2);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), vs0 = v.stride(0);
  at::parallel_for(0, T, rows_grain(Hk * D * 4), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token (vLLM convention)
      TORCH_CHECK(slot < num_slots, "write_kv_cache: slot ", slot, " out of range");
      // Heads of one token are contiguous in both source rows and the cache.
      convert_row(kp + t * ks0, kc + slot * Hk * D, Hk * D);
      convert_row(vp + t * vs0, vc + slot * Hk * D, Hk * D);
    }
  });
}

at::Tensor rows_with_contiguous_heads(const at::Tensor& x) {
  const bool ok =
      (x.size(2) <= 1 || x.stride(2) == 1) && (x.size(1) <= 1 || x.stride(1) == x.size(2));
  return ok ? x : x.contiguous();
}

void write_kv_cache(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(k_in.dim() == 3 && k_in.scalar_type() == at::kFloat && v_in.sizes() == k_in.sizes() &&
                  v_in.scalar_type() == at::kFloat,
              "write_kv_cache: k and v must be float32 [T, Hk, D]");
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  TORCH_CHECK(k_cache.size(2) == k_in.size(1) && k_cache.size(3) == k_in.size(2),
              "write_kv_cache: [Hk, D] of k does not match the cache");
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k_in.size(0), "write_kv_cache: slot_mapping must be [T]");
  const at::Tensor k = rows_with_contiguous_heads(k_in);
  const at::Tensor v = rows_with_contiguous_heads(v_in);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      write_kv_impl(k, v, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, num_slots);
      break;
    case at::kBFloat16:
      write_kv_impl(k, v, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), sp,
                    num_slots);
      break;
    default:
      write_kv_impl(k, v, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), sp,
                    num_slots);
  }
}

// ----------------------------------------------------------------------------
// Greedy speculative verification (fused)
// ----------------------------------------------------------------------------
// Inside a decode step every small torch op costs ~10 us (the forward has just
// streamed the weights through the caches), and torch's argmax reads logits at
// ~1 GB/s; this op replaces the ~10-20 ops and the argmax passes of a greedy
// verify with one call. Same decisions as rejection_sampler (see there).

// torch.argmax semantics: the first index of the maximum; a NaN is the maximum.
int64_t argmax_row(const float* x, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(neg_inf);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  float m = hmax(vmax);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    any_nan = any_nan || std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // unreachable for n > 0
}

// logits [R * (K + 1) + R * W, V]: each row's K + 1 positions, then each row's W
// alternatives. Returns (tokens [R, K + 1] = the main rows' argmaxes with column 1
// replaced by the accepted alternative's own argmax, accepted [R], hit [R], choice [R]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_greedy(
    const at::Tensor& logits_in, const at::Tensor& drafts_in, const at::Tensor& num_valid_in,
    const at::Tensor& alternatives_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat,
              "verify_greedy: logits must be float32 [M, V]");
  TORCH_CHECK(drafts_in.dim() == 2 && drafts_in.size(1) >= 1, "verify_greedy: drafts [R, K>=1]");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor drafts = drafts_in.to(at::kLong).contiguous();
  const at::Tensor num_valid = num_valid_in.to(at::kLong).contiguous();
  const at::Tensor alts = alternatives_in.to(at::kLong).contiguous();
  const int64_t R = drafts.size(0), K = drafts.size(1), V = logits.size(1);
  TORCH_CHECK(alts.dim() == 2 && alts.size(0) == R, "verify_greedy: alternatives [R, W]");
  TORCH_CHECK(num_valid.dim() == 1 && num_valid.size(0) == R, "verify_greedy: num_valid [R]");
  const int64_t W = alts.size(1);
  TORCH_CHECK(logits.size(0) == R * (K + 1) + R * W, "verify_greedy: logits has ",
              logits.size(0), " rows, expected R * (K + 1) + R * W = ", R * (K + 1) + R * W);
  TORCH_CHECK(V > 0 || logits.size(0) == 0, "verify_greedy: empty vocabulary");
  const int64_t M = logits.size(0);
  std::vector<int64_t> am(M);
  const float* lp = logits.data_ptr<float>();
  at::parallel_for(0, M, rows_grain(V), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) am[i] = argmax_row(lp + i * V, V);
  });
  auto opts = drafts.options();
  at::Tensor tokens = at::empty({R, K + 1}, opts);
  at::Tensor accepted = at::empty({R}, opts);
  at::Tensor hit = at::zeros({R}, opts.dtype(at::kBool));
  at::Tensor choice = at::zeros({R}, opts);
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* ap = accepted.data_ptr<int64_t>();
  bool* hp = hit.data_ptr<bool>();
  int64_t* cp = choice.data_ptr<int64_t>();
  const int64_t* dp = drafts.data_ptr<int64_t>();
  const int64_t* np = num_valid.data_ptr<int64_t>();
  const int64_t* xp = alts.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    int64_t* t = tp + r * (K + 1);
    for (int64_t j = 0; j <= K; ++j) t[j] = am[r * (K + 1) + j];
    int64_t acc = 0;
    while (acc < K && acc < np[r] && dp[r * K + acc] == t[acc]) ++acc;
    if (acc == 0 && np[r] >= 1) {  // a real first draft, rejected: try the alternatives
      for (int64_t w = 0; w < W; ++w) {
        if (xp[r * W + w] == t[0]) {
          hp[r] = true;
          cp[r] = w;
          t[1] = am[R * (K + 1) + r * W + w];
          acc = 1;
          break;
        }
      }
    }
    ap[r] = acc;
  }
  return {tokens, accepted, hit, choice};
}

// ----------------------------------------------------------------------------
// Token tree: commit the accepted alternatives (fused)
// ----------------------------------------------------------------------------
// For each row with a hit, the accepted alternative becomes the request's token
// at p + 1: its K and V (every layer of the stacked caches) are copied from its
// scratch slot into the request's slot, and its hidden row replaces d1's row.
// Rows without a hit are left alone. One call instead of ~12 small torch ops.

void commit_side_rows(at::Tensor& k_stack, at::Tensor& v_stack, const at::Tensor& side_slots,
                      const at::Tensor& real_slot, const at::Tensor& hit,
                      const at::Tensor& choice, at::Tensor& hidden,
                      const at::Tensor& side_hidden, const at::Tensor& first_draft) {
  TORCH_CHECK(k_stack.dim() == 5 && k_stack.sizes() == v_stack.sizes() &&
                  k_stack.is_contiguous() && v_stack.is_contiguous() &&
                  k_stack.scalar_type() == v_stack.scalar_type(),
              "commit_side_rows: K and V stacks must be contiguous [L, blocks, bs, Hk, D] alike");
  TORCH_CHECK(side_slots.dim() == 2 && side_slots.scalar_type() == at::kLong,
              "commit_side_rows: side_slots must be int64 [R, W]");
  const int64_t R = side_slots.size(0), W = side_slots.size(1);
  for (const at::Tensor* t : {&real_slot, &choice, &first_draft})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->scalar_type() == at::kLong,
                "commit_side_rows: real_slot, choice and first_draft must be int64 [R]");
  TORCH_CHECK(hit.dim() == 1 && hit.size(0) == R && hit.scalar_type() == at::kBool,
              "commit_side_rows: hit must be bool [R]");
  TORCH_CHECK(hidden.dim() == 2 && side_hidden.dim() == 2 && hidden.size(1) == side_hidden.size(1) &&
                  hidden.scalar_type() == side_hidden.scalar_type() && hidden.stride(1) == 1 &&
                  side_hidden.stride(1) == 1 && side_hidden.size(0) == R * W,
              "commit_side_rows: hidden [T, H] and side_hidden [R * W, H] with unit column stride");
  const at::Tensor ss = side_slots.contiguous(), rs = real_slot.contiguous(),
                   hs = hit.contiguous(), cs = choice.contiguous(), fd = first_draft.contiguous();
  const int64_t L = k_stack.size(0);
  const int64_t num_slots = k_stack.size(1) * k_stack.size(2);
  const int64_t slot_bytes = k_stack.size(3) * k_stack.size(4) * k_stack.element_size();
  const int64_t layer_bytes = num_slots * slot_bytes;
  const int64_t H = hidden.size(1), row_bytes = H * hidden.element_size();
  char* kb = static_cast<char*>(k_stack.data_ptr());
  char* vb = static_cast<char*>(v_stack.data_ptr());
  char* hb = static_cast<char*>(hidden.data_ptr());
  const char* sb = static_cast<const char*>(side_hidden.data_ptr());
  const int64_t hstride = hidden.stride(0) * hidden.element_size();
  const int64_t sstride = side_hidden.stride(0) * side_hidden.element_size();
  const int64_t* slots = ss.data_ptr<int64_t>();
  const int64_t* real = rs.data_ptr<int64_t>();
  const bool* hits = hs.data_ptr<bool>();
  const int64_t* chosen = cs.data_ptr<int64_t>();
  const int64_t* rows = fd.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {  // check every row before writing any
    if (!hits[r]) continue;
    const int64_t c = chosen[r];
    TORCH_CHECK(c >= 0 && c < W, "commit_side_rows: choice ", c, " out of range");
    const int64_t src = slots[r * W + c], dst = real[r];
    TORCH_CHECK(src >= 0 && src < num_slots && dst >= 0 && dst < num_slots,
                "commit_side_rows: slot out of range");
    TORCH_CHECK(rows[r] >= 0 && rows[r] < hidden.size(0), "commit_side_rows: bad d1 row");
  }
  for (int64_t r = 0; r < R; ++r) {
    if (!hits[r]) continue;
    const int64_t c = chosen[r];
    const int64_t src = slots[r * W + c], dst = real[r];
    for (int64_t l = 0; l < L; ++l) {
      const int64_t base = l * layer_bytes;
      std::memcpy(kb + base + dst * slot_bytes, kb + base + src * slot_bytes, slot_bytes);
      std::memcpy(vb + base + dst * slot_bytes, vb + base + src * slot_bytes, slot_bytes);
    }
    std::memcpy(hb + rows[r] * hstride, sb + (r * W + c) * sstride, row_bytes);
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// Prompt lookup (n-gram drafts)
// ----------------------------------------------------------------------------
// For each row (a state slot): the row's last n tokens, n from n_max down to n_min,
// searched for their latest earlier occurrence in history[slot, :L] (one that ends
// before the suffix itself starts, so at least one known token follows it); the k
// tokens after the match are the drafts and num = min(k, L - match end), or 0 when no
// n matches. Replaces ~15 torch ops per n (unfold, compare, reductions) with a scan.

std::tuple<at::Tensor, at::Tensor> ngram_lookup(const at::Tensor& history_in,
                                                const at::Tensor& committed_in,
                                                const at::Tensor& slots_in, int64_t width,
                                                int64_t k, int64_t n_min, int64_t n_max) {
  TORCH_CHECK(history_in.dim() == 2 && history_in.scalar_type() == at::kLong,
              "ngram_lookup: history must be int64 [S, W]");
  TORCH_CHECK(k >= 1 && 1 <= n_min && n_min <= n_max, "ngram_lookup: need k >= 1 and ",
              "1 <= n_min <= n_max");
  TORCH_CHECK(1 <= width && width <= history_in.size(1), "ngram_lookup: width ", width,
              " outside [1, ", history_in.size(1), "]");
  const at::Tensor history = history_in.contiguous();
  const at::Tensor committed = committed_in.to(at::kLong).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const int64_t S = history.size(0), stride = history.size(1), R = slots.size(0);
  TORCH_CHECK(committed.dim() == 1 && committed.size(0) == S, "ngram_lookup: committed [S]");
  const int64_t* hp = history.data_ptr<int64_t>();
  const int64_t* lp = committed.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(0 <= sp[r] && sp[r] < S, "ngram_lookup: slot ", sp[r], " outside [0, ", S, ")");
    TORCH_CHECK(0 <= lp[sp[r]] && lp[sp[r]] <= width, "ngram_lookup: row length ", lp[sp[r]],
                " outside [0, width ", width, "]");
  }
  at::Tensor drafts = at::empty({R, k}, history.options());
  at::Tensor num = at::zeros({R}, history.options());
  int64_t* dp = drafts.data_ptr<int64_t>();
  int64_t* np = num.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* h = hp + sp[r] * stride;
    const int64_t L = lp[sp[r]];
    int64_t best = -1;  // index just after the match
    for (int64_t n = n_max; n >= n_min && best < 0; --n) {
      if (L < n + 1) continue;
      const int64_t* suffix = h + L - n;
      for (int64_t s = L - n - 1; s >= 0; --s) {
        if (std::equal(suffix, suffix + n, h + s)) {
          best = s + n;
          break;
        }
      }
    }
    const int64_t from = std::max<int64_t>(best, 0);  // no match: any tokens (num = 0)
    for (int64_t j = 0; j < k; ++j) dp[r * k + j] = h[std::min(from + j, width - 1)];
    if (best >= 0) np[r] = std::min(k, L - best);
  }
  return {drafts, num};
}

// ----------------------------------------------------------------------------
// Slot mapping (paged KV): one op instead of the index/div/mul/remainder/add chain
// ----------------------------------------------------------------------------
// Token t of row token_row[t] at position p goes to slot table[row, p / bs] * bs + p % bs.

namespace {

template <typename B>
void map_slots(const B* table, int64_t rows, int64_t cols, const int64_t* row,
               const int64_t* pos, int64_t T, int64_t bs, int64_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = row[t], p = pos[t];
    TORCH_CHECK(0 <= r && r < rows, "slot_mapping: token row ", r, " outside [0, ", rows, ")");
    TORCH_CHECK(0 <= p && p / bs < cols, "slot_mapping: position ", p,
                " outside the block table (", cols, " blocks of ", bs, ")");
    out[t] = static_cast<int64_t>(table[r * cols + p / bs]) * bs + p % bs;
  }
}

}  // namespace

at::Tensor slot_mapping(const at::Tensor& table_in, const at::Tensor& token_row_in,
                        const at::Tensor& positions_in, int64_t block_size) {
  TORCH_CHECK(table_in.dim() == 2 && (table_in.scalar_type() == at::kInt ||
                                      table_in.scalar_type() == at::kLong),
              "slot_mapping: table must be int32 or int64 [R, blocks]");
  TORCH_CHECK(block_size >= 1, "slot_mapping: block_size must be >= 1");
  const at::Tensor table = table_in.contiguous();
  const at::Tensor row = token_row_in.to(at::kLong).contiguous();
  const at::Tensor pos = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(row.dim() == 1 && pos.dim() == 1 && row.size(0) == pos.size(0),
              "slot_mapping: token_row and positions must be [T]");
  const int64_t T = pos.size(0), R = table.size(0), C = table.size(1);
  at::Tensor out = at::empty({T}, pos.options());
  if (table.scalar_type() == at::kInt)
    map_slots(table.data_ptr<int32_t>(), R, C, row.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
              T, block_size, out.data_ptr<int64_t>());
  else
    map_slots(table.data_ptr<int64_t>(), R, C, row.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
              T, block_size, out.data_ptr<int64_t>());
  return out;
}

// ----------------------------------------------------------------------------
// Draft bookkeeping of a speculative step (MTP head)
// ----------------------------------------------------------------------------
// Two ops that replace the ~10 small torch ops around the head's draft: the best
// tokens of the draft logits (torch's argmax/topk run at ~1 GB/s here) and the write
// of the next step's drafts into the rows' state slots.

namespace {

// x ranks above y: NaN first (as torch.argmax and a descending stable sort), then the
// larger value, ties broken by the lower index.
inline bool ranks_above(float x, int64_t i, float y, int64_t j) {
  const bool xn = std::isnan(x), yn = std::isnan(y);
  if (xn != yn) return xn;
  if (!xn && x != y) return x > y;
  return i < j;
}

// The n best indices of one row, best first, into out (n <= V).
void top_row(const float* x, int64_t V, int64_t n, int64_t* out) {
  if (n == 1) {
    out[0] = argmax_row(x, V);
    return;
  }
  int64_t used = 0;  // out[0 .. used) kept sorted best first
  float worst = 0.0f;  // x[out[n - 1]] once used == n
  for (int64_t j = 0; j < V; ++j) {
    // NOTE: x[j] <= worst is false for a NaN on either side: those take the full test.
    // Columns come in increasing order, so a tie with the worst never ranks above it.
    if (used == n && (x[j] <= worst || !ranks_above(x[j], j, worst, out[n - 1]))) continue;
    int64_t pos = used < n ? used++ : n - 1;
    while (pos > 0 && ranks_above(x[j], j, x[out[pos - 1]], out[pos - 1])) {
      out[pos] = out[pos - 1];
      --pos;
    }
    out[pos] = j;
    worst = x[out[used - 1]];
  }
}

}  // namespace

// logits [N, V] float32 -> [N, n] int64: each row's n best columns, best first (ties:
// the lower column), as token ids through vocab [V] when given (a draft vocabulary).
at::Tensor top_tokens(const at::Tensor& logits_in, int64_t n,
                      const std::optional<at::Tensor>& vocab_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat,
              "top_tokens: logits must be float32 [N, V]");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(1 <= n && n <= V, "top_tokens: n = ", n, " outside [1, V = ", V, "]");
  at::Tensor vocab;
  if (vocab_in.has_value() && vocab_in->defined()) {
    vocab = vocab_in->to(at::kLong).contiguous();
    TORCH_CHECK(vocab.dim() == 1 && vocab.size(0) == V, "top_tokens: vocab must be [V]");
  }
  at::Tensor out = at::empty({N, n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t* vp = vocab.defined() ? vocab.data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, N, rows_grain(V), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      top_row(lp + i * V, V, n, op + i * n);
      if (vp)
        for (int64_t j = 0; j < n; ++j) op[i * n + j] = vp[op[i * n + j]];
    }
  });
  return out;
}

// For each row r (state slot s = slots[r]): the drafts are found[r] with num[r] of them
// where a lookup found some (num[r] > 0), else chain[r] (the head's k drafts);
// side_drafts[s, :A] are the best A of top[r] (the head's 1 + A best first tokens) that
// differ from the row's first draft. found/num and top are optional.
void write_drafts(at::Tensor& drafts, at::Tensor& num_drafts, at::Tensor& side_drafts,
                  const at::Tensor& slots_in, const at::Tensor& chain_in,
                  const std::optional<at::Tensor>& top_in,
                  const std::optional<at::Tensor>& found_in,
                  const std::optional<at::Tensor>& num_in) {
  for (const at::Tensor* t : {&drafts, &num_drafts, &side_drafts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "write_drafts: state tensors must be contiguous int64");
  TORCH_CHECK(drafts.dim() == 2 && num_drafts.dim() == 1 && side_drafts.dim() == 2 &&
                  num_drafts.size(0) == drafts.size(0) && side_drafts.size(0) == drafts.size(0),
              "write_drafts: drafts [S, K], num_drafts [S], side_drafts [S, W]");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor chain = chain_in.to(at::kLong).contiguous();
  const int64_t S = drafts.size(0), R = slots.size(0), k = chain.dim() == 2 ? chain.size(1) : 0;
  TORCH_CHECK(chain.dim() == 2 && chain.size(0) == R && 1 <= k && k <= drafts.size(1),
              "write_drafts: chain must be [R, k] with 1 <= k <= drafts.size(1)");
  const bool lookup = found_in.has_value() && found_in->defined();
  TORCH_CHECK(lookup == (num_in.has_value() && num_in->defined()),
              "write_drafts: found and num go together");
  at::Tensor found, num, top;
  if (lookup) {
    found = found_in->to(at::kLong).contiguous();
    num = num_in->to(at::kLong).contiguous();
    TORCH_CHECK(found.sizes() == chain.sizes() && num.dim() == 1 && num.size(0) == R,
                "write_drafts: found [R, k] and num [R]");
  }
  int64_t A = 0;
  if (top_in.has_value() && top_in->defined()) {
    top = top_in->to(at::kLong).contiguous();
    A = top.dim() == 2 ? top.size(1) - 1 : -1;
    TORCH_CHECK(top.dim() == 2 && top.size(0) == R && 0 <= A && A <= side_drafts.size(1),
                "write_drafts: top must be [R, 1 + A] with A <= side_drafts.size(1)");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= sp[r] && sp[r] < S, "write_drafts: slot ", sp[r], " outside [0, ", S, ")");
  const int64_t Kd = drafts.size(1), Wd = side_drafts.size(1);
  int64_t* dp = drafts.data_ptr<int64_t>();
  int64_t* np = num_drafts.data_ptr<int64_t>();
  int64_t* xp = side_drafts.data_ptr<int64_t>();
  const int64_t* cp = chain.data_ptr<int64_t>();
  const int64_t* fp = lookup ? found.data_ptr<int64_t>() : nullptr;
  const int64_t* mp = lookup ? num.data_ptr<int64_t>() : nullptr;
  const int64_t* tp = A > 0 ? top.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = sp[r];
    const bool hit = lookup && mp[r] > 0;
    const int64_t* src = (hit ? fp : cp) + r * k;
    std::copy(src, src + k, dp + s * Kd);
    np[s] = hit ? mp[r] : k;
    if (A == 0) continue;
    const int64_t* cand = tp + r * (A + 1);
    int64_t w = 0;
    for (int64_t j = 0; j <= A && w < A; ++j)
      if (cand[j] != src[0]) xp[s * Wd + w++] = cand[j];
  }
}

}  // namespace laneserve

TORCH_LIBRARY(laneserve, m) {
  m.def("pack_linear_weight(Tensor w, int isa) -> Tensor");
  m.def(
      "linear(Tensor x, Tensor w, int out_features, Tensor? bias, int isa, "
      "Tensor? scale=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, int head_dim, "
      "Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor? last_slot=None) -> Tensor");
  m.def(
      "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "verify_greedy(Tensor logits, Tensor drafts, Tensor num_valid, Tensor alternatives) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "commit_side_rows(Tensor(a!) k_stack, Tensor(b!) v_stack, Tensor side_slots, "
      "Tensor real_slot, Tensor hit, Tensor choice, Tensor(c!) hidden, Tensor side_hidden, "
      "Tensor first_draft) -> ()");
  m.def(
      "ngram_lookup(Tensor history, Tensor committed, Tensor slots, int width, int k, "
      "int n_min, int n_max) -> (Tensor, Tensor)");
  m.def(
      "slot_mapping(Tensor table, Tensor token_row, Tensor positions, int block_size) -> "
      "Tensor");
  m.def("top_tokens(Tensor logits, int n, Tensor? vocab) -> Tensor");
  m.def(
      "write_drafts(Tensor(a!) drafts, Tensor(b!) num_drafts, Tensor(c!) side_drafts, "
      "Tensor slots, Tensor chain, Tensor? top, Tensor? found, Tensor? num) -> ()");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("pack_linear_weight", &laneserve::pack_linear_weight);
  m.impl("linear", &laneserve::linear);
  m.impl("rms_norm", &laneserve::rms_norm);
  m.impl("fused_add_rms_norm", &laneserve::fused_add_rms_norm);
  m.impl("rotary_embedding", &laneserve::rotary_embedding);
  m.impl("silu_and_mul", &laneserve::silu_and_mul);
  m.impl("paged_attention", &laneserve::paged_attention);
  m.impl("write_kv_cache", &laneserve::write_kv_cache);
  m.impl("verify_greedy", &laneserve::verify_greedy);
  m.impl("commit_side_rows", &laneserve::commit_side_rows);
  m.impl("ngram_lookup", &laneserve::ngram_lookup);
  m.impl("slot_mapping", &laneserve::slot_mapping);
  m.impl("top_tokens", &laneserve::top_tokens);
  m.impl("write_drafts", &laneserve::write_drafts);
}
