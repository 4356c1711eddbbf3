// quant_linear, AVX2 variant (picked by the caller where the CPU has no AVX-512): the same
// repacked GGUF records as quant_linear.cpp, with each 16-column record as two ymm halves.
//
// NOTE (exactness): each weight is the value quant.py `dequantize` computes, round(round(s *
// q) + o), and each output is the chain
//   acc = fma(x[k], w[k], acc) for k = 0..K-1 from 0, then + bias,
// so the result is bitwise linear(x, dequantize(W)) on the fp32 path, independent of M, of
// the tile shape and of the thread split. Unlike quant_linear.cpp, the weight is rebuilt
// with one fma(q, s, o): s * q is exact in fp32 (s: an fp16, or for q4_k an fp16 times a
// 6-bit integer, at most 17 significant bits; q: at most 8 bits; never near fp32's
// subnormals or overflow), so round(s * q + o) == round(round(s * q) + o), bit for bit.
// One vector op fewer per 8 weights; batch-1 decode here is bound by these ops. It reads ~5x fewer weight bytes than that fp32
// path (q4_1: 20 bytes per 32 weights against 128), which is what batch-1 decode waits on.

#include "quant_tiles.h"
#include "vec.h"

#include <cstring>

namespace laneserve {
namespace {

// 16 columns' scales (fp16, fp32 for q4_k) as two fp32 halves.
template <int64_t Q>
inline void load_scales(const uint8_t* p, __m256& lo, __m256& hi) {
  if constexpr (scale_bytes(Q) == 4) {
    lo = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    hi = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
  } else {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
}

// 8 columns' weights from their integer quants: s * q (+ o), as the module NOTE explains.
template <int64_t Q>
inline __m256 rebuild(__m256i q, __m256 s, __m256 o) {
  if constexpr (has_offset(Q)) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, o);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(q), s);
}

// Integer quants of k = 2j (e) and 2j + 1 (d) for 16 columns: [half][column / 8].
template <int64_t Q>
inline void load_quants(const uint8_t* quants, int j, __m256i (&e)[2], __m256i (&d)[2]) {
  if constexpr (Q == kQ8_0) {
    const __m128i* p = reinterpret_cast<const __m128i*>(quants + 2 * j * kNB);
    const __m128i v0 = _mm_loadu_si128(p), v1 = _mm_loadu_si128(p + 1);
    e[0] = _mm256_cvtepi8_epi32(v0);
    e[1] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v0, v0));
    d[0] = _mm256_cvtepi8_epi32(v1);
    d[1] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v1, v1));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + j * kNB));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_cvtepu8_epi32(h == 0 ? v : _mm_unpackhi_epi64(v, v));
      e[h] = _mm256_and_si256(b, mask);
      d[h] = _mm256_srli_epi32(b, 4);
      if constexpr (Q == kQ4_0) {  // stored as q + 8
        e[h] = _mm256_sub_epi32(e[h], _mm256_set1_epi32(8));
        d[h] = _mm256_sub_epi32(d[h], _mm256_set1_epi32(8));
      }
    }
  }
}

// R rows x C column blocks. Per output one FMA chain over k in order (module NOTE).
template <int64_t Q, int R, int C>
void quant_tile(const QuantArgs& a, int64_t m0, int64_t b0) {
  constexpr int64_t kRec = record_bytes(Q);
  constexpr int64_t kScaleBytes = scale_bytes(Q) * kNB;
  const int64_t K = a.K, stride = a.G * kRec;  // bytes per column block
  const float* x = a.x + m0 * K;
  const uint8_t* wb = a.w + b0 * stride;
  __m256 acc[C][R][2];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = _mm256_setzero_ps();

  for (int64_t g = 0; g < a.G; ++g) {
    __m256 s[C][2], o[C][2];
    const uint8_t* quants[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* rec = wb + c * stride + g * kRec;
      for (int64_t off = 0; off < kRec; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kWeightPrefetch + off), _MM_HINT_T0);
      load_scales<Q>(rec, s[c][0], s[c][1]);
      o[c][0] = o[c][1] = _mm256_setzero_ps();
      if constexpr (has_offset(Q)) load_scales<Q>(rec + kScaleBytes, o[c][0], o[c][1]);
      quants[c] = rec + (has_offset(Q) ? 2 : 1) * kScaleBytes;
    }
    const float* xg = x + g * kGroupK;
    for (int j = 0; j < kGroupK / 2; ++j) {
      __m256 x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        x0[r] = _mm256_broadcast_ss(xg + r * K + 2 * j);
        x1[r] = _mm256_broadcast_ss(xg + r * K + 2 * j + 1);
      }
      for (int c = 0; c < C; ++c) {
        __m256i e[2], d[2];
        load_quants<Q>(quants[c], j, e, d);
        for (int h = 0; h < 2; ++h) {
          const __m256 w0 = rebuild<Q>(e[h], s[c][h], o[c][h]);
          const __m256 w1 = rebuild<Q>(d[h], s[c][h], o[c][h]);
          for (int r = 0; r < R; ++r) {
            acc[c][r][h] = _mm256_fmadd_ps(x0[r], w0, acc[c][r][h]);
            acc[c][r][h] = _mm256_fmadd_ps(x1[r], w1, acc[c][r][h]);
          }
        }
      }
    }
  }
  for (int c = 0; c < C; ++c) store_block<R>(acc[c], a.bias, a.out, a.N, m0, (b0 + c) * kNB);
}

// Column blocks per tile: >= 8 independent FMA chains where the rows alone give fewer.
template <int R>
constexpr int quant_cols_for_rows() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}

template <int64_t Q>
void quant_range(const QuantArgs& a, int64_t lo, int64_t hi) {
  for_row_tiles<kTileRows>(a.M, [&](auto rows, int64_t m0) {
    constexpr int R = decltype(rows)::value;
    for_column_blocks<quant_cols_for_rows<R>()>(lo, hi, [&](auto cols, int64_t b) {
      quant_tile<Q, R, decltype(cols)::value>(a, m0, b);
    });
  });
}

}  // namespace

void quant_linear_avx2(const QuantArgs& a, int64_t qtype) {
  dispatch_qtype(qtype, [&](auto q) {
    constexpr int64_t Q = decltype(q)::value;
    // ~64k FMAs minimum per task, as linear.
    parallel_over_blocks(a.M, a.K, a.N, int64_t{1} << 16,
                         [&](int64_t lo, int64_t hi) { quant_range<Q>(a, lo, hi); });
  });
}

}  // namespace laneserve
