// scaled_linear: y = x @ W^T (+ bias) with W kept in a checkpoint's block-scaled bytes
// (FP8 e4m3 with a scale per `group` columns of a row, or MXFP4: e2m1 pairs with a ue8m0
// exponent per 32 columns; laneserve/kernels/scaled.py). This file holds the entry point
// and the AVX2 + FMA + F16C variant; scaled_linear_avx512.cpp the AVX-512 one (the caller
// picks by `isa`, as for linear and quant_linear). Both give the same bits (see below).
//
// Layout (scaled.py repack, a byte transpose of the stored rows): values [nblk, B, 16]
// uint8, B = K (fp8) or ceil(K / 2) (fp4, byte j of a column holding k = 2j in its low
// nibble and 2j + 1 in its high one, as stored); scales [nblk, groups, 16], fp32 (fp8)
// or ue8m0 bytes (fp4). N is zero padded to a multiple of 16.
//
// NOTE (exactness, batch invariance): each weight is decoded in registers to
// value * scale (one fp32 multiply, as scaled.dequantize_rows), then each output is one
// FMA chain over k = 0..K-1 starting from 0, then + bias: the fp32 `linear` kernel's
// chain on the dequantized weight, so the bits equal that kernel's (and do not depend on
// M, the row tile, or the thread split: parallel over output blocks only).
//
// NOTE (registers): the small loops over rows, blocks and halves carry `#pragma GCC
// unroll`: without it GCC keeps the accumulator arrays on the stack and stores every
// accumulator on every k (measured: 2.5-3x slower past 4 rows).

#include "ops.h"
#include "scaled_tiles.h"
#include "vec.h"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

namespace laneserve {
namespace {

constexpr int kTileRows = 4;  // rows per tile: 8 accumulators + decoded weights in 16 ymm
// (more rows: each scale group is decoded once per column block into a buffer that every
// row tile reads, scaled_block_buffered)

// 8 ue8m0 exponents (zero-extended to 32 bits) -> 2^(e - 127) as fp32, exactly: the
// exponent field e (e = 0: the subnormal 2^-127; e = 255: NaN), no table.
inline __m256 e8m0x8(__m256i e) {
  const __m256i z = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
  const __m256i nan = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255));
  __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000), z);
  bits = _mm256_or_si256(bits, _mm256_and_si256(nan, _mm256_set1_epi32(0x7FC00000)));
  return _mm256_castsi256_ps(bits);
}

// 16 bytes -> two vectors of their 32-bit zero-extended values (columns 0-7, 8-15).
inline void widen16(__m128i bytes, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepu8_epi32(bytes);
  hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
}

// 16 e4m3 bytes -> 2^-8 times their values, without a table: each byte's sign, 4-bit
// exponent field and 3-bit mantissa placed in an fp16 (sign << 15 | exponent << 10 |
// mantissa << 7: the byte shifted left by 8, then arithmetically right by 1, bit 14 (a
// copy of the sign) cleared), an fp16 worth 2^-8 times the e4m3 value (fp16's wider
// exponent keeps e4m3 subnormals, m * 2^-9, as fp16 subnormals), widened exactly by F16C;
// the 2^8 is folded into the scale (group_fp8). NaN bytes (0x7f / 0xff) become the fp16
// NaN 0xffff. Used for kFmtFp8 (bytes that may be NaN) and where denormals read as zero.
inline void e4m3x16_half(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i b =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)),
                                         _mm256_set1_epi16(0x7F));
  const __m256i placed = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1);
  const __m256i h = _mm256_or_si256(
      _mm256_and_si256(placed, _mm256_set1_epi16(static_cast<int16_t>(0xBF80))), nan);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 8 e4m3 bytes that are not NaN -> 2^-120 times their values, in fp32 directly: the byte
