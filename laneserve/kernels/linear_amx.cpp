// linear_prefill: the compute-bound linear for prompt (prefill) rows. Rows
// [0, first_prefill) are the decode-like rows and go through `linear` (linear.cpp)
// unchanged; rows [first_prefill, M) are rounded to bf16 and multiplied by one of two
// backends (`method`): AMX tile dot products (tdpbf16ps, fp32 accumulation; this file)
// on CPUs with amx_tile + amx_bf16, or AVX-512 BF16 dot products (linear_dpbf16.cpp).
//
// NOTE (row invariance, AMX backend): each prefill output element is the tdpbf16ps
// chain over k-chunks of 32 (k = 0..31, 32..63, ...) starting from zero, then + bias.
// Rows of an A tile never mix, M is padded with zero rows and K with zero columns, and threads split
// output columns only, so a row's result does not depend on how many rows the call has,
// which other rows are in it, or the thread split. It does differ from `linear`'s
// fp32-activation result (x is rounded to bf16), so decode-like rows never come here.
//
// Weights: the AVX-512 bf16 pair layout of pack_linear_weight ([nblk, K + K % 2, 16],
// each 64 B holding k rows 2j, 2j+1 as four lanes of [row 2j cols 4L..4L+3, row 2j+1
// cols 4L..4L+3]). AMX wants each 64 B B-tile row as [c0k0 c0k1 c1k0 c1k1 ...] (VNNI), so
// each thread repacks one 32-column panel at a time into a small scratch (one vpermw per
// 64 B) and reuses it across all row tiles: no second copy of the weights is kept.

#include "linear_prefill.h"
#include "ops.h"
#include "vec.h"

#include <sys/syscall.h>
#include <unistd.h>


namespace laneserve {
namespace {

constexpr int64_t kChunk = 32;     // k values per tile dot product (64 B of bf16)
constexpr int64_t kTileRows = 16;  // rows of an A / C tile
constexpr int64_t kMBlock = 256;   // rows per block: its bf16 activations stay in L2
constexpr int64_t kPanelCols = 32;  // two 16-column blocks: the two B tiles

// The kernel asks the OS once for the AMX tile state (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); it is granted to the whole process.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,amx-tile,amx-bf16")

// Panel p (blocks 2p, 2p+1) -> scratch [Kp/32][2][16 rows][32 bf16] in VNNI order.
void repack_panel(const PrefillArgs& a, int64_t p, at::BFloat16* scratch) {
  const __m512i perm = pair_order_index();
  const int64_t pairs = a.Kp / 2, have = a.K2 / 2;
  for (int64_t blk = 0; blk < 2; ++blk) {
    const int64_t b = 2 * p + blk;
    const at::BFloat16* src = a.w + b * a.K2 * kNB;
    for (int64_t j = 0; j < pairs; ++j) {
      __m512i v = _mm512_setzero_si512();
      if (b < a.nblk && j < have) v = _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(src + j * 32));
      // chunk j/16, B tile blk, tile row j%16
      at::BFloat16* dst = scratch + ((j / 16) * 2 + blk) * 512 + (j % 16) * 32;
      _mm512_store_si512(dst, v);
    }
  }
}

// C tiles 0..3 (rows m0..m0+31 x the panel's 32 columns) -> out, + bias.
void store_tile_rows(const PrefillArgs& a, int64_t p, int64_t m0, float* cbuf) {
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  _tile_stored(2, cbuf + 16 * 32, 128);
  _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  const int64_t rows = std::min<int64_t>(32, a.rows - m0);
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t n0 = p * kPanelCols + h * kNB;
    if (n0 >= a.N) break;
    const int64_t valid = std::min<int64_t>(kNB, a.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 b = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      __m512 v = _mm512_load_ps(cbuf + r * 32 + h * kNB);
      if (a.bias) v = _mm512_add_ps(v, b);
      _mm512_mask_storeu_ps(a.out + (m0 + r) * a.N + n0, mask, v);
    }
  }
}

