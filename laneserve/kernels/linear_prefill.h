// Shared by the two prompt-row linear backends (linear_amx.cpp: AMX tiles;
// linear_dpbf16.cpp: AVX-512 BF16 dot products). linear_prefill (linear_amx.cpp) checks
// the arguments, computes the decode-like rows with `linear`, rounds the prompt rows to
// a zero-padded bf16 copy and hands them to one backend.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace laneserve
