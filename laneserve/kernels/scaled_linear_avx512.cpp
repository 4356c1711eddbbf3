// scaled_linear's AVX-512 (F + BW) variant: y = x @ W^T (+ bias) with W in a checkpoint's
// block-scaled bytes (FP8 e4m3 or MXFP4, the layout of scaled_tiles.h / scaled.py), 16
// columns (one column block) per zmm. The entry point and the AVX2 variant are in
// scaled_linear.cpp; the caller picks by `isa`.
//
// Decode (per 16 columns of one k): fp8 where the CPU has AVX-512 VBMI (isa 2) by byte
// permutes, an e4m3 value being exact in bf16 (the VBMI section below); else as the AVX2
// variant does it, the byte placed in an fp16 worth 2^-8 times its e4m3 value and
// widened exactly (vcvtph2ps), two k per 512-bit integer step. fp4 by one vpermps of a
// 16-entry fp32 table (its index is the code's nibble: vpermps reads the low 4 bits of
// each lane, so the low nibble needs no mask); ue8m0 scales built from their bits
// (2^(e - 127); e = 0 the subnormal 2^-127, e = 255 NaN), the AVX2 variant's table values.
//
// NOTE (exactness, batch invariance): as in scaled_linear.cpp, each weight is
// value * scale rounded once (fp8 through fp16: h * (2^8 * s) where 2^8 * s is exact,
// else (h * 2^8) * s, the same real product), then each output is one FMA chain over
// k = 0..K-1 from 0, then + bias: the fp32 `linear` chain on the dequantized weight, so
// the bits equal the AVX2 variant's and linear's, whatever M, the tile or the thread split
// (threads split output column blocks only).
//
// Tiles: up to kDirectRows rows decode the weights in registers per tile, R rows x C
// column blocks (R * C >= 8 chains in flight, within the 32 zmm). More rows: each column
// pair's weights are decoded once per chunk of kChunkK k into a buffer (L1) that row
// tiles of up to kBufferRows rows read, their accumulators kept between chunks in an
// [M][C][16] buffer (loaded and stored back exactly: the chain is unchanged).

#include "ops.h"
#include "scaled_tiles.h"
#include "vec.h"
#include "vec512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace laneserve {
namespace {

template <int N>
using Count = std::integral_constant<int, N>;

// How a call decodes its weights (scaled_range's D).
constexpr int kFp8 = 0;      // e4m3 through fp16 (AVX-512 F + BW)
constexpr int kFp8Vbmi = 1;  // e4m3 by byte permutes (+ VBMI)
constexpr int kFp4 = 2;      // e2m1 by vpermps

constexpr int kDirectRows = 8;      // rows decoded in registers per tile
constexpr int kBufferRows = 12;     // rows per tile reading the decoded buffer (x 2 blocks)
constexpr int kBufferCols = 2;      // column blocks per decoded buffer
constexpr int64_t kChunkK = 128;    // k per decoded buffer (even: fp4 pairs stay whole)
constexpr int64_t kPrefetch = 1024;  // bytes ahead in each column block's stream

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

// Rows 0..R-1 of the tile: acc[r][c] += x[r][k] * w (k ascending per accumulator).
template <int R, int C>
inline void fma_rows(const float* x, int64_t K, int64_t k, int c, __m512 w,
                     __m512 (&acc)[R][C]) {
  for (int r = 0; r < R; ++r)
    acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r][c]);
}

// 32 e4m3 bytes (16 columns of k, then of k + 1) -> 2^-8 times their values (the AVX2
// variant's e4m3x16, 512 bits at a time); NaN bytes (0x7f / 0xff) -> the fp16 NaN 0xffff.
inline void e4m3x32(__m256i bytes, __m512& h0, __m512& h1) {
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  const __m512i low7 = _mm512_set1_epi16(0x7F);
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, low7), low7);
  const __m512i placed = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 1);
  const __m512i h = _mm512_mask_mov_epi16(
      _mm512_and_si512(placed, _mm512_set1_epi16(static_cast<int16_t>(0xBF80))), nan,
      _mm512_set1_epi16(-1));
  h0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  h1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Only k's 16 bytes (the last k of a range): the upper half zero, its decode unused.
