// quant_linear_q8: y[M, N] = x[M, K] @ W^T (+ bias) with W kept as GGUF blocks (q4_0, q4_1,
// q8_0, q4_k) and the activations rounded to int8 per 32-wide group, multiplied with integer
// dot products (AVX-512 VNNI `vpdpbusd`: 64 byte products per instruction, four times the
// fp32 FMA's 16). This is llama.cpp's arithmetic for these types; the fp32 arithmetic of
// quant_linear.cpp stays the default. Layout and the exact torch reference:
// laneserve/kernels/q8.py.
//
// Activations, per row and group g of 32 (q8.py `quantize_rows`, the same fp32 operations):
//   amax = max |x|; non-finite amax: the group is NaN (dx = sx = NaN, q = 0);
//   amax <= 1e-30: the group is zero (dx = sx = 0, q = 0); else
//   q = round_half_even(x * (127 / amax)) in [-127, 127], dx = amax / 127, sx = dx * sum(q).
// Weights: unsigned integers u = q_w + Z (Z = 8 for q4_0, 128 for q8_0, else 0) with a scale
// s and, for q4_1 / q4_k, an offset o per 32 k (quant.py's common form).
//
// NOTE (exactness and row invariance): per output, with t_g the exact integer
// sum_k (u - Z) q over group g (vpdpbusd sums, then - Z * sum(q)),
//   acc = 0; for g in order: acc = acc + (float(t_g) * dx_g) * s_g  [+ sx_g * o_g];
//   y = acc (+ bias)
// one rounding per mul and add (-ffp-contract=off), which q8.py's reference repeats in
// torch bit for bit. A row's result depends only on that row: invariant to M, to the other
// rows, to the tile shape and to the thread split (threads split output columns only).

#include "ops.h"
#include "quant_tiles.h"
#include "vec.h"
#include "vec512.h"

#include <cfloat>
#include <cmath>
#include <cstring>

namespace laneserve {
namespace {

constexpr float kTiny = 1e-30f;     // groups with amax at or below this are zero

constexpr int32_t zero_point(int64_t q) { return q == kQ4_0 ? 8 : (q == kQ8_0 ? 128 : 0); }

struct Q8Args {
  const int8_t* q;    // [M, K] quantized activations
  const float* dx;    // [M, G] group scales
  const float* sx;    // [M, G] dx * sum(q)
  const int32_t* sq;  // [M, G] sum(q)
  const uint8_t* w;   // [nblk, G, record]
  const float* bias;  // [N] or nullptr
  float* out;         // [M, N]
  int64_t M, K, N, G;
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

// One row's group of 32: q, dx, sx, sum(q) as the header describes.
void quantize_group(const float* x, int8_t* q, float* dx, float* sx, int32_t* sq) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) |
                        _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (nan || !(amax <= FLT_MAX) || amax <= kTiny) {
    std::memset(q, 0, kGroupK);
    *dx = *sx = (nan || !(amax <= FLT_MAX)) ? NAN : 0.0f;
    *sq = 0;
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // round half to even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  *dx = amax / 127.0f;
  *sq = sum;
  *sx = *dx * static_cast<float>(sum);
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

template <int64_t Q>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (scale_bytes(Q) == 4) return _mm512_loadu_ps(p);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Integer sums of one group for R rows x C column blocks. A 4-bit record holds 4 chunks of
// 64 B: byte (c, j) of chunk i is u[4i + j][c] | u[16 + 4i + j][c] << 4; an 8-bit record
// 8 chunks with byte (c, j) of chunk i = u[4i + j][c].
template <int64_t Q, int R, int C>
inline void group_sums(const uint8_t* const (&quants)[C], const int8_t* xq, int64_t K,
                       __m512i (&isum)[R][C]) {
  if constexpr (Q == kQ8_0) {
    for (int i = 0; i < 8; ++i) {
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(quants[c] + i * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = bcast4(xq + r * K + 4 * i);
        for (int c = 0; c < C; ++c) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], w[c], xv);
      }
    }
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(quants[c] + i * 64);
        lo[c] = _mm512_and_si512(v, nib);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xl = bcast4(xq + r * K + 4 * i);
        const __m512i xh = bcast4(xq + r * K + 16 + 4 * i);
        for (int c = 0; c < C; ++c) {
          isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], lo[c], xl);
          isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], hi[c], xh);
        }
      }
    }
  }
}