// sign-extended to 32 bits and shifted left by 20 puts its exponent field and mantissa
// in bits 26..20 (fp32's exponent field's low 4 bits and mantissa's top 3) and copies of
// the sign in bits 31..27, of which the mask keeps bit 31. e4m3 subnormals become fp32
// subnormals (exact; this route is not taken when denormals are read as zero). Fewer
// operations than e4m3x16_half, and no NaN check: kFmtFp8Finite weights hold no NaN byte
// (checked when packed).
inline __m256 e4m3x8_single(const uint8_t* p) {
  const __m256i v =
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(
      _mm256_slli_epi32(v, 20), _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u))));
}

// The decode of format F (kFmtFp8 or kFmtFp8Finite): 16 bytes -> the values times
// 2^-unit_log2<F>() (columns 0-7, 8-15).
template <int64_t F>
constexpr int unit_log2() {
  return F == kFmtFp8 ? 8 : 120;
}

template <int64_t F>
inline void e4m3x16(const uint8_t* p, __m256& lo, __m256& hi) {
  if constexpr (F == kFmtFp8) {
    e4m3x16_half(p, lo, hi);
  } else {
    lo = e4m3x8_single(p);
    hi = e4m3x8_single(p + 8);
  }
}

// e2m1 code -> bits 16..31 of its fp32 value (the low 16 bits are zero), split into two
// byte tables for vpshufb (a code's bit 3 is the sign): magnitudes 0, 0.5, 1, 1.5, 2, 3,
// 4, 6 are 0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0.
#define LS_E2M1_LO 0, 0, -128, -64, 0, 64, -128, -64, 0, 0, -128, -64, 0, 64, -128, -64
#define LS_E2M1_HI 0, 63, 63, 63, 64, 64, 64, 64, -128, -65, -65, -65, -64, -64, -64, -64

// 16 fp4 bytes (16 columns, k = 2j in the low nibbles, 2j + 1 in the high ones) -> the
// exact fp32 values of both rows: v[0] / v[1] columns 0-7 / 8-15 of k = 2j, v[2] / v[3]
// those of k = 2j + 1. Both nibbles are looked up at once (one 128-bit lane each), the
// two table bytes interleaved into 16-bit halves, which become the fp32's high half.
inline void e2m1_pair(__m128i bytes, __m256 (&v)[4]) {
  const __m256i lo_tab = _mm256_setr_epi8(LS_E2M1_LO, LS_E2M1_LO);
  const __m256i hi_tab = _mm256_setr_epi8(LS_E2M1_HI, LS_E2M1_HI);
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes),
                                               _mm_srli_epi16(bytes, 4), 1);
  const __m256i codes = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  const __m256i lo = _mm256_shuffle_epi8(lo_tab, codes);
  const __m256i hi = _mm256_shuffle_epi8(hi_tab, codes);
  // 16-bit halves, per 64-bit quarter: [k0 c0-3, k0 c4-7 | k1 c0-3, k1 c4-7] -> reordered
  // to [k0 c0-3, k1 c0-3 | k0 c4-7, k1 c4-7], so that unpacking each 128-bit lane's low
  // (high) quarter gives the 8 columns of k0 (k1) in order
  const __m256i a = _mm256_permute4x64_epi64(_mm256_unpacklo_epi8(lo, hi), 0xD8);
  const __m256i b = _mm256_permute4x64_epi64(_mm256_unpackhi_epi8(lo, hi), 0xD8);
  const __m256i zero = _mm256_setzero_si256();
  v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a));
  v[1] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b));
  v[2] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a));
  v[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b));
}
#undef LS_E2M1_LO
#undef LS_E2M1_HI