inline __m256i load16(const uint8_t* p) {
  return _mm256_inserti128_si256(_mm256_setzero_si256(),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), 0);
}

// The fp8 weight from its decoded h: h * (2^8 * s) when kFold (mul = 2^8 * s), else
// (h * 2^8) * s (mul = s); see the NOTE.
template <bool kFold>
inline __m512 fp8_weight(__m512 h, __m512 mul) {
  if constexpr (kFold) return _mm512_mul_ps(h, mul);
  return _mm512_mul_ps(_mm512_mul_ps(h, _mm512_set1_ps(256.0f)), mul);
}

// 2^8 * s exact for every lane: no finite |s| above 2^119.
inline bool scale_folds(__m512 s) {
  const __m512 mag = _mm512_abs_ps(s);
  return (_mm512_cmp_ps_mask(mag, _mm512_set1_ps(0x1p119f), _CMP_GT_OQ) &
          _mm512_cmp_ps_mask(mag, _mm512_set1_ps(INFINITY), _CMP_LT_OQ)) == 0;
}

// 16 ue8m0 bytes -> 2^(e - 127) (e = 0: the subnormal 2^-127; e = 255: NaN).
inline __m512 e8m0x16(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i bits = _mm512_slli_epi32(e, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                               _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                               _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

// e2m1 code -> value (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
inline __m512 e2m1_table() {
  return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f,
                        -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
}

// 16 fp4 bytes (16 columns; k = 2j in the low nibbles, 2j + 1 in the high ones) -> the
// exact values of k = 2j (v0) and 2j + 1 (v1).
inline void e2m1x32(const uint8_t* p, __m512 tab, __m512& v0, __m512& v1) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v0 = _mm512_permutexvar_ps(b, tab);
  v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
}

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + off), _MM_HINT_T0);
}

// The packed values of column block b (row_bytes x 16) and its scales (groups x 16).
inline const uint8_t* block_values(const ScaledArgs& a, const uint8_t* w, int64_t b) {
  return w + b * a.row_bytes * kNB;
}

template <bool kFp4>
inline const uint8_t* group_scales(const ScaledArgs& a, const void* s, int64_t b, int64_t g) {
  const int64_t off = (b * a.groups + g) * kNB * (kFp4 ? 1 : 4);
  return static_cast<const uint8_t*>(s) + off;
}

// Column block b's fp8 scales of group g.
inline __m512 fp8_scales(const ScaledArgs& a, const void* s, int64_t b, int64_t g) {
  return _mm512_loadu_ps(reinterpret_cast<const float*>(group_scales<false>(a, s, b, g)));
}

// ---- rows decoded in registers (M <= kDirectRows) ----

// k in [k0, k1) of one fp8 scale group for C blocks, interleaved per pair of k.
template <int R, int C, bool kFold>
inline void direct_fp8(const ScaledArgs& a, const uint8_t* const (&wb)[C], const __m512 (&mul)[C],
                       int64_t k0, int64_t k1, const float* x, __m512 (&acc)[R][C]) {
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    for (int c = 0; c < C; ++c) {
      __m512 h0, h1;
      e4m3x32(load32(wb[c] + k * kNB), h0, h1);
      fma_rows<R, C>(x, a.K, k, c, fp8_weight<kFold>(h0, mul[c]), acc);
      fma_rows<R, C>(x, a.K, k + 1, c, fp8_weight<kFold>(h1, mul[c]), acc);
    }
  }
  if (k < k1) {
    for (int c = 0; c < C; ++c) {
      __m512 h0, h1;
      e4m3x32(load16(wb[c] + k * kNB), h0, h1);
      fma_rows<R, C>(x, a.K, k, c, fp8_weight<kFold>(h0, mul[c]), acc);
    }
  }
}

