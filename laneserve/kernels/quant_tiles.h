// What the two GGUF-weight kernels share (quant_linear.cpp: fp32 activations;
// quant_linear_q8.cpp: int8 activations): the packed record layout of each type, and how a
// call is cut into tiles and split over threads.
//
// Tiles: up to kTileRows rows x C column blocks of 16 (C picked per kernel and per row
// count, to fit its accumulators in the 32 zmm). Threads split output column blocks only,
// never K, so the split changes no bit; with more rows than one tile the blocks are walked
// in groups of 8 so that several row tiles reuse them from cache.
#pragma once

#include "vec.h"

#include <type_traits>

namespace laneserve {

enum QType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3 };
constexpr int64_t kGroupK = 32;            // k per record
constexpr int kTileRows = 6;               // rows per tile
constexpr int64_t kWeightPrefetch = 2048;  // bytes ahead in each column block's stream

// Record of 16 columns x 32 k: scales (fp16, or fp32 for q4_k), offsets where the type has
// them, then the quants (bytes for q8_0, nibbles otherwise).
constexpr int64_t scale_bytes(int64_t q) { return q == kQ4_K ? 4 : 2; }
constexpr bool has_offset(int64_t q) { return q == kQ4_1 || q == kQ4_K; }
constexpr int64_t quant_bytes(int64_t q) { return q == kQ8_0 ? kGroupK * kNB : kGroupK * kNB / 2; }
constexpr int64_t record_bytes(int64_t q) {
  return (has_offset(q) ? 2 : 1) * scale_bytes(q) * kNB + quant_bytes(q);
}

// One quant_linear call: y[M, N] = x[M, K] @ W^T (+ bias), W as [nblk, G = K/32, record].
struct QuantArgs {
  const float* x;     // [M, K]
  const uint8_t* w;   // [nblk, G, record]
  const float* bias;  // [N] or nullptr
  float* out;         // [M, N]
  int64_t M, K, N, G, record;
};

// The AVX2 (+FMA, F16C) variant of quant_linear (quant_linear_avx2.cpp): same layout, bits.
void quant_linear_avx2(const QuantArgs& a, int64_t qtype);

template <int N>
using Count = std::integral_constant<int, N>;
template <int64_t Q>
using Type = std::integral_constant<int64_t, Q>;

// run(Type<Q>{}) for the type code qtype (checked by the caller).
template <typename Run>
inline void dispatch_qtype(int64_t qtype, Run&& run) {
  switch (qtype) {
    case kQ4_0: run(Type<kQ4_0>{}); break;
    case kQ4_1: run(Type<kQ4_1>{}); break;
    case kQ8_0: run(Type<kQ8_0>{}); break;
    default: run(Type<kQ4_K>{}); break;
  }
}

// blocks(Count<C>{}, b) for column blocks b .. b+C-1 while C fit in [b0, b1), then
// blocks(Count<1>{}, b) for the rest.
template <int C, typename Blocks>
inline void for_column_blocks(int64_t b0, int64_t b1, Blocks&& blocks) {
  int64_t b = b0;
  for (; b + C <= b1; b += C) blocks(Count<C>{}, b);
  for (; b < b1; ++b) blocks(Count<1>{}, b);
}

// range(lo, hi) over the column blocks of 16 of an [M, K] x [K, N] product, split over
// threads with at least min_work multiply-adds per task (tiny problems stay on one
// thread), in groups of 8 blocks when M is more than one row tile.
template <typename Range>
inline void parallel_over_blocks(int64_t M, int64_t K, int64_t N, int64_t min_work,
                                 Range&& range) {
  const int64_t nblk = (N + kNB - 1) / kNB;
  const int64_t per_block = std::max<int64_t>(1, M * K * kNB);
  const int64_t grain = std::max<int64_t>(1, min_work / per_block);
  at::parallel_for(0, nblk, grain, [&](int64_t lo, int64_t hi) {
    const int64_t step = M <= kTileRows ? hi - lo : 8;
    for (int64_t g = lo; g < hi; g += step) range(g, std::min(g + step, hi));
  });
}

}  // namespace laneserve
