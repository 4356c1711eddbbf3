// causal_attention_bf16: attention of a long prompt chunk of n queries over nk >= n keys
// (its context, then its own: query i sits at position nk - n + i), for CPUs with
// avx512_bf16. Blocked, flash style: a tile of kRows queries of one head walks the keys in
// tiles of 64; Q K^T and P V are `vdpbf16ps` dot products (two bf16 products added into
// each fp32 lane), softmax is an fp32 online softmax per query.
//
// Numerics: q, k, v and the probabilities p are rounded to bf16 (what a bf16 KV cache
// stores anyway), every sum is fp32; the result differs from the fp32 paged kernel's in
// rounding, so only prompt rows come here (docs/kernels.md lists which rows take which
// path). A query's arithmetic depends only on its own row, its head's keys and the fixed
// key tiling (0, 64, 128, ...), never on the thread split.
//
// Layouts built once per call (bf16, zero padded to whole key tiles):
//   kp [Hk][nk/16][Dk/2][16 keys][2]: a 64 B row holds 16 keys x one (d, d+1) pair;
//   vp [Hk][nk/2][Dv][2]: a 64 B row holds 16 columns d x one (key, key+1) pair;
//   qb [n][Hq][Dk] with Dk even: the (d, d+1) pair of a query is one 32-bit broadcast.

#include "ops.h"
#include "vec.h"

#include <atomic>

namespace laneserve {
namespace {

constexpr int kKV = 4;               // 16-key score vectors per query and tile
constexpr int64_t kKeys = 16 * kKV;  // keys per tile
constexpr int kRows = 4;             // queries per tile
constexpr int64_t kMaxDv = 256;      // per-query accumulator lives on the stack
constexpr int kDvChunk = 4;          // 16-column zmm accumulators per query in P V

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

// exp for 16 fp32 lanes: exp256's Cephes polynomial and constants (vec.h) for finite and
// -inf inputs (-> 0); scores are never NaN or +inf here. Not built from two exp256 halves:
// that made the whole op ~30 % slower on Zen 4.
inline __m512 exp512(__m512 x) {
  namespace ce = cephes_exp;
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(ce::kLow), _CMP_LT_OQ);
  __m512 v = _mm512_min_ps(x, _mm512_set1_ps(ce::kClamp));
  v = _mm512_max_ps(v, _mm512_set1_ps(ce::kLow));
  __m512 fx = _mm512_fmadd_ps(v, _mm512_set1_ps(ce::kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  v = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ce::kLn2Hi), v);
  v = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ce::kLn2Lo), v);
  const __m512 z = _mm512_mul_ps(v, v);
  __m512 y = _mm512_set1_ps(ce::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(ce::kPoly[i]));
  y = _mm512_fmadd_ps(y, z, v);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
}

struct CausalArgs {
  const at::BFloat16* qb;  // [n, Hq, Dk]
  const at::BFloat16* kp;  // [Hk, tiles16, Dk/2, 16, 2]
  const at::BFloat16* vp;  // [Hk, pairs, Dv, 2]
  float* out;              // [n, Hq, Dv]
  int64_t n, context, Hq, Hk, Dk, Dv, tiles16, pairs;  // query i sits at context + i
  float scale;
};

// Scores of queries rows[0..kRows) against keys kt*kKeys .. +kKeys-1 (unscaled).
struct TileScores {
  __m512 s[kRows][kKV];
};

inline TileScores tile_scores(const CausalArgs& a, int64_t h, int64_t kv, const int64_t* rows,
                              int64_t kt) {
  __m512 s[kRows][kKV];  // NOTE: a local, so that it stays in registers
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kKV; ++c) s[r][c] = _mm512_setzero_ps();
  const int64_t dk2 = a.Dk / 2;
  const at::BFloat16* k0 = a.kp + ((kv * a.tiles16 + kKV * kt) * dk2) * 32;
  const int32_t* q[kRows];
  for (int r = 0; r < kRows; ++r)
    q[r] = reinterpret_cast<const int32_t*>(a.qb + (rows[r] * a.Hq + h) * a.Dk);
  for (int64_t j = 0; j < dk2; ++j) {
    __m512bh w[kKV];
    for (int c = 0; c < kKV; ++c) w[c] = (__m512bh)_mm512_loadu_si512(k0 + (c * dk2 + j) * 32);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(q[r][j]);
      for (int c = 0; c < kKV; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], x, w[c]);
    }
  }
  TileScores t;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kKV; ++c) t.s[r][c] = s[r][c];
  return t;
}

