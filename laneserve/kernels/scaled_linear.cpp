// scaled_linear: y = x @ W^T (+ bias) with W kept in a checkpoint's block-scaled bytes
// (FP8 e4m3 with a scale per `group` columns of a row, or MXFP4: e2m1 pairs with a ue8m0
// exponent per 32 columns; laneserve/kernels/scaled.py). AVX2 + FMA + F16C only: the
// same code runs on AVX-512 / AMX machines (whose fp32 `linear` chain is the same too).
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

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#include <type_traits>
#include <vector>

namespace laneserve {
namespace {

constexpr int64_t kFmtFp8 = 0;
constexpr int64_t kFmtFp4 = 1;
constexpr int kTileRows = 4;  // rows per tile: 8 accumulators + decoded weights in 16 ymm
// (more rows: each scale group is decoded once per column block into a buffer that every
// row tile reads, scaled_block_buffered)

struct Tables {
  alignas(32) float e8m0[256];  // ue8m0 byte -> 2^(byte - 127) (NaN for 0xff)
  alignas(32) float e2m1[8];    // fp4 magnitude code -> value
};

Tables make_tables() {
  Tables t{};
  for (int b = 0; b < 256; ++b)
    t.e8m0[b] = b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, b - 127);
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int i = 0; i < 8; ++i) t.e2m1[i] = mags[i];
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

struct ScaledArgs {
  const float* x;     // [M, K]
  const float* bias;  // [N] or nullptr
  float* out;         // [M, N]
  int64_t M, K, N, group, groups, row_bytes;
};

// 16 bytes -> two vectors of their 32-bit zero-extended values (columns 0-7, 8-15).
inline void widen16(__m128i bytes, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepu8_epi32(bytes);
  hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
}

// 16 e4m3 bytes -> their values, without a table: each byte's sign, 4-bit exponent field
// and 3-bit mantissa placed in an fp16 (sign << 15 | exponent << 10 | mantissa << 7), an
// fp16 worth 2^-8 times the e4m3 value (fp16's wider exponent keeps e4m3 subnormals,
// m * 2^-9, as fp16 subnormals), widened exactly by F16C and times 2^8 (exact). NaN bytes
// (0x7f / 0xff) become the fp16 NaN 0xffff.
inline void e4m3x16(__m128i bytes, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepu8_epi16(bytes);
  const __m256i low7 = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
  const __m256i nan = _mm256_cmpeq_epi16(low7, _mm256_set1_epi16(0x7F));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i h = _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16(low7, 7), sign), nan);
  const __m256 two8 = _mm256_set1_ps(256.0f);
  lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), two8);
  hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), two8);
}

// e2m1 codes (0..15 per lane) -> values: magnitude by table, the code's bit 3 the sign.
inline __m256 e2m1(__m256i code, __m256 mags) {
  const __m256 mag = _mm256_permutevar8x32_ps(mags, code);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

template <int R>
inline void fma_rows(const float* x, int64_t K, int64_t k, __m256 wl, __m256 wh,
                     __m256 (&acc)[R][2]) {
  for (int r = 0; r < R; ++r) {
    const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
    acc[r][0] = _mm256_fmadd_ps(xb, wl, acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(xb, wh, acc[r][1]);
  }
}

// Calls f(k, w_lo, w_hi) for each k of scale group g of one column block, with the 16
// weights of row k decoded to value * scale (columns 0-7, 8-15), k ascending.
template <typename F>
inline void group_fp8(const ScaledArgs& a, const uint8_t* w, const float* s, int64_t g, F&& f) {
  const __m256 s_lo = _mm256_loadu_ps(s + g * kNB), s_hi = _mm256_loadu_ps(s + g * kNB + 8);
  const int64_t k_end = std::min(a.K, (g + 1) * a.group);
  for (int64_t k = g * a.group; k < k_end; ++k) {
    __m256 vl, vh;
    e4m3x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kNB)), vl, vh);
    f(k, _mm256_mul_ps(vl, s_lo), _mm256_mul_ps(vh, s_hi));
  }
}

