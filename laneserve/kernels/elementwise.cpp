// Row-wise ops of a decoder layer: rms_norm, fused_add_rms_norm, rotary_embedding and
// silu_and_mul. Batch-invariance and fp-contraction notes: vec.h.

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <vector>

namespace laneserve {
namespace {

// ----------------------------------------------------------------------------
// RMSNorm (HF Llama semantics in fp32): y = w * (x * (1 / sqrt(mean(x^2) + eps)))
// ----------------------------------------------------------------------------

// Sum of squares of one row; fixed order (one 8-lane FMA chain, fixed tree,
// then the scalar tail), so the value depends only on the row.
inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline float inv_rms(float sum_sq, int64_t n, double eps) {
  const float var = sum_sq / static_cast<float>(n);
  return 1.0f / std::sqrt(var + static_cast<float>(eps));
}

// y = w * (x * r); same two roundings per element as HF's fp32 path.
inline void scale_row(const float* x, const float* w, float r, float* y, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), v));
  }
  for (; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, op,
              ": float32 tensors expected");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), op,
              ": weight must be [H] matching x's last dim");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm_args(x_in, w_in, "rms_norm");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(-1);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const float* xr = xp + m * H;
      scale_row(xr, wp, inv_rms(sum_squares(xr, H), H, eps), op + m * H, H);
    }
  });
  return out;
}

// residual += x; x = rms_norm(residual) (vLLM's fused_add_rms_norm, in place).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w_in, double eps) {
  check_norm_args(x, w_in, "fused_add_rms_norm");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.sizes() == x.sizes(),
              "fused_add_rms_norm: residual must match x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(),
              "fused_add_rms_norm: x and residual must be contiguous (updated in place)");
  const at::Tensor w = w_in.contiguous();
  const int64_t H = x.size(-1);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, rows, rows_grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      float* xr = xp + m * H;
      float* rr = rp + m * H;
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        _mm256_storeu_ps(rr + i, _mm256_add_ps(_mm256_loadu_ps(rr + i), _mm256_loadu_ps(xr + i)));
      for (; i < H; ++i) rr[i] = rr[i] + xr[i];
      scale_row(rr, wp, inv_rms(sum_squares(rr, H), H, eps), xr, H);
    }
  });
}

// ----------------------------------------------------------------------------
// Rotary embedding, NeoX / HF rotate_half style, in place
// ----------------------------------------------------------------------------

namespace {

// One head: x1 = x[:D/2], x2 = x[D/2:]; x1' = x1*c - x2*s, x2' = x2*c + x1*s.
// NOTE: unfused mul/mul/add exactly as HF's q*cos + rotate_half(q)*sin in fp32.
inline void rotate_head(float* x, const float* cs, int64_t half) {
  const float* c = cs;
  const float* s = cs + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * s[i];
    x[half + i] = x2 * c[i] + x1 * s[i];
  }
}

// q / k may be [T, H*D] (any row stride, unit column stride: e.g. a column
// slice of a fused qkv output) or [T, H, D] with contiguous heads.
struct HeadView {
  float* data;
  int64_t row_stride;
  int64_t heads;
};

HeadView head_view(at::Tensor& t, int64_t tokens, int64_t head_dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "rotary_embedding: ", name, " must be float32");
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "rotary_embedding: ", name, " must be 2-D or 3-D");
  TORCH_CHECK(t.size(0) == tokens, "rotary_embedding: ", name, " has wrong number of tokens");
  const int64_t width = t.dim() == 2 ? t.size(1) : t.size(1) * t.size(2);
  TORCH_CHECK(width % head_dim == 0, "rotary_embedding: ", name, " width not a multiple of D");
  const bool heads_ok = t.dim() == 2 ? (t.size(1) <= 1 || t.stride(1) == 1)
                                     : ((t.size(2) <= 1 || t.stride(2) == 1) &&
                                        (t.size(1) <= 1 || t.stride(1) == t.size(2)));
  TORCH_CHECK(heads_ok, "rotary_embedding: ", name, " must have contiguous heads in each row");
  return HeadView{t.data_ptr<float>(), t.stride(0), width / head_dim};
}

}  // namespace

void rotary_embedding(const at::Tensor& positions_in, at::Tensor& q, at::Tensor& k,
                      int64_t head_dim, const at::Tensor& cache_in) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cache_in.dim() == 2 && cache_in.size(1) == head_dim &&
                  cache_in.scalar_type() == at::kFloat,
              "rotary_embedding: cos_sin_cache must be float32 [max_pos, head_dim]");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor cache = cache_in.contiguous();
  const int64_t T = positions.numel();
  const HeadView qv = head_view(q, T, head_dim, "q");
  const HeadView kv = head_view(k, T, head_dim, "k");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cache.data_ptr<float>();
  const int64_t max_pos = cache.size(0);
  const int64_t half = head_dim / 2;
  at::parallel_for(0, T, rows_grain((qv.heads + kv.heads) * head_dim * 4),
                   [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position out of range");
      const float* row = cs + pos[t] * head_dim;
      for (int64_t h = 0; h < qv.heads; ++h)
        rotate_head(qv.data + t * qv.row_stride + h * head_dim, row, half);
      for (int64_t h = 0; h < kv.heads; ++h)
        rotate_head(kv.data + t * kv.row_stride + h * head_dim, row, half);
    }
  });
}

// ----------------------------------------------------------------------------
// silu_and_mul: y = silu(x[:, :I]) * x[:, I:]; with a limit L (DeepSeek V4's clamped
// SwiGLU): y = silu(min(x[:, :I], L)) * clamp(x[:, I:], -L, L)
// ----------------------------------------------------------------------------

namespace {

inline __m256 silu_mul8(__m256 a, __m256 b) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
  return _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), b);
}

// min / max with the limit first: a NaN input comes through, as torch's clamp lets it.
struct Clamp {
  bool on;
  __m256 hi, lo;
  __m256 gate(__m256 a) const { return on ? _mm256_min_ps(hi, a) : a; }
  __m256 up(__m256 b) const { return on ? _mm256_max_ps(lo, _mm256_min_ps(hi, b)) : b; }
};

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x_in, std::optional<double> limit) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) % 2 == 0,
              "silu_and_mul: float32 [..., 2I] expected");
  const at::Tensor x = x_in.contiguous();
  const int64_t I = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = I == 0 ? 0 : x.numel() / (2 * I);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float lim = static_cast<float>(limit.value_or(0.0));
  const Clamp c{limit.has_value(), _mm256_set1_ps(lim), _mm256_set1_ps(-lim)};
  auto f = [&](__m256 a, __m256 b) { return silu_mul8(c.gate(a), c.up(b)); };
  at::parallel_for(0, rows, rows_grain(I * 8), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const float* a = xp + m * 2 * I;
      const float* b = a + I;
      float* y = op + m * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
      if (i < I) {  // tail through the same vector formula (padded)
        alignas(32) float ta[8] = {0}, tb[8] = {0}, ty[8];
        std::memcpy(ta, a + i, sizeof(float) * (I - i));
        std::memcpy(tb, b + i, sizeof(float) * (I - i));
        _mm256_store_ps(ty, f(_mm256_load_ps(ta), _mm256_load_ps(tb)));
        std::memcpy(y + i, ty, sizeof(float) * (I - i));
      }
    }
  });
  return out;
}

}  // namespace laneserve
