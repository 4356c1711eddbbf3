// AVX-512 helpers shared by the kernels that compile AVX-512 code under
// `#pragma GCC target` (the build flags stay AVX2): linear_dpbf16.cpp, quant_linear.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace laneserve {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

// Column block c of an R x C tile of accumulators -> rows 0..R-1 of `out` (row stride
// ld) at columns n0..n0+15, masked at N, plus bias[n0..] when bias is not null.
template <int R, int C>
inline void store_block(const __m512 (&acc)[R][C], int c, float* out, int64_t ld, int64_t n0,
                        int64_t N, const float* bias) {
  const int64_t valid = std::min<int64_t>(16, N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 v = bias ? _mm512_add_ps(acc[r][c], b) : acc[r][c];
    _mm512_mask_storeu_ps(out + r * ld + n0, mask, v);
  }
}

#pragma GCC pop_options

}  // namespace laneserve