// Byte rows j in [j0, j1) (k = 2j, 2j + 1) of one fp4 scale group for C blocks; an odd
// K's last byte holds only k = K - 1 (its high nibble is padding).
template <int R, int C>
inline void direct_fp4(const ScaledArgs& a, const uint8_t* const (&wb)[C], const __m512 (&mul)[C],
                       int64_t j0, int64_t j1, const float* x, __m512 (&acc)[R][C]) {
  const __m512 tab = e2m1_table();
  const int64_t pairs_end = std::min(j1, a.K / 2);
  for (int64_t j = j0; j < pairs_end; ++j) {
    for (int c = 0; c < C; ++c) {
      __m512 v0, v1;
      e2m1x32(wb[c] + j * kNB, tab, v0, v1);
      fma_rows<R, C>(x, a.K, 2 * j, c, _mm512_mul_ps(v0, mul[c]), acc);
      fma_rows<R, C>(x, a.K, 2 * j + 1, c, _mm512_mul_ps(v1, mul[c]), acc);
    }
  }
  if (pairs_end < j1) {
    for (int c = 0; c < C; ++c) {
      __m512 v0, v1;
      e2m1x32(wb[c] + pairs_end * kNB, tab, v0, v1);
      fma_rows<R, C>(x, a.K, 2 * pairs_end, c, _mm512_mul_ps(v0, mul[c]), acc);
    }
  }
}

// Rows 0..R-1 x column blocks b0..b0+C-1, accumulators in registers throughout.
template <int R, int C, bool kFp4>
void direct_tile(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b0) {
  const uint8_t* wb[C];
  for (int c = 0; c < C; ++c) wb[c] = block_values(a, w, b0 + c);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 mul[C];
    if constexpr (kFp4) {
      const int64_t j0 = g * a.group / 2, j1 = std::min(a.row_bytes, (g + 1) * a.group / 2);
      for (int c = 0; c < C; ++c) {
        mul[c] = e8m0x16(group_scales<true>(a, s, b0 + c, g));
        prefetch(wb[c] + j0 * kNB, (j1 - j0) * kNB);
      }
      direct_fp4<R, C>(a, wb, mul, j0, j1, a.x, acc);
      continue;
    }
    const int64_t k0 = g * a.group, k1 = std::min(a.K, (g + 1) * a.group);
    bool fold = true;
    for (int c = 0; c < C; ++c) {
      mul[c] = fp8_scales(a, s, b0 + c, g);
      fold = fold && scale_folds(mul[c]);
      prefetch(wb[c] + k0 * kNB, (k1 - k0) * kNB);
    }
    if (fold) {
      for (int c = 0; c < C; ++c) mul[c] = _mm512_mul_ps(mul[c], _mm512_set1_ps(256.0f));
      direct_fp8<R, C, true>(a, wb, mul, k0, k1, a.x, acc);
    } else {
      direct_fp8<R, C, false>(a, wb, mul, k0, k1, a.x, acc);
    }
  }
  for (int c = 0; c < C; ++c) store_block<R, C>(acc, c, a.out, a.N, (b0 + c) * kNB, a.N, a.bias);
}

// ---- rows multiplied from a decoded buffer (M > kDirectRows) ----

// Block b's weights of k in [k0, k1) -> buf[(k - k0) * stride ...+16] (value * scale).
template <bool kFp4>
void decode_block(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b, int64_t k0,
                  int64_t k1, float* buf, int64_t stride) {
  const uint8_t* wb = block_values(a, w, b);
  for (int64_t g = k0 / a.group; g * a.group < k1; ++g) {
    const int64_t kb = std::max(k0, g * a.group), ke = std::min(k1, (g + 1) * a.group);
    if constexpr (kFp4) {  // kb even (k0 and the group are)
      const __m512 tab = e2m1_table(), mul = e8m0x16(group_scales<true>(a, s, b, g));
      for (int64_t k = kb; k < ke; k += 2) {
        __m512 v0, v1;
        e2m1x32(wb + k / 2 * kNB, tab, v0, v1);
        _mm512_storeu_ps(buf + (k - k0) * stride, _mm512_mul_ps(v0, mul));
        if (k + 1 < ke) _mm512_storeu_ps(buf + (k + 1 - k0) * stride, _mm512_mul_ps(v1, mul));
      }
      continue;
    }
    __m512 mul = fp8_scales(a, s, b, g);
    const bool fold = scale_folds(mul);
    if (fold) mul = _mm512_mul_ps(mul, _mm512_set1_ps(256.0f));
    for (int64_t k = kb; k < ke; k += 2) {
      __m512 h0, h1;
      e4m3x32(k + 1 < ke ? load32(wb + k * kNB) : load16(wb + k * kNB), h0, h1);
      _mm512_storeu_ps(buf + (k - k0) * stride,
                       fold ? fp8_weight<true>(h0, mul) : fp8_weight<false>(h0, mul));
      if (k + 1 < ke)
        _mm512_storeu_ps(buf + (k + 1 - k0) * stride,
                         fold ? fp8_weight<true>(h1, mul) : fp8_weight<false>(h1, mul));
    }
  }
}