// 2^unit * scale, exact unless it overflows: false where a finite scale exceeds
// 2^(127 - unit).
template <int64_t F>
inline bool scale_folds(__m256 s) {
  const float max_scale = std::ldexp(1.0f, 127 - unit_log2<F>());
  const __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), s);
  const __m256 big = _mm256_and_ps(_mm256_cmp_ps(mag, _mm256_set1_ps(max_scale), _CMP_GT_OQ),
                                   _mm256_cmp_ps(mag, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
  return _mm256_movemask_ps(big) == 0;
}

template <int64_t F>
inline __m256 unit() {
  return _mm256_set1_ps(std::ldexp(1.0f, unit_log2<F>()));
}

// Calls f(k, w_lo, w_hi) for each k of scale group g of one column block, with the 16
// weights of row k decoded to value * scale (columns 0-7, 8-15), k ascending.
// NOTE (exactness): v = h * 2^unit exactly (h the decoded value, e4m3x16), so
// h * (2^unit * s) and (h * 2^unit) * s round the same real number v * s once: the same
// bits, where 2^unit * s is exact (scale_folds; else the two multiplies).
template <int64_t F, typename Fn>
inline void group_fp8(const ScaledArgs& a, const uint8_t* w, const float* s, int64_t g,
                      Fn&& f) {
  const __m256 s_lo = _mm256_loadu_ps(s + g * kNB), s_hi = _mm256_loadu_ps(s + g * kNB + 8);
  const __m256 u = unit<F>();
  const int64_t k_begin = g * a.group, k_end = std::min(a.K, (g + 1) * a.group);
  if (scale_folds<F>(s_lo) && scale_folds<F>(s_hi)) {
    const __m256 t_lo = _mm256_mul_ps(s_lo, u), t_hi = _mm256_mul_ps(s_hi, u);
    for (int64_t k = k_begin; k < k_end; ++k) {
      __m256 vl, vh;
      e4m3x16<F>(w + k * kNB, vl, vh);
      f(k, _mm256_mul_ps(vl, t_lo), _mm256_mul_ps(vh, t_hi));
    }
    return;
  }
  for (int64_t k = k_begin; k < k_end; ++k) {
    __m256 vl, vh;
    e4m3x16<F>(w + k * kNB, vl, vh);
    f(k, _mm256_mul_ps(_mm256_mul_ps(vl, u), s_lo), _mm256_mul_ps(_mm256_mul_ps(vh, u), s_hi));
  }
}

// The 16 ue8m0 scales of group g of a column block as fp32 (columns 0-7, 8-15).
inline void fp4_scales(const uint8_t* s, int64_t g, __m256 (&sv)[2]) {
  __m256i e[2];
  widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kNB)), e[0], e[1]);
  sv[0] = e8m0x8(e[0]);
  sv[1] = e8m0x8(e[1]);
}

template <typename Fn>
inline void group_fp4(const ScaledArgs& a, const uint8_t* w, const uint8_t* s, int64_t g,
                      Fn&& f) {
  __m256 sv[2];
  fp4_scales(s, g, sv);
  const int64_t j_end = std::min(a.row_bytes, (g + 1) * a.group / 2);
  for (int64_t j = g * a.group / 2; j < j_end; ++j) {
    __m256 v[4];
    e2m1_pair(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * kNB)), v);
    f(2 * j, _mm256_mul_ps(v[0], sv[0]), _mm256_mul_ps(v[1], sv[1]));
    if (2 * j + 1 < a.K)  // odd K: the last byte's high nibble is padding
      f(2 * j + 1, _mm256_mul_ps(v[2], sv[0]), _mm256_mul_ps(v[3], sv[1]));
  }
}

// Column block b's values and scales.
struct Block {
  const uint8_t* w;
  const void* s;
};

template <int64_t F>
inline Block block_of(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b) {
  const int64_t scales = b * a.groups * kNB;
  const void* sb = F == kFmtFp4
                       ? static_cast<const void*>(static_cast<const uint8_t*>(s) + scales)
                       : static_cast<const void*>(static_cast<const float*>(s) + scales);
  return {w + b * a.row_bytes * kNB, sb};
}

template <int64_t F, typename Fn>
inline void for_group(const ScaledArgs& a, Block blk, int64_t g, Fn&& f) {
  if constexpr (F == kFmtFp4) {
    group_fp4(a, blk.w, static_cast<const uint8_t*>(blk.s), g, f);
  } else {
    group_fp8<F>(a, blk.w, static_cast<const float*>(blk.s), g, f);
  }
}