// P V of one key tile for the 16-column zmms c0 .. c0 + NC - 1.
template <int NC>
inline void tile_pv_cols(const at::BFloat16* v0, int64_t Dv, int64_t c0,
                         const int32_t (*p)[kKeys / 2], float (*acc)[kMaxDv]) {
  __m512 o[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = _mm512_loadu_ps(acc[r] + c0 + 16 * c);
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    const at::BFloat16* vj = v0 + (j * Dv + c0) * 2;
    __m512bh w[NC];
    for (int c = 0; c < NC; ++c) w[c] = (__m512bh)_mm512_loadu_si512(vj + 32 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(p[r][j]);
      for (int c = 0; c < NC; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], x, w[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc[r] + c0 + 16 * c, o[r][c]);
}

// P V for one key tile: acc[r][0..Dv) += sum_k p[r][k] v[k][..], p as bf16 pairs.
inline void tile_pv(const CausalArgs& a, int64_t kv, int64_t kt, const int32_t (*p)[kKeys / 2],
                    float (*acc)[kMaxDv]) {
  const at::BFloat16* v0 = a.vp + (kv * a.pairs + kt * (kKeys / 2)) * a.Dv * 2;
  int64_t c0 = 0;
  for (; c0 + 16 * kDvChunk <= a.Dv; c0 += 16 * kDvChunk)
    tile_pv_cols<kDvChunk>(v0, a.Dv, c0, p, acc);
  switch ((a.Dv - c0) / 16) {
    case 3: tile_pv_cols<3>(v0, a.Dv, c0, p, acc); break;
    case 2: tile_pv_cols<2>(v0, a.Dv, c0, p, acc); break;
    case 1: tile_pv_cols<1>(v0, a.Dv, c0, p, acc); break;
    default: break;
  }
}

inline void scale_row(float* x, int64_t n, float f) {
  for (int64_t d = 0; d < n; d += 16)
    _mm512_storeu_ps(x + d, _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_set1_ps(f)));
}

// Queries q0..q0+kRows-1 (clamped at n-1; only valid rows are stored) of head h; query i
// attends keys 0 .. context + i.
void attend_rows(const CausalArgs& a, int64_t h, int64_t q0) {
  const int64_t kv = h / (a.Hq / a.Hk);
  int64_t rows[kRows];
  for (int r = 0; r < kRows; ++r) rows[r] = std::min(q0 + r, a.n - 1);
  alignas(64) float acc[kRows][kMaxDv];
  alignas(64) int32_t p[kRows][kKeys / 2];
  float m[kRows];
  __m512 l[kRows];  // per-lane sums, added up once at the end
  for (int r = 0; r < kRows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = _mm512_setzero_ps();
    std::fill(acc[r], acc[r] + a.Dv, 0.0f);
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t last = a.context + rows[kRows - 1];
  for (int64_t kt = 0; kt * kKeys <= last; ++kt) {
    const TileScores t = tile_scores(a, h, kv, rows, kt);
    const auto& s = t.s;
    const __m512i key0 =
        _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(kt * kKeys)));
    for (int r = 0; r < kRows; ++r) {
      const __m512i pos = _mm512_set1_epi32(static_cast<int>(a.context + rows[r]));
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512 x[kKV];
      __m512 mx = ninf;
      for (int c = 0; c < kKV; ++c) {
        // NOTE: keys after the query (and the zero padding past n) never count.
        const __m512i key = _mm512_add_epi32(key0, _mm512_set1_epi32(16 * c));
        const __mmask16 seen = _mm512_cmple_epi32_mask(key, pos);
        x[c] = _mm512_mask_mul_ps(ninf, seen, s[r][c], scale);
        mx = _mm512_max_ps(mx, x[c]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 pr[kKV], sum = _mm512_setzero_ps();
      for (int c = 0; c < kKV; ++c) {
        pr[c] = exp512(_mm512_sub_ps(x[c], mv));
        sum = _mm512_add_ps(sum, pr[c]);
      }
      const float alpha =
          m[r] == m_new ? 1.0f : _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[r] - m_new)));
      l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha), sum);
      m[r] = m_new;
      if (alpha != 1.0f) scale_row(acc[r], a.Dv, alpha);
      for (int c = 0; c < kKV; c += 2)
        _mm512_store_si512(p[r] + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(pr[c + 1], pr[c]));
    }
    tile_pv(a, kv, kt, p, acc);
  }
  for (int r = 0; r < kRows && q0 + r < a.n; ++r) {
    float* o = a.out + ((q0 + r) * a.Hq + h) * a.Dv;
    scale_row(acc[r], a.Dv, 1.0f / _mm512_reduce_add_ps(l[r]));
    std::copy(acc[r], acc[r] + a.Dv, o);
  }
}