#pragma GCC pop_options

// ---- fp8 by VBMI byte permutes (the CPU has avx512vbmi; isa 2) ----
// An e4m3 value is exact in bf16 (8 exponent bits hold its subnormals as normals), so
// its fp32 is the two bf16 bytes of its magnitude, looked up in two 128-byte tables (one
// vpermt2b each for 64 bytes: 4 k x 16 columns; the index's bit 7, the sign, is ignored),
// the sign or-ed in, then each k's 16 columns moved into the fp32 lanes' top bytes by one
// more vpermt2b (the two low bytes zeroed by its mask). NaN bytes find a NaN in the table.
// The weight is then value * scale, one multiply (no 2^8 to fold).

// Bytes of the bf16 (= fp32 bits 16..31) of each e4m3 magnitude 0..127, and the
// permutes placing k = i's 16 columns (bytes 16i..16i+15 of the lo / hi vectors).
struct alignas(64) E4m3Bytes {
  uint8_t hi[128], lo[128];
  uint8_t place[4][64];
};

E4m3Bytes make_e4m3_bytes() {
  E4m3Bytes t{};
  for (int m = 0; m < 128; ++m) {
    const int e = m >> 3, f = m & 7;
    const float v = m == 0x7F  ? std::numeric_limits<float>::quiet_NaN()
                    : e == 0 ? std::ldexp(static_cast<float>(f), -9)
                             : std::ldexp(1.0f + f / 8.0f, e - 7);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    t.hi[m] = static_cast<uint8_t>(bits >> 24);
    t.lo[m] = static_cast<uint8_t>(bits >> 16);
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 16; ++c) {
      t.place[i][4 * c + 2] = static_cast<uint8_t>(16 * i + c);       // lo vector
      t.place[i][4 * c + 3] = static_cast<uint8_t>(64 + 16 * i + c);  // hi vector
    }
  return t;
}

const E4m3Bytes& e4m3_bytes() {
  static const E4m3Bytes t = make_e4m3_bytes();
  return t;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vbmi")

struct E4m3Regs {
  __m512i hi0, hi1, lo0, lo1, place[4];
};

inline E4m3Regs e4m3_regs() {
  const E4m3Bytes& t = e4m3_bytes();
  E4m3Regs r;
  r.hi0 = _mm512_load_si512(t.hi);
  r.hi1 = _mm512_load_si512(t.hi + 64);
  r.lo0 = _mm512_load_si512(t.lo);
  r.lo1 = _mm512_load_si512(t.lo + 64);
  for (int i = 0; i < 4; ++i) r.place[i] = _mm512_load_si512(t.place[i]);
  return r;
}

// 64 e4m3 bytes (16 columns of k .. k + 3) -> their exact values, v[i] those of k + i.
inline void e4m3x64(__m512i b, const E4m3Regs& t, __m512 (&v)[4]) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
  const __m512i mag = _mm512_permutex2var_epi8(t.hi0, b, t.hi1);
  const __m512i hi = _mm512_ternarylogic_epi32(mag, b, _mm512_set1_epi8(static_cast<char>(0x80)),
                                               0xF8);  // mag | (b & 0x80)
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_castsi512_ps(
        _mm512_maskz_permutex2var_epi8(0xCCCCCCCCCCCCCCCCull, lo, t.place[i], hi));
}