template <typename F>
inline void group_fp4(const ScaledArgs& a, const uint8_t* w, const uint8_t* s, int64_t g,
                      F&& f) {
  const __m256 mags = _mm256_load_ps(tables().e2m1);
  const float* e8m0 = tables().e8m0;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256i si_lo, si_hi;
  widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kNB)), si_lo, si_hi);
  const __m256 s_lo = _mm256_i32gather_ps(e8m0, si_lo, 4);
  const __m256 s_hi = _mm256_i32gather_ps(e8m0, si_hi, 4);
  const int64_t j_end = std::min(a.row_bytes, (g + 1) * a.group / 2);
  for (int64_t j = g * a.group / 2; j < j_end; ++j) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * kNB));
    for (int half = 0; half < 2; ++half) {
      const int64_t k = 2 * j + half;
      if (k >= a.K) break;  // odd K: the last byte's high nibble is padding
      const __m128i codes = _mm_and_si128(half ? _mm_srli_epi16(bytes, 4) : bytes, low4);
      __m256i lo, hi;
      widen16(codes, lo, hi);
      f(k, _mm256_mul_ps(e2m1(lo, mags), s_lo), _mm256_mul_ps(e2m1(hi, mags), s_hi));
    }
  }
}

// Column block b's values and scales.
struct Block {
  const uint8_t* w;
  const void* s;
};

inline Block block_of(const ScaledArgs& a, const uint8_t* w, const void* s, bool fp4,
                      int64_t b) {
  const int64_t scales = b * a.groups * kNB;
  const void* sb = fp4 ? static_cast<const void*>(static_cast<const uint8_t*>(s) + scales)
                       : static_cast<const void*>(static_cast<const float*>(s) + scales);
  return {w + b * a.row_bytes * kNB, sb};
}

template <bool kFp4, typename F>
inline void for_group(const ScaledArgs& a, Block blk, int64_t g, F&& f) {
  if constexpr (kFp4) {
    group_fp4(a, blk.w, static_cast<const uint8_t*>(blk.s), g, f);
  } else {
    group_fp8(a, blk.w, static_cast<const float*>(blk.s), g, f);
  }
}

// acc (+ bias) -> out rows m0..m0+R-1, the block's valid columns.
template <int R>
void store_tile(const ScaledArgs& a, __m256 (&acc)[R][2], int64_t m0, int64_t b) {
  const int64_t n0 = b * kNB;
  const int64_t valid = std::min<int64_t>(kNB, a.N - n0);
  alignas(32) float bias_buf[kNB] = {0};
  if (a.bias != nullptr) std::memcpy(bias_buf, a.bias + n0, sizeof(float) * valid);
  const __m256 b_lo = _mm256_load_ps(bias_buf), b_hi = _mm256_load_ps(bias_buf + 8);
  for (int r = 0; r < R; ++r) {
    alignas(32) float buf[kNB];
    _mm256_store_ps(buf, a.bias ? _mm256_add_ps(acc[r][0], b_lo) : acc[r][0]);
    _mm256_store_ps(buf + 8, a.bias ? _mm256_add_ps(acc[r][1], b_hi) : acc[r][1]);
    std::memcpy(a.out + (m0 + r) * a.N + n0, buf, sizeof(float) * valid);
  }
}

// Up to kTileRows rows: the weights decoded in registers, accumulators kept there.
template <int R, bool kFp4>
void scaled_tile(const ScaledArgs& a, Block blk, int64_t m0, int64_t b) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* x = a.x + m0 * a.K;
  for (int64_t g = 0; g < a.groups; ++g)
    for_group<kFp4>(a, blk, g, [&](int64_t k, __m256 wl, __m256 wh) {
      fma_rows<R>(x, a.K, k, wl, wh, acc);
    });
  store_tile<R>(a, acc, m0, b);
}

// R rows over one decoded group (wbuf: [n][16] from k0), accumulators in acc_rows
// ([R][16], loaded and stored back: exact, so the chain over k is unchanged).
template <int R>
void tile_from_buffer(const ScaledArgs& a, const float* wbuf, int64_t k0, int64_t n,
                      int64_t m0, float* acc_rows) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(acc_rows + r * kNB);
    acc[r][1] = _mm256_loadu_ps(acc_rows + r * kNB + 8);
  }
  const float* x = a.x + m0 * a.K;
  for (int64_t i = 0; i < n; ++i)
    fma_rows<R>(x, a.K, k0 + i, _mm256_loadu_ps(wbuf + i * kNB),
                _mm256_loadu_ps(wbuf + i * kNB + 8), acc);
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc_rows + r * kNB, acc[r][0]);
    _mm256_storeu_ps(acc_rows + r * kNB + 8, acc[r][1]);
  }
}

