// Hyper-connections (DeepSeek V4): the per-token mixing around each attention / FFN
// sublayer, one fused pass per token instead of ~100 small torch ops (the Sinkhorn loop
// alone is ~80 per call). Formulas: laneserve/model/deepseek_v4/ops.py's module notes.
//
// hyper_pre:  streams [T, N, H] -> post [T, N], comb [T, N, N] (fp32), collapsed [T, H]
// hyper_post: streams, out [T, H], post, comb -> new streams [T, N, H]
// All arithmetic is fp32 with the unfused mul / add of torch's formulas, in torch's op
// order; reductions (the RMS, the mixing dot products) use one fixed 8-lane order, so a
// token's result depends only on that token.

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <vector>

namespace laneserve {
namespace {

struct PreArgs {
  int64_t n, h, m;  // streams, hidden size, mixing outputs ((2 + n) n)
  const float* fn;  // [m, n h]
  const float* base;
  float s_pre, s_post, s_comb;
  int64_t iters;
  float eps, rms_eps;
};

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline float dot(const float* a, const float* b, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

// comb [n, n]: softmax over each row (+ eps), then column sums to 1, then iters - 1
// rounds of rows and columns (the order of the torch formula).
void sinkhorn(float* c, int64_t n, int64_t iters, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = c + i * n;
    float mx = row[0];
    for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] / sum + eps;
  }
  auto columns = [&] {
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) sum += c[i * n + j];
      for (int64_t i = 0; i < n; ++i) c[i * n + j] /= sum + eps;
    }
  };
  columns();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += c[i * n + j];
      for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sum + eps;
    }
    columns();
  }
}

template <typename T>
void pre_token(const T* x, const PreArgs& a, float* buf, float* mix, float* pre, float* post,
               float* comb, T* collapsed) {
  const int64_t k = a.n * a.h;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 v = load8(x + i);
    _mm256_storeu_ps(buf + i, v);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(k) + a.rms_eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < k; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_loadu_ps(buf + i), rv));
  for (int64_t j = 0; j < a.m; ++j) mix[j] = dot(buf, a.fn + j * k, k);
  for (int64_t i = 0; i < a.n; ++i) {
    pre[i] = sigmoid(mix[i] * a.s_pre + a.base[i]) + a.eps;
    post[i] = 2.0f * sigmoid(mix[a.n + i] * a.s_post + a.base[a.n + i]);
  }
  for (int64_t i = 0; i < a.n * a.n; ++i)
    comb[i] = mix[2 * a.n + i] * a.s_comb + a.base[2 * a.n + i];
  sinkhorn(comb, a.n, a.iters, a.eps);
  for (int64_t c = 0; c < a.h; c += 8) {
    __m256 s = _mm256_mul_ps(_mm256_set1_ps(pre[0]), load8(x + c));
    for (int64_t i = 1; i < a.n; ++i)
      s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_set1_ps(pre[i]), load8(x + i * a.h + c)));
    store8(collapsed + c, s);
  }
}

// new_i = post_i * out + sum_j comb[j, i] * stream_j
template <typename T, typename U, typename R>
void post_token(const T* x, const U* out, const float* post, const float* comb, int64_t n,
                int64_t h, R* y) {
  for (int64_t i = 0; i < n; ++i) {
    const __m256 p = _mm256_set1_ps(post[i]);
    for (int64_t c = 0; c < h; c += 8) {
      __m256 mixed = _mm256_mul_ps(_mm256_set1_ps(comb[i]), load8(x + c));
      for (int64_t j = 1; j < n; ++j)
        mixed = _mm256_add_ps(
            mixed, _mm256_mul_ps(_mm256_set1_ps(comb[j * n + i]), load8(x + j * h + c)));
      store8(y + i * h + c, _mm256_add_ps(_mm256_mul_ps(p, load8(out + c)), mixed));
    }
  }
}

void check_streams(const at::Tensor& s, const char* op) {
  TORCH_CHECK(s.dim() == 3 && s.is_contiguous(), op, ": streams must be contiguous [T, N, H]");
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16, op,
              ": streams must be float32 or bfloat16");
  TORCH_CHECK(s.size(2) % 8 == 0, op, ": H must be a multiple of 8");
}