// Rows k .. k + n - 1 (n <= 4) of a column block's values: a masked load below 4.
inline __m512i load_rows(const uint8_t* p, int64_t n) {
  if (n == 4) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((__mmask64{1} << (16 * n)) - 1, p);
}

// Rows 0..R-1 x column blocks b0..b0+C-1 (fp8), accumulators in registers throughout.
template <int R, int C>
void direct_tile_vbmi(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b0) {
  const E4m3Regs t = e4m3_regs();
  const uint8_t* wb[C];
  for (int c = 0; c < C; ++c) wb[c] = block_values(a, w, b0 + c);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group, k1 = std::min(a.K, (g + 1) * a.group);
    __m512 mul[C];
    for (int c = 0; c < C; ++c) {
      mul[c] = fp8_scales(a, s, b0 + c, g);
      prefetch(wb[c] + k0 * kNB, (k1 - k0) * kNB);
    }
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
      for (int c = 0; c < C; ++c) {
        __m512 v[4];
        e4m3x64(_mm512_loadu_si512(wb[c] + k * kNB), t, v);
        for (int i = 0; i < 4; ++i)
          fma_rows<R, C>(a.x, a.K, k + i, c, _mm512_mul_ps(v[i], mul[c]), acc);
      }
    }
    if (k < k1) {
      for (int c = 0; c < C; ++c) {
        __m512 v[4];
        e4m3x64(load_rows(wb[c] + k * kNB, k1 - k), t, v);
        for (int i = 0; i < k1 - k; ++i)
          fma_rows<R, C>(a.x, a.K, k + i, c, _mm512_mul_ps(v[i], mul[c]), acc);
      }
    }
  }
  for (int c = 0; c < C; ++c) store_block<R, C>(acc, c, a.out, a.N, (b0 + c) * kNB, a.N, a.bias);
}

// decode_block's fp8 by the VBMI permutes.
void decode_block_vbmi(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b,
                       int64_t k0, int64_t k1, float* buf, int64_t stride) {
  const E4m3Regs t = e4m3_regs();
  const uint8_t* wb = block_values(a, w, b);
  for (int64_t g = k0 / a.group; g * a.group < k1; ++g) {
    const int64_t kb = std::max(k0, g * a.group), ke = std::min(k1, (g + 1) * a.group);
    const __m512 mul = fp8_scales(a, s, b, g);
    for (int64_t k = kb; k < ke; k += 4) {
      const int64_t n = std::min<int64_t>(4, ke - k);
      __m512 v[4];
      e4m3x64(load_rows(wb + k * kNB, n), t, v);
      for (int i = 0; i < n; ++i)
        _mm512_storeu_ps(buf + (k + i - k0) * stride, _mm512_mul_ps(v[i], mul));
    }
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

// Column blocks per direct tile: >= 8 accumulators where the registers allow.
template <int R, int D>
constexpr int direct_cols() {
  if constexpr (D == kFp8Vbmi) return R <= 2 ? 4 : (R <= 4 ? 2 : 1);  // + 8 table registers
  return R == 1 ? 8 : (R <= 4 ? 4 : 2);
}

// tile(Count<C>{}, b) over [b, hi) with C blocks while they fit, then C / 2, ... 1.
template <int C, typename Tile>
inline void column_tiles(int64_t b, int64_t hi, Tile&& tile) {
  for (; b + C <= hi; b += C) tile(Count<C>{}, b);
  if constexpr (C > 1) column_tiles<C / 2>(b, hi, tile);
}

// Rows m0..m0+R-1 over n decoded k from k0 (buf: [n][C][16]); accumulators loaded from
// and stored back to accbuf ([M][C][16]).
template <int R, int C>
void buffered_rows(const ScaledArgs& a, const float* buf, int64_t k0, int64_t n, int64_t m0,
                   float* accbuf) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(accbuf + ((m0 + r) * C + c) * kNB);
  const float* x = a.x + m0 * a.K + k0;
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < C; ++c)
      fma_rows<R, C>(x, a.K, i, c, _mm512_loadu_ps(buf + (i * C + c) * kNB), acc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(accbuf + ((m0 + r) * C + c) * kNB, acc[r][c]);
}

template <int R, int C>
void buffered_store(const ScaledArgs& a, const float* accbuf, int64_t m0, int64_t b0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(accbuf + ((m0 + r) * C + c) * kNB);
  for (int c = 0; c < C; ++c)
    store_block<R, C>(acc, c, a.out + m0 * a.N, a.N, (b0 + c) * kNB, a.N, a.bias);
}

// f(Count<R>{}, m0) over row tiles of up to kBufferRows rows.
template <typename F>
inline void buffer_row_tiles(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += kBufferRows)
    with_rows<kBufferRows>(std::min<int64_t>(kBufferRows, M - m0),
                           [&](auto rows) { f(rows, m0); });
}