// The multipliers of column block blk's decoded values in scale group g (columns 0-7,
// 8-15): fp8 its scales (times 2^unit by the caller where they fold), fp4 2^(e - 127).
template <int64_t F>
inline void group_scales(Block blk, int64_t g, __m256 (&sv)[2]) {
  if constexpr (F == kFmtFp4) {
    fp4_scales(static_cast<const uint8_t*>(blk.s), g, sv);
  } else {
    const float* s = static_cast<const float*>(blk.s) + g * kNB;
    sv[0] = _mm256_loadu_ps(s);
    sv[1] = _mm256_loadu_ps(s + 8);
  }
}

template <int R, int C>
inline void fma_block(const float* x, int64_t K, int64_t k, int c, __m256 wl, __m256 wh,
                      __m256 (&acc)[R][C][2]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
    acc[r][c][0] = _mm256_fmadd_ps(xb, wl, acc[r][c][0]);
    acc[r][c][1] = _mm256_fmadd_ps(xb, wh, acc[r][c][1]);
  }
}

// One fp4 scale group of C blocks, the blocks interleaved per byte row (2 k each).
template <int R, int C>
inline void tile_group_fp4(const ScaledArgs& a, const Block (&blk)[C], int64_t g,
                           const __m256 (&sv)[C][2], const float* x, __m256 (&acc)[R][C][2]) {
  const int64_t j_end = std::min(a.row_bytes, (g + 1) * a.group / 2);
  for (int64_t j = g * a.group / 2; j < j_end; ++j) {
    const bool odd = 2 * j + 1 < a.K;  // odd K: the last byte's high nibble is padding
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m256 v[4];
      e2m1_pair(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[c].w + j * kNB)), v);
      fma_block<R, C>(x, a.K, 2 * j, c, _mm256_mul_ps(v[0], sv[c][0]),
                      _mm256_mul_ps(v[1], sv[c][1]), acc);
      if (odd)
        fma_block<R, C>(x, a.K, 2 * j + 1, c, _mm256_mul_ps(v[2], sv[c][0]),
                        _mm256_mul_ps(v[3], sv[c][1]), acc);
    }
  }
}

// One fp8 scale group of C blocks, interleaved per k; kFold: sv holds 2^unit * scale
// (group_fp8's NOTE), else the scale, with the 2^unit applied first.
template <int R, int C, int64_t F, bool kFold>
inline void tile_group_fp8(const ScaledArgs& a, const Block (&blk)[C], int64_t g,
                           const __m256 (&sv)[C][2], const float* x, __m256 (&acc)[R][C][2]) {
  const __m256 u = unit<F>();
  const int64_t k_end = std::min(a.K, (g + 1) * a.group);
  for (int64_t k = g * a.group; k < k_end; ++k) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m256 vl, vh;
      e4m3x16<F>(blk[c].w + k * kNB, vl, vh);
      if constexpr (!kFold) {
        vl = _mm256_mul_ps(vl, u);
        vh = _mm256_mul_ps(vh, u);
      }
      fma_block<R, C>(x, a.K, k, c, _mm256_mul_ps(vl, sv[c][0]), _mm256_mul_ps(vh, sv[c][1]),
                      acc);
    }
  }
}

// Up to kTileRows rows x C column blocks (b0..b0+C-1): the weights decoded in registers,
// the blocks interleaved so that R * C * 2 FMA chains are in flight (one block at one
// row would wait on the FMA latency), accumulators kept in registers.
template <int R, int C, int64_t F>
void scaled_tile(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t m0,
                 int64_t b0) {
  Block blk[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) blk[c] = block_of<F>(a, w, s, b0 + c);
  __m256 acc[R][C][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const float* x = a.x + m0 * a.K;
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 sv[C][2];
    bool fold = true;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      group_scales<F>(blk[c], g, sv[c]);
      if constexpr (F != kFmtFp4)
        fold = fold && scale_folds<F>(sv[c][0]) && scale_folds<F>(sv[c][1]);
    }
    if constexpr (F == kFmtFp4) {
      tile_group_fp4<R, C>(a, blk, g, sv, x, acc);
    } else if (fold) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) sv[c][h] = _mm256_mul_ps(sv[c][h], unit<F>());
      tile_group_fp8<R, C, F, true>(a, blk, g, sv, x, acc);
    } else {
      tile_group_fp8<R, C, F, false>(a, blk, g, sv, x, acc);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    __m256 one[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      one[r][0] = acc[r][c][0];
      one[r][1] = acc[r][c][1];
    }
    store_block<R>(one, a.bias, a.out, a.N, m0, (b0 + c) * kNB);
  }
}