// R rows x C column blocks, groups in order (header NOTE).
template <int64_t Q, int R, int C>
void q8_tile(const Q8Args& a, int64_t m0, int64_t b0) {
  constexpr int64_t kRec = record_bytes(Q);
  constexpr int64_t kScaleBytes = scale_bytes(Q) * kNB;
  constexpr int64_t kQuantOff = (has_offset(Q) ? 2 : 1) * kScaleBytes;
  const int64_t stride = a.G * kRec;  // bytes per column block
  const uint8_t* wb = a.w + b0 * stride;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();

  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* rec[C];
    const uint8_t* quants[C];
    for (int c = 0; c < C; ++c) {
      rec[c] = wb + c * stride + g * kRec;
      quants[c] = rec[c] + kQuantOff;
      for (int64_t off = 0; off < kRec; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec[c] + kWeightPrefetch + off), _MM_HINT_T1);
    }
    __m512i isum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
    group_sums<Q, R, C>(quants, a.q + m0 * a.K + g * kGroupK, a.K, isum);

    __m512 s[C], o[C];
    for (int c = 0; c < C; ++c) {
      s[c] = load_scales<Q>(rec[c]);
      o[c] = has_offset(Q) ? load_scales<Q>(rec[c] + kScaleBytes) : _mm512_setzero_ps();
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (m0 + r) * a.G + g;
      const __m512 dx = _mm512_set1_ps(a.dx[rg]);
      const __m512i zq = _mm512_set1_epi32(zero_point(Q) * a.sq[rg]);
      const __m512 sx = _mm512_set1_ps(a.sx[rg]);
      for (int c = 0; c < C; ++c) {
        __m512i t = isum[r][c];
        if constexpr (zero_point(Q) != 0) t = _mm512_sub_epi32(t, zq);
        const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(t), dx);
        acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(p, s[c]));
        if constexpr (has_offset(Q)) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(sx, o[c]));
      }
    }
  }

  for (int c = 0; c < C; ++c)
    store_block<R, C>(acc, c, a.out + m0 * a.N, a.N, (b0 + c) * kNB, a.N, a.bias);
}

// Column blocks per tile: 2RC integer and float accumulators plus 2C weight vectors.
template <int R>
constexpr int cols_for_rows() {
  return R <= 2 ? 4 : (R <= 4 ? 3 : 2);
}

template <int64_t Q>
void q8_range(const Q8Args& a, int64_t lo, int64_t hi) {
  for_row_tiles<kTileRows>(a.M, [&](auto rows, int64_t m0) {
    constexpr int R = decltype(rows)::value;
    for_column_blocks<cols_for_rows<R>()>(lo, hi, [&](auto cols, int64_t b) {
      q8_tile<Q, R, decltype(cols)::value>(a, m0, b);
    });
  });
}

#pragma GCC pop_options

template <int64_t Q>
void q8_driver(const Q8Args& a) {
  // ~256k byte products minimum per task.
  parallel_over_blocks(a.M, a.K, a.N, int64_t{1} << 18,
                       [&](int64_t lo, int64_t hi) { q8_range<Q>(a, lo, hi); });
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, float* sx,
                   int32_t* sq) {
  const int64_t G = K / kGroupK;
  // Row groups are independent; split rows only when there is enough work.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K));
  at::parallel_for(0, M, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = m * G + g;
        quantize_group(x + m * K + g * kGroupK, q + m * K + g * kGroupK, dx + i, sx + i, sq + i);
      }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "quantize_q8: x must be a 2-D float32 tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroupK == 0, "quantize_q8: K must be a multiple of 32, got ", K);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / kGroupK}, x.options());
  at::Tensor sx = at::empty({M, K / kGroupK}, x.options());
  at::Tensor sq = at::empty({M, K / kGroupK}, x.options().dtype(at::kInt));
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), dx.data_ptr<float>(),
                sx.data_ptr<float>(), sq.data_ptr<int32_t>());
  return {q, dx, sx, sq};
}

at::Tensor quant_linear_q8(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                           int64_t qtype, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(qtype >= kQ4_0 && qtype <= kQ4_K, "quant_linear_q8: unknown qtype ", qtype);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear_q8: w must be a contiguous [nblk, K/32, record] uint8 tensor");
  auto [q, dx, sx, sq] = quantize_q8(x_in);
  const int64_t M = q.size(0), K = q.size(1);
  const int64_t nblk = (n_out + kNB - 1) / kNB;
  TORCH_CHECK(w.size(0) == nblk && w.size(1) == K / kGroupK && w.size(2) == record_bytes(qtype),
              "quant_linear_q8: packed weight shape does not match K=", K, ", N=", n_out);
  const float* bias = nullptr;
  at::Tensor bias_c;
  if (bias_in.has_value()) {
    bias_c = bias_in->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == n_out,
                "quant_linear_q8: bias must be float32 [N]");
    bias = bias_c.data_ptr<float>();
  }
  at::Tensor out = at::empty({M, n_out}, x_in.options());
  if (M == 0 || n_out == 0) return out;
  const Q8Args a{q.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(),
                 sq.data_ptr<int32_t>(), w.data_ptr<uint8_t>(), bias, out.data_ptr<float>(),
                 M, K, n_out, K / kGroupK};
  dispatch_qtype(qtype, [&](auto q) { q8_driver<decltype(q)::value>(a); });
  return out;
}

}  // namespace laneserve