void check_f32(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be contiguous float32");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> hyper_pre(const at::Tensor& streams,
                                                          const at::Tensor& fn,
                                                          const at::Tensor& base,
                                                          const at::Tensor& scale, int64_t iters,
                                                          double eps, double rms_eps) {
  check_streams(streams, "hyper_pre");
  for (const auto* t : {&fn, &base, &scale}) check_f32(*t, "hyper_pre", "fn / base / scale");
  const int64_t T = streams.size(0), n = streams.size(1), h = streams.size(2);
  const int64_t m = (2 + n) * n;
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == m && fn.size(1) == n * h && base.numel() == m &&
                  scale.numel() == 3 && iters >= 1,
              "hyper_pre: fn [(2 + N) N, N H], base [(2 + N) N], scale [3], iters >= 1");
  const float* sc = scale.data_ptr<float>();
  const PreArgs a{n,     h,     m,      fn.data_ptr<float>(), base.data_ptr<float>(),
                  sc[0], sc[1], sc[2],  iters,                static_cast<float>(eps),
                  static_cast<float>(rms_eps)};
  at::Tensor post = at::empty({T, n}, streams.options().dtype(at::kFloat));
  at::Tensor comb = at::empty({T, n, n}, streams.options().dtype(at::kFloat));
  at::Tensor collapsed = at::empty({T, h}, streams.options());
  auto run = [&](auto* tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    const T_* xp = streams.data_ptr<T_>();
    T_* cp = collapsed.data_ptr<T_>();
    at::parallel_for(0, T, rows_grain(n * h * 4), [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(n * h), mix(m), pre(n);
      for (int64_t t = lo; t < hi; ++t)
        pre_token(xp + t * n * h, a, buf.data(), mix.data(), pre.data(),
                  post.data_ptr<float>() + t * n,
                  comb.data_ptr<float>() + t * n * n, cp + t * h);
    });
  };
  if (streams.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<at::BFloat16*>(nullptr));
  return {post, comb, collapsed};
}

at::Tensor hyper_post(const at::Tensor& streams, const at::Tensor& out, const at::Tensor& post,
                      const at::Tensor& comb) {
  check_streams(streams, "hyper_post");
  check_f32(post, "hyper_post", "post");
  check_f32(comb, "hyper_post", "comb");
  const int64_t T = streams.size(0), n = streams.size(1), h = streams.size(2);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == h && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "hyper_post: out must be contiguous float32 / bfloat16 [T, H]");
  TORCH_CHECK(post.numel() == T * n && comb.numel() == T * n * n,
              "hyper_post: post [T, N], comb [T, N, N]");
  const bool f32 =
      streams.scalar_type() == at::kFloat || out.scalar_type() == at::kFloat;  // torch promotion
  at::Tensor y = at::empty({T, n, h}, streams.options().dtype(f32 ? at::kFloat : at::kBFloat16));
  auto run = [&](auto* xt, auto* ot, auto* yt) {
    using X = std::remove_pointer_t<decltype(xt)>;
    using O = std::remove_pointer_t<decltype(ot)>;
    using Y = std::remove_pointer_t<decltype(yt)>;
    const X* xp = streams.data_ptr<X>();
    const O* op = out.data_ptr<O>();
    Y* yp = y.data_ptr<Y>();
    const float* pp = post.data_ptr<float>();
    const float* cp = comb.data_ptr<float>();
    at::parallel_for(0, T, rows_grain(n * h * 2), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        post_token(xp + t * n * h, op + t * h, pp + t * n, cp + t * n * n, n, h,
                   yp + t * n * h);
    });
  };
  using BF = at::BFloat16;
  const bool xf = streams.scalar_type() == at::kFloat, of = out.scalar_type() == at::kFloat;
  if (xf && of)
    run(static_cast<float*>(nullptr), static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (xf)
    run(static_cast<float*>(nullptr), static_cast<BF*>(nullptr), static_cast<float*>(nullptr));
  else if (of)
    run(static_cast<BF*>(nullptr), static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else
    run(static_cast<BF*>(nullptr), static_cast<BF*>(nullptr), static_cast<BF*>(nullptr));
  return y;
}

}  // namespace laneserve