// R rows over one decoded group (wbuf: [n][16] from k0), accumulators in acc_rows
// ([R][16], loaded and stored back: exact, so the chain over k is unchanged).
template <int R>
void tile_from_buffer(const ScaledArgs& a, const float* wbuf, int64_t k0, int64_t n,
                      int64_t m0, float* acc_rows) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(acc_rows + r * kNB);
    acc[r][1] = _mm256_loadu_ps(acc_rows + r * kNB + 8);
  }
  const float* x = a.x + m0 * a.K;
  for (int64_t i = 0; i < n; ++i) {
    const __m256 wl = _mm256_loadu_ps(wbuf + i * kNB), wh = _mm256_loadu_ps(wbuf + i * kNB + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * a.K + k0 + i);
      acc[r][0] = _mm256_fmadd_ps(xb, wl, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, wh, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc_rows + r * kNB, acc[r][0]);
    _mm256_storeu_ps(acc_rows + r * kNB + 8, acc[r][1]);
  }
}

template <int R>
void final_tile(const ScaledArgs& a, const float* acc_rows, int64_t m0, int64_t b) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(acc_rows + r * kNB);
    acc[r][1] = _mm256_loadu_ps(acc_rows + r * kNB + 8);
  }
  store_block<R>(acc, a.bias, a.out, a.N, m0, b * kNB);
}

constexpr int kBufferRows = 6;  // rows per tile over a decoded group: 12 accumulators

// More than kTileRows rows: each scale group of the block is decoded once into wbuf and
// every row tile multiplies from it (the decode is not repeated per tile); the same
// products and the same FMA chain per output as scaled_tile.
template <int64_t F>
void scaled_block_buffered(const ScaledArgs& a, Block blk, int64_t b, float* wbuf,
                           float* accbuf) {
  std::fill(accbuf, accbuf + a.M * kNB, 0.0f);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group;
    int64_t n = 0;
    for_group<F>(a, blk, g, [&](int64_t k, __m256 wl, __m256 wh) {
      _mm256_storeu_ps(wbuf + (k - k0) * kNB, wl);
      _mm256_storeu_ps(wbuf + (k - k0) * kNB + 8, wh);
      n = k - k0 + 1;
    });
    for_row_tiles<kBufferRows>(a.M, [&](auto r, int64_t m0) {
      tile_from_buffer<decltype(r)::value>(a, wbuf, k0, n, m0, accbuf + m0 * kNB);
    });
  }
  for_row_tiles<kBufferRows>(a.M, [&](auto r, int64_t m0) {
    final_tile<decltype(r)::value>(a, accbuf + m0 * kNB, m0, b);
  });
}

// Column blocks b0..b1-1 of rows 0..R-1 (R <= kTileRows): C blocks per tile, enough
// for >= 8 FMA chains where the registers allow (as linear.cpp's cols_for_rows).
template <int R, int64_t F>
void scaled_blocks(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b0,
                   int64_t b1) {
  constexpr int C = R == 1 ? 4 : (R == 2 ? 2 : 1);
  int64_t b = b0;
  for (; b + C <= b1; b += C) scaled_tile<R, C, F>(a, w, s, 0, b);
  for (; b < b1; ++b) scaled_tile<R, 1, F>(a, w, s, 0, b);
}

template <int64_t F>
void scaled_few_rows(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b0,
                     int64_t b1) {
  switch (a.M) {
    case 1: return scaled_blocks<1, F>(a, w, s, b0, b1);
    case 2: return scaled_blocks<2, F>(a, w, s, b0, b1);
    case 3: return scaled_blocks<3, F>(a, w, s, b0, b1);
    default: return scaled_blocks<4, F>(a, w, s, b0, b1);
  }
}