#pragma GCC pop_options

// src [n, H, D] bf16 -> dst (`size` elements, zero where no key lands): element
// (key, h, d) goes to dst[at(key, h, d)]. One pass per (key, h) row, rows split over threads.
template <typename At>
void pack(const at::Tensor& src_in, at::BFloat16* dst, int64_t size, At at) {
  const at::Tensor src = src_in.to(at::kBFloat16).contiguous();
  const int64_t n = src.size(0), H = src.size(1), D = src.size(2);
  std::fill(dst, dst + size, at::BFloat16(0.0f));
  const at::BFloat16* x = src.data_ptr<at::BFloat16>();
  at::parallel_for(0, n * H, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t d = 0; d < D; ++d) dst[at(i / H, i % H, d)] = x[i * D + d];
  });
}

}  // namespace

at::Tensor causal_attention_bf16(const at::Tensor& q_in, const at::Tensor& k_in,
                                 const at::Tensor& v_in, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "causal_attention_bf16: needs avx512_bf16");
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3,
              "causal_attention_bf16: q, k, v must be [n, heads, head_dim]");
  const int64_t n = q_in.size(0), Hq = q_in.size(1), Dk = q_in.size(2);
  const int64_t nk = k_in.size(0), Hk = k_in.size(1), Dv = v_in.size(2);
  TORCH_CHECK(nk >= n && v_in.size(0) == nk && v_in.size(1) == Hk && k_in.size(2) == Dk,
              "causal_attention_bf16: q, k, v shapes do not agree");
  TORCH_CHECK(nk < (int64_t{1} << 31), "causal_attention_bf16: key positions must fit int32");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0,
              "causal_attention_bf16: q heads must be a multiple of kv heads");
  TORCH_CHECK(Dk % 2 == 0 && Dv % 16 == 0 && Dv <= kMaxDv,
              "causal_attention_bf16: head_dim must be even and v head_dim a multiple of 16 ",
              "up to ", kMaxDv);
  at::Tensor out = at::empty({n, Hq, Dv}, q_in.options().dtype(at::kFloat));
  if (n == 0) return out;
  const at::Tensor qb = q_in.to(at::kBFloat16).contiguous();
  const int64_t tiles16 = kKV * ((nk + kKeys - 1) / kKeys), pairs = tiles16 * 8;
  at::Tensor kp = at::empty({Hk * tiles16 * Dk * 16}, qb.options());
  at::Tensor vp = at::empty({Hk * pairs * Dv * 2}, qb.options());
  // kp [Hk][tiles16][Dk/2][16][2] and vp [Hk][pairs][Dv][2], as in the header comment.
  pack(k_in, kp.data_ptr<at::BFloat16>(), kp.numel(), [&](int64_t key, int64_t h, int64_t d) {
    return (((h * tiles16 + key / 16) * (Dk / 2) + d / 2) * 16 + key % 16) * 2 + d % 2;
  });
  pack(v_in, vp.data_ptr<at::BFloat16>(), vp.numel(), [&](int64_t key, int64_t h, int64_t d) {
    return ((h * pairs + key / 2) * Dv + d) * 2 + key % 2;
  });
  const CausalArgs a{qb.data_ptr<at::BFloat16>(), kp.data_ptr<at::BFloat16>(),
                     vp.data_ptr<at::BFloat16>(), out.data_ptr<float>(), n, nk - n, Hq, Hk,
                     Dk, Dv, tiles16, pairs, static_cast<float>(scale)};
  // Tasks (head, row tile) from the most keys to the fewest, taken by whichever thread is
  // free: causal rows cost in proportion to their position.
  const int64_t row_tiles = (n + kRows - 1) / kRows, tasks = row_tiles * Hq;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t tile = row_tiles - 1 - t / Hq;
      attend_rows(a, t % Hq, tile * kRows);
    }
  });
  return out;
}

}  // namespace laneserve
