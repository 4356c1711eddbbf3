// Shared by the two prompt-row linear backends (linear_amx.cpp: AMX tiles;
// linear_dpbf16.cpp: AVX-512 BF16 dot products). linear_prefill (linear_amx.cpp) checks
// the arguments, computes the decode-like rows with `linear`, rounds the prompt rows to
// a zero-padded bf16 copy and hands them to one backend.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace laneserve {

struct PrefillArgs {
  const at::BFloat16* xb;  // [Mp, Kp] bf16, zero padded (Mp % 32 == 0, Kp % 32 == 0)
  const at::BFloat16* w;   // pair layout [nblk, K2, 16], K2 = K + K % 2
  const float* bias;       // [N] or nullptr
  float* out;              // [rows, N] row-major (the prefill rows of the output)
  int64_t rows, Mp, Kp, K2, N, nblk;
};

// Backend codes of linear_prefill's `method` argument.
constexpr int64_t kPrefillAmx = 0;
constexpr int64_t kPrefillDpbf16 = 1;

// linear_dpbf16.cpp: every prompt row of `a` (threads split output columns).
void prefill_dpbf16(const PrefillArgs& a);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

// The vpermw index that turns 64 B of the pair layout (k rows 2j, 2j+1 as four lanes of
// [row 2j cols 4L..4L+3, row 2j+1 cols 4L..4L+3]) into pair order [c0k0 c0k1 c1k0 ...],
// what both tdpbf16ps (AMX B tiles) and vdpbf16ps read: element t is column t/2, k
// parity t%2.
inline __m512i pair_order_index() {
  alignas(64) int16_t idx[32];
  for (int t = 0; t < 32; ++t) idx[t] = static_cast<int16_t>(8 * (t / 8) + 4 * (t % 2) + (t / 2) % 4);
  return _mm512_load_si512(idx);
}

#pragma GCC pop_options

}  // namespace laneserve