template <int64_t F>
void scaled_driver(const ScaledArgs& a, const uint8_t* w, const void* s) {
  const int64_t nblk = (a.N + kNB - 1) / kNB;
  const int64_t per_block = std::max<int64_t>(1, a.M * a.K * kNB);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  // NOTE: parallel over output blocks only (never over K): the split changes no bit.
  at::parallel_for(0, nblk, grain, [&](int64_t lo, int64_t hi) {
    if (a.M <= kTileRows) return scaled_few_rows<F>(a, w, s, lo, hi);
    std::vector<float> wbuf(static_cast<size_t>(a.group * kNB));
    std::vector<float> accbuf(static_cast<size_t>(a.M * kNB));
    for (int64_t b = lo; b < hi; ++b)
      scaled_block_buffered<F>(a, block_of<F>(a, w, s, b), b, wbuf.data(), accbuf.data());
  });
}

// Denormals read as zero (MXCSR.DAZ, e.g. torch.set_flush_denormal(True)) would zero the
// e4m3 subnormals that e4m3x8_single leaves as fp32 subnormals: fp8 then takes the fp16
// decode, which F16C widens exactly regardless.
inline bool denormals_are_zero() { return (_mm_getcsr() & (1u << 6)) != 0; }

}  // namespace

at::Tensor scaled_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale,
                         int64_t n_out, int64_t fmt, int64_t group,
                         const std::optional<at::Tensor>& bias_in, int64_t isa) {
  TORCH_CHECK(fmt == kFmtFp8 || fmt == kFmtFp4 || fmt == kFmtFp8Finite,
              "scaled_linear: unknown format ", fmt);
  TORCH_CHECK(isa >= 0 && isa <= 2, "scaled_linear: unknown isa ", isa);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "scaled_linear: x must be a 2-D float32 tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const bool fp4 = fmt == kFmtFp4;
  const int64_t row_bytes = fp4 ? (K + 1) / 2 : K;
  TORCH_CHECK(group >= 1 && (!fp4 || group % 2 == 0), "scaled_linear: bad scale group ", group);
  const int64_t groups = (K + group - 1) / group;
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) == row_bytes && w.size(2) == kNB,
              "scaled_linear: w must be [nblk, ", row_bytes, ", 16] uint8 for K = ", K);
  TORCH_CHECK(n_out > (w.size(0) - 1) * kNB && n_out <= w.size(0) * kNB,
              "scaled_linear: out_features inconsistent with the packed weight");
  TORCH_CHECK(scale.dim() == 3 && scale.is_contiguous() && scale.size(0) == w.size(0) &&
                  scale.size(1) == groups && scale.size(2) == kNB &&
                  scale.scalar_type() == (fp4 ? at::kByte : at::kFloat),
              "scaled_linear: scale must be [nblk, ", groups, ", 16] ",
              fp4 ? "uint8" : "float32");
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == n_out,
                "scaled_linear: bias must be float32 [N]");
  }
  at::Tensor out = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return out;
  const ScaledArgs a{x.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                     out.data_ptr<float>(), M, K, n_out, group, groups, row_bytes};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const void* sp = fp4 ? static_cast<const void*>(scale.data_ptr<uint8_t>())
                       : static_cast<const void*>(scale.data_ptr<float>());
  if (isa >= 1) {  // 1: AVX-512 F + BW (linear.cpp's kIsaAvx512); 2: and VBMI
    scaled_linear_avx512(a, wp, sp, fp4, isa == 2);
    return out;
  }
  if (fp4)
    scaled_driver<kFmtFp4>(a, wp, sp);
  else if (fmt == kFmtFp8Finite && !denormals_are_zero())
    scaled_driver<kFmtFp8Finite>(a, wp, sp);
  else
    scaled_driver<kFmtFp8>(a, wp, sp);
  return out;
}

}  // namespace laneserve