// Row tiles [mb, me) x panel p; the panel is already in `scratch`.
void panel_rows(const PrefillArgs& a, int64_t p, int64_t mb, int64_t me,
                const at::BFloat16* scratch, float* cbuf) {
  const int64_t chunks = a.Kp / kChunk, stride = a.Kp * 2;
  for (int64_t m0 = mb; m0 < me; m0 += 2 * kTileRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* x0 = a.xb + m0 * a.Kp;
    const at::BFloat16* x1 = x0 + kTileRows * a.Kp;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, x0 + c * kChunk, stride);
      _tile_loadd(5, x1 + c * kChunk, stride);
      _tile_loadd(6, scratch + (c * 2) * 512, 64);
      _tile_loadd(7, scratch + (c * 2 + 1) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    store_tile_rows(a, p, m0, cbuf);
  }
}

void prefill_range(const PrefillArgs& a, int64_t p0, int64_t p1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  at::Tensor scratch_t = at::empty({a.Kp / kChunk * 2 * 512 + 32}, at::kBFloat16);
  at::BFloat16* scratch = reinterpret_cast<at::BFloat16*>(
      (reinterpret_cast<uintptr_t>(scratch_t.data_ptr<at::BFloat16>()) + 63) & ~uintptr_t{63});
  alignas(64) float cbuf[32 * 32];
  for (int64_t mb = 0; mb < a.Mp; mb += kMBlock) {
    const int64_t me = std::min(mb + kMBlock, a.Mp);
    for (int64_t p = p0; p < p1; ++p) {
      repack_panel(a, p, scratch);
      panel_rows(a, p, mb, me, scratch, cbuf);
    }
  }
  _tile_release();
}

#pragma GCC pop_options

}  // namespace

at::Tensor linear_prefill(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                          const std::optional<at::Tensor>& bias_in, int64_t first_prefill,
                          int64_t method) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "linear_prefill: x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kNB && w.is_contiguous() &&
                  w.scalar_type() == at::kBFloat16,
              "linear_prefill: w must be a bf16 weight packed for the avx512 isa");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), K2 = K + (K & 1);
  TORCH_CHECK(w.size(1) == K2, "linear_prefill: in_features mismatch: x has ", K, ", weight ",
              w.size(1));
  TORCH_CHECK(n_out > (w.size(0) - 1) * kNB && n_out <= w.size(0) * kNB,
              "linear_prefill: out_features inconsistent with the packed weight");
  TORCH_CHECK(first_prefill >= 0 && first_prefill <= M, "linear_prefill: first_prefill ",
              first_prefill, " outside [0, ", M, "]");
  TORCH_CHECK(method == kPrefillAmx || method == kPrefillDpbf16,
              "linear_prefill: unknown method ", method);
  TORCH_CHECK(method != kPrefillAmx || amx_permitted(),
              "linear_prefill: the OS refused the AMX tile state");
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == n_out,
                "linear_prefill: bias must be float32 [N]");
  }
  at::Tensor out = at::empty({M, n_out}, x.options());
  if (first_prefill > 0) {  // decode-like rows: the fp32-activation kernel, same bits
    out.narrow(0, 0, first_prefill)
        .copy_(linear(x.narrow(0, 0, first_prefill), w, n_out, bias_in, 1, std::nullopt));
  }
  const int64_t rows = M - first_prefill;
  if (rows == 0 || n_out == 0) return out;
  const int64_t Mp = (rows + 31) / 32 * 32, Kp = (K + kChunk - 1) / kChunk * kChunk;
  // RNE rounding to bf16 (torch's conversion), zero padding in both dimensions
  at::Tensor xb = at::zeros({Mp, Kp}, x.options().dtype(at::kBFloat16));
  xb.narrow(0, 0, rows).narrow(1, 0, K).copy_(x.narrow(0, first_prefill, rows));
  const int64_t nblk = w.size(0);
  const PrefillArgs a{xb.data_ptr<at::BFloat16>(),
                      w.data_ptr<at::BFloat16>(),
                      bias.defined() ? bias.data_ptr<float>() : nullptr,
                      out.data_ptr<float>() + first_prefill * n_out,
                      rows, Mp, Kp, K2, n_out, nblk};
  if (method == kPrefillDpbf16) {
    prefill_dpbf16(a);
    return out;
  }
  const int64_t panels = (nblk + 1) / 2;
  // NOTE: threads split panels (output columns) only, never K or rows' reductions.
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) { prefill_range(a, lo, hi); });
  return out;
}

}  // namespace laneserve
