// The prompt-row backend of linear_prefill for AVX-512 CPUs with avx512_bf16 but no AMX
// (AMD Zen 4 and later, Intel Cooper Lake): prompt rows rounded to bf16, multiplied with
// `vdpbf16ps`, which adds two bf16 products into each fp32 lane (32 multiply-adds per
// instruction, twice the fp32 FMA's 16).
//
// NOTE (row invariance): each output element is the vdpbf16ps chain over the k pairs
// (0,1), (2,3), ... in order from zero, then + bias. Rows never mix and threads split
// output columns only, so a row's result does not depend on M, on the other rows or on
// the thread split. It differs from `linear`'s fp32-activation result (x is rounded to
// bf16) and from the AMX backend's (another summation order), so decode-like rows never
// come here.
//
// Weights: the AVX-512 bf16 pair layout of pack_linear_weight. vdpbf16ps wants each 64 B
// as [c0k0 c0k1 c1k0 c1k1 ...]: each thread repacks a panel of four 16-column blocks at a
// time (one vpermw per 64 B) into a scratch that stays in L2, and runs every row over it.

#include "linear_prefill.h"
#include "vec.h"
#include "vec512.h"

#include <algorithm>

namespace laneserve {
namespace {

constexpr int64_t kBlocks = 4;   // 16-column blocks per panel (one accumulator each per row)
constexpr int64_t kRows = 6;     // rows per tile: 24 accumulators
constexpr int64_t kPairBytes = 64;
constexpr int64_t kMBlock = 256;  // rows per block: their bf16 activations stay in L2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

// Panel p (blocks 4p..4p+3) -> scratch [pairs][kBlocks][32 bf16], VNNI pair order.
void repack_panel(const PrefillArgs& a, int64_t p, int64_t pairs, at::BFloat16* scratch) {
  const __m512i perm = pair_order_index();
  for (int64_t blk = 0; blk < kBlocks; ++blk) {
    const int64_t b = kBlocks * p + blk;
    const at::BFloat16* src = a.w + b * a.K2 * kNB;
    for (int64_t j = 0; j < pairs; ++j) {
      __m512i v = _mm512_setzero_si512();
      if (b < a.nblk) v = _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(src + j * 32));
      _mm512_store_si512(scratch + (j * kBlocks + blk) * 32, v);
    }
  }
}

// Rows [m0, m0 + R) x panel p: one zmm accumulator per (row, block), k pairs in order.
template <int R>
void tile(const PrefillArgs& a, int64_t p, int64_t m0, int64_t pairs, const at::BFloat16* scratch) {
  __m512 acc[R][kBlocks];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlocks; ++c) acc[r][c] = _mm512_setzero_ps();
  const int32_t* x = reinterpret_cast<const int32_t*>(a.xb + m0 * a.Kp);
  const int64_t xstride = a.Kp / 2;  // int32 pairs per row
  for (int64_t j = 0; j < pairs; ++j) {
    const at::BFloat16* wj = scratch + j * kBlocks * 32;
    __m512bh w[kBlocks];
    for (int c = 0; c < kBlocks; ++c) w[c] = (__m512bh)_mm512_load_si512(wj + c * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(x[r * xstride + j]);
      for (int c = 0; c < kBlocks; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xr, w[c]);
    }
  }
  for (int c = 0; c < kBlocks; ++c) {
    const int64_t n0 = (kBlocks * p + c) * kNB;
    if (n0 >= a.N) break;
    store_block<R, kBlocks>(acc, c, a.out + m0 * a.N, a.N, n0, a.N, a.bias);
  }
}

void rows_tail(const PrefillArgs& a, int64_t p, int64_t m0, int64_t left, int64_t pairs,
               const at::BFloat16* s) {
  switch (left) {
    case 1: tile<1>(a, p, m0, pairs, s); break;
    case 2: tile<2>(a, p, m0, pairs, s); break;
    case 3: tile<3>(a, p, m0, pairs, s); break;
    case 4: tile<4>(a, p, m0, pairs, s); break;
    case 5: tile<5>(a, p, m0, pairs, s); break;
    default: break;
  }
}

void panels(const PrefillArgs& a, int64_t p0, int64_t p1) {
  const int64_t pairs = a.K2 / 2;
  at::Tensor scratch_t = at::empty({pairs * kBlocks * 32 + kPairBytes}, at::kBFloat16);
  at::BFloat16* scratch = reinterpret_cast<at::BFloat16*>(
      (reinterpret_cast<uintptr_t>(scratch_t.data_ptr<at::BFloat16>()) + 63) & ~uintptr_t{63});
  for (int64_t mb = 0; mb < a.rows; mb += kMBlock) {
    const int64_t me = std::min(mb + kMBlock, a.rows);
    for (int64_t p = p0; p < p1; ++p) {
      repack_panel(a, p, pairs, scratch);
      int64_t m0 = mb;
      for (; m0 + kRows <= me; m0 += kRows) tile<kRows>(a, p, m0, pairs, scratch);
      rows_tail(a, p, m0, me - m0, pairs, scratch);
    }
  }
}

#pragma GCC pop_options

}  // namespace

void prefill_dpbf16(const PrefillArgs& a) {
  const int64_t n_panels = (a.nblk + kBlocks - 1) / kBlocks;
  // NOTE: threads split panels (output columns) only, never K or rows' reductions.
  at::parallel_for(0, n_panels, 1, [&](int64_t lo, int64_t hi) { panels(a, lo, hi); });
}

}  // namespace laneserve