template <int R>
void final_tile(const ScaledArgs& a, const float* acc_rows, int64_t m0, int64_t b) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(acc_rows + r * kNB);
    acc[r][1] = _mm256_loadu_ps(acc_rows + r * kNB + 8);
  }
  store_tile<R>(a, acc, m0, b);
}

// More than kTileRows rows: each scale group of the block is decoded once into wbuf and
// every row tile multiplies from it (the decode is not repeated per tile); the same
// products and the same FMA chain per output as scaled_tile.
template <bool kFp4>
void scaled_block_buffered(const ScaledArgs& a, Block blk, int64_t b, float* wbuf,
                           float* accbuf) {
  std::fill(accbuf, accbuf + a.M * kNB, 0.0f);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group;
    int64_t n = 0;
    for_group<kFp4>(a, blk, g, [&](int64_t k, __m256 wl, __m256 wh) {
      _mm256_storeu_ps(wbuf + (k - k0) * kNB, wl);
      _mm256_storeu_ps(wbuf + (k - k0) * kNB + 8, wh);
      n = k - k0 + 1;
    });
    for (int64_t m0 = 0; m0 < a.M; m0 += kTileRows) {
      float* rows = accbuf + m0 * kNB;
      switch (std::min<int64_t>(kTileRows, a.M - m0)) {
        case 1: tile_from_buffer<1>(a, wbuf, k0, n, m0, rows); break;
        case 2: tile_from_buffer<2>(a, wbuf, k0, n, m0, rows); break;
        case 3: tile_from_buffer<3>(a, wbuf, k0, n, m0, rows); break;
        default: tile_from_buffer<4>(a, wbuf, k0, n, m0, rows); break;
      }
    }
  }
  for (int64_t m0 = 0; m0 < a.M; m0 += kTileRows) {
    const float* rows = accbuf + m0 * kNB;
    switch (std::min<int64_t>(kTileRows, a.M - m0)) {
      case 1: final_tile<1>(a, rows, m0, b); break;
      case 2: final_tile<2>(a, rows, m0, b); break;
      case 3: final_tile<3>(a, rows, m0, b); break;
      default: final_tile<4>(a, rows, m0, b); break;
    }
  }
}

template <bool kFp4>
void scaled_block(const ScaledArgs& a, Block blk, int64_t b) {
  switch (a.M) {
    case 1: return scaled_tile<1, kFp4>(a, blk, 0, b);
    case 2: return scaled_tile<2, kFp4>(a, blk, 0, b);
    case 3: return scaled_tile<3, kFp4>(a, blk, 0, b);
    default: return scaled_tile<4, kFp4>(a, blk, 0, b);
  }
}

template <bool kFp4>
void scaled_driver(const ScaledArgs& a, const uint8_t* w, const void* s) {
  const int64_t nblk = (a.N + kNB - 1) / kNB;
  const int64_t per_block = std::max<int64_t>(1, a.M * a.K * kNB);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  // NOTE: parallel over output blocks only (never over K): the split changes no bit.
  at::parallel_for(0, nblk, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> wbuf, accbuf;
    if (a.M > kTileRows) {
      wbuf.resize(static_cast<size_t>(a.group * kNB));
      accbuf.resize(static_cast<size_t>(a.M * kNB));
    }
    for (int64_t b = lo; b < hi; ++b) {
      const Block blk = block_of(a, w, s, kFp4, b);
      if (a.M > kTileRows)
        scaled_block_buffered<kFp4>(a, blk, b, wbuf.data(), accbuf.data());
      else
        scaled_block<kFp4>(a, blk, b);
    }
  });
}

}  // namespace

at::Tensor scaled_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale,
                         int64_t n_out, int64_t fmt, int64_t group,
                         const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(fmt == kFmtFp8 || fmt == kFmtFp4, "scaled_linear: unknown format ", fmt);
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
  if (fp4)
    scaled_driver<true>(a, wp, scale.data_ptr<uint8_t>());
  else
    scaled_driver<false>(a, wp, scale.data_ptr<float>());
  return out;
}

}  // namespace laneserve
