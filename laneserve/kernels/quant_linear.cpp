// quant_linear: y[M, N] = x[M, K] @ W^T (+ bias) with W kept as GGUF-quantized blocks
// (q4_0, q4_1, q8_0, q4_k), repacked by laneserve/kernels/quant.py (`repack`). This file
// holds the AVX-512 variant and the entry point; quant_linear_avx2.cpp the AVX2 one (the
// caller picks by `isa`, as for linear). Both give the same bits (see below).
//
// Layout: [nblk = ceil(N/16), G = K/32, record]; a record covers 16 output columns and one
// 32-wide group of k: 16 scales (fp16; fp32 for q4_k), 16 offsets (q4_1, q4_k), then the
// quants (4-bit: 16 k pairs x 16 bytes, low nibble = even k; 8-bit: 32 k x 16 int8).
//
// NOTE (exactness): each weight is rebuilt in registers as s * q (+ o), one mul_ps and one
// add_ps (no contraction: -ffp-contract=off), exactly the values quant.py `dequantize`
// computes, and each output is the fp32 linear kernel's chain
//   acc = fma(x[k], w[k], acc) for k = 0..K-1 from 0, then + bias.
// So the result is bitwise linear(x, dequantize(W)) on the fp32 path, independent of M,
// of the tile shape and of the thread split (batch invariant as vec.h describes).

#include "ops.h"
#include "quant_tiles.h"
#include "vec.h"
#include "vec512.h"

#include <type_traits>

namespace laneserve {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

template <int64_t Q>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (scale_bytes(Q) == 4) return _mm512_loadu_ps(p);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The weight vector of 16 columns from their integer quants: s * q (+ o), rounded per op.
template <int64_t Q>
inline __m512 rebuild(__m512i q, __m512 s, __m512 o) {
  const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), s);
  if constexpr (has_offset(Q)) return _mm512_add_ps(w, o);
  return w;
}

// Weights of k = 2j and 2j + 1 (16 columns each) of one record.
template <int64_t Q>
inline void load_pair(const uint8_t* quants, int j, __m512 s, __m512 o, __m512& w0, __m512& w1) {
  if constexpr (Q == kQ8_0) {
    const __m128i* p = reinterpret_cast<const __m128i*>(quants + 2 * j * kNB);
    w0 = rebuild<Q>(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)), s, o);
    w1 = rebuild<Q>(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)), s, o);
  } else {
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + j * kNB)));
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    __m512i hi = _mm512_srli_epi32(v, 4);
    if constexpr (Q == kQ4_0) {  // stored as q + 8
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
    }
    w0 = rebuild<Q>(lo, s, o);
    w1 = rebuild<Q>(hi, s, o);
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
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();

  for (int64_t g = 0; g < a.G; ++g) {
    __m512 s[C], o[C];
    const uint8_t* rec[C];
    for (int c = 0; c < C; ++c) {
      rec[c] = wb + c * stride + g * kRec;
      for (int64_t off = 0; off < kRec; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec[c] + kWeightPrefetch + off), _MM_HINT_T1);
      s[c] = load_scales<Q>(rec[c]);
      o[c] = has_offset(Q) ? load_scales<Q>(rec[c] + kScaleBytes) : _mm512_setzero_ps();
    }
    const float* xg = x + g * kGroupK;
    for (int j = 0; j < kGroupK / 2; ++j) {
      __m512 w0[C], w1[C];
      for (int c = 0; c < C; ++c)
        load_pair<Q>(rec[c] + (has_offset(Q) ? 2 : 1) * kScaleBytes, j, s[c], o[c], w0[c], w1[c]);
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(xg[r * K + 2 * j]);
        const __m512 x1 = _mm512_set1_ps(xg[r * K + 2 * j + 1]);
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_fmadd_ps(x0, w0[c], acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(x1, w1[c], acc[r][c]);
        }
      }
    }
  }

  for (int c = 0; c < C; ++c)
    store_block<R, C>(acc, c, a.out + m0 * a.N, a.N, (b0 + c) * kNB, a.N, a.bias);
}

// Column blocks per tile: accumulators, scales, offsets and 2C weights within 32 zmm.
template <int R>
constexpr int quant_cols_for_rows() {
  return R <= 2 ? 4 : (R <= 4 ? 2 : 1);
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

#pragma GCC pop_options

template <int64_t Q>
void quant_driver(const QuantArgs& a) {
  // ~64k FMAs minimum per task, as linear.
  parallel_over_blocks(a.M, a.K, a.N, int64_t{1} << 16,
                       [&](int64_t lo, int64_t hi) { quant_range<Q>(a, lo, hi); });
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                        int64_t qtype, const std::optional<at::Tensor>& bias_in, int64_t isa) {
  TORCH_CHECK(qtype >= kQ4_0 && qtype <= kQ4_K, "quant_linear: unknown qtype ", qtype);
  TORCH_CHECK(isa == 0 || isa == 1, "quant_linear: unknown isa ", isa);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "quant_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: w must be a contiguous [nblk, K/32, record] uint8 tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t nblk = (n_out + kNB - 1) / kNB;
  TORCH_CHECK(K % kGroupK == 0, "quant_linear: K must be a multiple of 32, got ", K);
  const int64_t rec = record_bytes(qtype);
  TORCH_CHECK(w.size(0) == nblk && w.size(1) == K / kGroupK && w.size(2) == rec,
              "quant_linear: packed weight shape does not match K=", K, ", N=", n_out);
  const float* bias = nullptr;
  at::Tensor bias_c;
  if (bias_in.has_value()) {
    bias_c = bias_in->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == n_out,
                "quant_linear: bias must be float32 [N]");
    bias = bias_c.data_ptr<float>();
  }
  at::Tensor out = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return out;
  const QuantArgs a{x.data_ptr<float>(), w.data_ptr<uint8_t>(), bias, out.data_ptr<float>(),
                    M, K, n_out, K / kGroupK, rec};
  if (isa == 0) {  // linear.cpp's kIsaAvx2
    quant_linear_avx2(a, qtype);
    return out;
  }
  dispatch_qtype(qtype, [&](auto q) { quant_driver<decltype(q)::value>(a); });
  return out;
}

}  // namespace laneserve
