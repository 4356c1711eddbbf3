// Vector and threading helpers shared by the laneserve CPU kernels (x86-64, AVX2 + FMA +
// F16C). Every op family (linear.cpp, elementwise.cpp, attention.cpp, kv_cache.cpp,
// spec_ops.cpp) includes this header; bindings.cpp registers the ops.
//
// NOTE (batch invariance): every kernel computes each output row with a fixed sequence
// of floating point operations that depends only on that row's inputs (and, for
// attention, on the absolute key positions), never on the number of rows, the tiling
// chosen for the batch, or the thread split. This is what lets speculative decoding
// verify 1+k tokens in one call and get bitwise the same numbers as k+1 single-token
// calls. Do not introduce reductions whose order depends on M, on the parallel
// partition, or on the tile shape.
//
// NOTE (fp contraction): build.py compiles with -ffp-contract=off so that the compiler
// never fuses a*b+c on its own; every FMA is explicit. This keeps vector bodies and
// scalar tails bitwise consistent and matches torch's unfused elementwise formulas
// (rotary, rms_norm scaling).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace laneserve {

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

// Constants of the Cephes exp: range limits, ln 2 split in two, the polynomial's
// coefficients from the highest degree. Shared by exp256 and causal_attention's exp512.
namespace cephes_exp {
constexpr float kLow = -87.3365447504f;  // below: the result is denormal, flushed to 0
constexpr float kHigh = 88.3762626647949f;  // above: +inf
constexpr float kClamp = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace cephes_exp

// exp(x) for fp32 lanes, Cephes polynomial (~1-2 ulp). Inputs below
// -87.34 (results in the denormal range) flush to 0, inputs above 88.38
// overflow to +inf, NaN propagates. Used by silu and the attention softmax.
inline __m256 exp256(__m256 x) {
  namespace ce = cephes_exp;
  const __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(ce::kLow), _CMP_LT_OQ);
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(ce::kHigh), _CMP_GT_OQ);
  __m256 v = _mm256_min_ps(x, _mm256_set1_ps(ce::kClamp));
  v = _mm256_max_ps(v, _mm256_set1_ps(ce::kLow));

  __m256 fx = _mm256_fmadd_ps(v, _mm256_set1_ps(ce::kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ce::kLn2Hi), v);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ce::kLn2Lo), v);
  const __m256 z = _mm256_mul_ps(v, v);
  __m256 y = _mm256_set1_ps(ce::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(ce::kPoly[i]));
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
// Packed 16-column loads (linear weights; attention K/V rows use the same trick)
// ----------------------------------------------------------------------------
//
// bf16 rows loaded with load_w16 come out with the 16 columns in the lane order
// [0-3, 8-11 | 4-7, 12-15] (unpacklo/unpackhi_epi16 of one 256-bit load): linear
// packs its bf16 weights permuted to match; attention keeps q and acc in that order.

constexpr int64_t kNB = 16;    // output columns per packed block

// Calls f(std::integral_constant<int, R>{}) with R = min(rows, N) (rows >= 1): a tile's
// row count as a template argument.
template <int N, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (N == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    if (rows >= N) return f(std::integral_constant<int, N>{});
    with_rows<N - 1>(rows, f);
  }
}

// tile(std::integral_constant<int, R>{}, m0) for the row tiles m0 = 0, N, 2N, ... of M
// rows, R = min(N, M - m0) rows each.
template <int N, typename Tile>
inline void for_row_tiles(int64_t M, Tile&& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += N) with_rows<N>(M - m0, [&](auto rows) { tile(rows, m0); });
}

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

// Rows per parallel task for row-wise ops: ~128k elements, so decode batches run
// on the calling thread (an OpenMP fork/join costs ~5 us here).
inline int64_t rows_grain(int64_t width) {
  return std::max<int64_t>(1, 131072 / std::max<int64_t>(1, width));
}

// R rows' accumulators of one kNB-column block, each as two 8-lane halves, (+ bias)
// -> out[m0 + r][n0 .. n0 + kNB - 1], the columns below N only (a last block may be short).
template <int R>
inline void store_block(const __m256 (&acc)[R][2], const float* bias, float* out, int64_t N,
                        int64_t m0, int64_t n0) {
  const int64_t valid = std::min<int64_t>(kNB, N - n0);
  alignas(32) float bias_buf[kNB] = {0};
  if (bias != nullptr) std::memcpy(bias_buf, bias + n0, sizeof(float) * valid);
  const __m256 b_lo = _mm256_load_ps(bias_buf), b_hi = _mm256_load_ps(bias_buf + 8);
  for (int r = 0; r < R; ++r) {
    alignas(32) float buf[kNB];
    _mm256_store_ps(buf, bias ? _mm256_add_ps(acc[r][0], b_lo) : acc[r][0]);
    _mm256_store_ps(buf + 8, bias ? _mm256_add_ps(acc[r][1], b_hi) : acc[r][1]);
    std::memcpy(out + (m0 + r) * N + n0, buf, sizeof(float) * valid);
  }
}

}  // namespace laneserve
