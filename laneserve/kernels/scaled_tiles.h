// What the two scaled_linear variants share (scaled_linear.cpp: the entry point and the
// AVX2 variant; scaled_linear_avx512.cpp: the AVX-512 one): the call's arguments and the
// packed layout's constants (laneserve/kernels/scaled.py repack).
#pragma once

#include <cstdint>

namespace laneserve {

constexpr int64_t kFmtFp8 = 0;  // scaled.FORMATS order
constexpr int64_t kFmtFp4 = 1;
constexpr int64_t kFmtFp8Finite = 2;  // fp8 whose bytes hold no NaN (checked when packed)

// One scaled_linear call: y[M, N] = x[M, K] @ W^T (+ bias), W as values [nblk, row_bytes,
// 16] (row_bytes = K for fp8, ceil(K / 2) for fp4) and scales [nblk, groups, 16], a scale
// per `group` k of a column.
struct ScaledArgs {
  const float* x;     // [M, K]
  const float* bias;  // [N] or nullptr
  float* out;         // [M, N]
  int64_t M, K, N, group, groups, row_bytes;
};

// The AVX-512 (F + BW) variant (scaled_linear_avx512.cpp): the same layout, the same bits.
// s: fp32 scales (fp8) or ue8m0 bytes (fp4); vbmi: decode fp8 with AVX-512 VBMI permutes.
void scaled_linear_avx512(const ScaledArgs& a, const uint8_t* w, const void* s, bool fp4,
                          bool vbmi);

}  // namespace laneserve