// Column blocks b0..b0+C-1 of all M rows, chunk by chunk of k.
template <int C, int D>
void buffered_blocks(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t b0,
                     float* buf, float* accbuf) {
  std::fill(accbuf, accbuf + a.M * C * kNB, 0.0f);
  for (int64_t k0 = 0; k0 < a.K; k0 += kChunkK) {
    const int64_t k1 = std::min(a.K, k0 + kChunkK);
    for (int c = 0; c < C; ++c) {
      if constexpr (D == kFp8Vbmi)
        decode_block_vbmi(a, w, s, b0 + c, k0, k1, buf + c * kNB, C * kNB);
      else
        decode_block<D == kFp4>(a, w, s, b0 + c, k0, k1, buf + c * kNB, C * kNB);
    }
    buffer_row_tiles(a.M, [&](auto rows, int64_t m0) {
      buffered_rows<decltype(rows)::value, C>(a, buf, k0, k1 - k0, m0, accbuf);
    });
  }
  buffer_row_tiles(a.M, [&](auto rows, int64_t m0) {
    buffered_store<decltype(rows)::value, C>(a, accbuf, m0, b0);
  });
}

template <int D>
void scaled_range(const ScaledArgs& a, const uint8_t* w, const void* s, int64_t lo, int64_t hi) {
  if (a.M <= kDirectRows) {
    with_rows<kDirectRows>(a.M, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      column_tiles<direct_cols<R, D>()>(lo, hi, [&](auto cols, int64_t b) {
        constexpr int C = decltype(cols)::value;
        if constexpr (D == kFp8Vbmi)
          direct_tile_vbmi<R, C>(a, w, s, b);
        else
          direct_tile<R, C, D == kFp4>(a, w, s, b);
      });
    });
    return;
  }
  std::vector<float> buf(static_cast<size_t>(kChunkK * kBufferCols * kNB));
  std::vector<float> accbuf(static_cast<size_t>(a.M * kBufferCols * kNB));
  column_tiles<kBufferCols>(lo, hi, [&](auto cols, int64_t b) {
    buffered_blocks<decltype(cols)::value, D>(a, w, s, b, buf.data(), accbuf.data());
  });
}

#pragma GCC pop_options

}  // namespace

void scaled_linear_avx512(const ScaledArgs& a, const uint8_t* w, const void* s, bool fp4,
                          bool vbmi) {
  const int64_t nblk = (a.N + kNB - 1) / kNB;
  const int64_t per_block = std::max<int64_t>(1, a.M * a.K * kNB);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  // NOTE: parallel over output blocks only (never over K): the split changes no bit.
  at::parallel_for(0, nblk, grain, [&](int64_t lo, int64_t hi) {
    if (fp4)
      scaled_range<kFp4>(a, w, s, lo, hi);
    else if (vbmi)
      scaled_range<kFp8Vbmi>(a, w, s, lo, hi);
    else
      scaled_range<kFp8>(a, w, s, lo, hi);
  });
}

}  // namespace laneserve
