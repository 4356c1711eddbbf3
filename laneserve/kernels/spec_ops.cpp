// Speculative decoding ops: greedy verification (verify_greedy), the token tree's commit
// (commit_side_rows), prompt lookup (ngram_lookup) and the draft bookkeeping of the MTP
// head (top_tokens, write_drafts). Each fuses a chain of small torch ops into one call.

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace laneserve {

// ----------------------------------------------------------------------------
// Greedy speculative verification (fused)
// ----------------------------------------------------------------------------
// Inside a decode step every small torch op costs ~10 us (the forward has just
// streamed the weights through the caches), and torch's argmax reads logits at
// ~1 GB/s; this op replaces the ~10-20 ops and the argmax passes of a greedy
// verify with one call. Same decisions as rejection_sampler (see there).

namespace {

// torch.argmax semantics: the first index of the maximum; a NaN is the maximum.
int64_t argmax_row(const float* x, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(neg_inf);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  float m = hmax(vmax);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    any_nan = any_nan || std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // unreachable for n > 0
}

}  // namespace

// logits [R * (K + 1) + R * W, V]: each row's K + 1 positions, then each row's W
// alternatives. Returns (tokens [R, K + 1] = the main rows' argmaxes with column 1
// replaced by the accepted alternative's own argmax, accepted [R], hit [R], choice [R]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_greedy(
    const at::Tensor& logits_in, const at::Tensor& drafts_in, const at::Tensor& num_valid_in,
    const at::Tensor& alternatives_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat,
              "verify_greedy: logits must be float32 [M, V]");
  TORCH_CHECK(drafts_in.dim() == 2 && drafts_in.size(1) >= 1, "verify_greedy: drafts [R, K>=1]");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor drafts = drafts_in.to(at::kLong).contiguous();
  const at::Tensor num_valid = num_valid_in.to(at::kLong).contiguous();
  const at::Tensor alts = alternatives_in.to(at::kLong).contiguous();
  const int64_t R = drafts.size(0), K = drafts.size(1), V = logits.size(1);
  TORCH_CHECK(alts.dim() == 2 && alts.size(0) == R, "verify_greedy: alternatives [R, W]");
  TORCH_CHECK(num_valid.dim() == 1 && num_valid.size(0) == R, "verify_greedy: num_valid [R]");
  const int64_t W = alts.size(1);
  TORCH_CHECK(logits.size(0) == R * (K + 1) + R * W, "verify_greedy: logits has ",
              logits.size(0), " rows, expected R * (K + 1) + R * W = ", R * (K + 1) + R * W);
  TORCH_CHECK(V > 0 || logits.size(0) == 0, "verify_greedy: empty vocabulary");
  const int64_t M = logits.size(0);
  std::vector<int64_t> am(M);
  const float* lp = logits.data_ptr<float>();
  at::parallel_for(0, M, rows_grain(V), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) am[i] = argmax_row(lp + i * V, V);
  });
  auto opts = drafts.options();
  at::Tensor tokens = at::empty({R, K + 1}, opts);
  at::Tensor accepted = at::empty({R}, opts);
  at::Tensor hit = at::zeros({R}, opts.dtype(at::kBool));
  at::Tensor choice = at::zeros({R}, opts);
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* ap = accepted.data_ptr<int64_t>();
  bool* hp = hit.data_ptr<bool>();
  int64_t* cp = choice.data_ptr<int64_t>();
  const int64_t* dp = drafts.data_ptr<int64_t>();
  const int64_t* np = num_valid.data_ptr<int64_t>();
  const int64_t* xp = alts.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    int64_t* t = tp + r * (K + 1);
    for (int64_t j = 0; j <= K; ++j) t[j] = am[r * (K + 1) + j];
    int64_t acc = 0;
    while (acc < K && acc < np[r] && dp[r * K + acc] == t[acc]) ++acc;
    if (acc == 0 && np[r] >= 1) {  // a real first draft, rejected: try the alternatives
      for (int64_t w = 0; w < W; ++w) {
        if (xp[r * W + w] == t[0]) {
          hp[r] = true;
          cp[r] = w;
          t[1] = am[R * (K + 1) + r * W + w];
          acc = 1;
          break;
        }
      }
    }
    ap[r] = acc;
  }
  return {tokens, accepted, hit, choice};
}

// ----------------------------------------------------------------------------
// Token tree: commit the accepted alternatives (fused)
// ----------------------------------------------------------------------------
// For each row with a hit, the accepted alternative becomes the request's token
// at p + 1: its K and V (every layer of the stacked caches) are copied from its
// scratch slot into the request's slot, and its hidden row replaces d1's row.
// Rows without a hit are left alone. One call instead of ~12 small torch ops.

void commit_side_rows(at::Tensor& k_stack, at::Tensor& v_stack, const at::Tensor& side_slots,
                      const at::Tensor& real_slot, const at::Tensor& hit,
                      const at::Tensor& choice, at::Tensor& hidden,
                      const at::Tensor& side_hidden, const at::Tensor& first_draft) {
  TORCH_CHECK(k_stack.dim() == 5 && k_stack.sizes() == v_stack.sizes() &&
                  k_stack.is_contiguous() && v_stack.is_contiguous() &&
                  k_stack.scalar_type() == v_stack.scalar_type(),
              "commit_side_rows: K and V stacks must be contiguous [L, blocks, bs, Hk, D] alike");
  TORCH_CHECK(side_slots.dim() == 2 && side_slots.scalar_type() == at::kLong,
              "commit_side_rows: side_slots must be int64 [R, W]");
  const int64_t R = side_slots.size(0), W = side_slots.size(1);
  for (const at::Tensor* t : {&real_slot, &choice, &first_draft})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->scalar_type() == at::kLong,
                "commit_side_rows: real_slot, choice and first_draft must be int64 [R]");
  TORCH_CHECK(hit.dim() == 1 && hit.size(0) == R && hit.scalar_type() == at::kBool,
              "commit_side_rows: hit must be bool [R]");
  TORCH_CHECK(hidden.dim() == 2 && side_hidden.dim() == 2 && hidden.size(1) == side_hidden.size(1) &&
                  hidden.scalar_type() == side_hidden.scalar_type() && hidden.stride(1) == 1 &&
                  side_hidden.stride(1) == 1 && side_hidden.size(0) == R * W,
              "commit_side_rows: hidden [T, H] and side_hidden [R * W, H] with unit column stride");
  const at::Tensor ss = side_slots.contiguous(), rs = real_slot.contiguous(),
                   hs = hit.contiguous(), cs = choice.contiguous(), fd = first_draft.contiguous();
  const int64_t L = k_stack.size(0);
  const int64_t num_slots = k_stack.size(1) * k_stack.size(2);
  const int64_t slot_bytes = k_stack.size(3) * k_stack.size(4) * k_stack.element_size();
  const int64_t layer_bytes = num_slots * slot_bytes;
  const int64_t H = hidden.size(1), row_bytes = H * hidden.element_size();
  char* kb = static_cast<char*>(k_stack.data_ptr());
  char* vb = static_cast<char*>(v_stack.data_ptr());
  char* hb = static_cast<char*>(hidden.data_ptr());
  const char* sb = static_cast<const char*>(side_hidden.data_ptr());
  const int64_t hstride = hidden.stride(0) * hidden.element_size();
  const int64_t sstride = side_hidden.stride(0) * side_hidden.element_size();
  const int64_t* slots = ss.data_ptr<int64_t>();
  const int64_t* real = rs.data_ptr<int64_t>();
  const bool* hits = hs.data_ptr<bool>();
  const int64_t* chosen = cs.data_ptr<int64_t>();
  const int64_t* rows = fd.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {  // check every row before writing any
    if (!hits[r]) continue;
    const int64_t c = chosen[r];
    TORCH_CHECK(c >= 0 && c < W, "commit_side_rows: choice ", c, " out of range");
    const int64_t src = slots[r * W + c], dst = real[r];
    TORCH_CHECK(src >= 0 && src < num_slots && dst >= 0 && dst < num_slots,
                "commit_side_rows: slot out of range");
    TORCH_CHECK(rows[r] >= 0 && rows[r] < hidden.size(0), "commit_side_rows: bad d1 row");
  }
  for (int64_t r = 0; r < R; ++r) {
    if (!hits[r]) continue;
    const int64_t c = chosen[r];
    const int64_t src = slots[r * W + c], dst = real[r];
    for (int64_t l = 0; l < L; ++l) {
      const int64_t base = l * layer_bytes;
      std::memcpy(kb + base + dst * slot_bytes, kb + base + src * slot_bytes, slot_bytes);
      std::memcpy(vb + base + dst * slot_bytes, vb + base + src * slot_bytes, slot_bytes);
    }
    std::memcpy(hb + rows[r] * hstride, sb + (r * W + c) * sstride, row_bytes);
  }
}

// ----------------------------------------------------------------------------
// Prompt lookup (n-gram drafts)
// ----------------------------------------------------------------------------
// For each row (a state slot): the row's last n tokens, n from n_max down to n_min,
// searched for their latest earlier occurrence in history[slot, :L] (one that ends
// before the suffix itself starts, so at least one known token follows it); the k
// tokens after the match are the drafts and num = min(k, L - match end), or 0 when no
// n matches. Replaces ~15 torch ops per n (unfold, compare, reductions) with a scan.

std::tuple<at::Tensor, at::Tensor> ngram_lookup(const at::Tensor& history_in,
                                                const at::Tensor& committed_in,
                                                const at::Tensor& slots_in, int64_t width,
                                                int64_t k, int64_t n_min, int64_t n_max) {
  TORCH_CHECK(history_in.dim() == 2 && history_in.scalar_type() == at::kLong,
              "ngram_lookup: history must be int64 [S, W]");
  TORCH_CHECK(k >= 1 && 1 <= n_min && n_min <= n_max, "ngram_lookup: need k >= 1 and ",
              "1 <= n_min <= n_max");
  TORCH_CHECK(1 <= width && width <= history_in.size(1), "ngram_lookup: width ", width,
              " outside [1, ", history_in.size(1), "]");
  const at::Tensor history = history_in.contiguous();
  const at::Tensor committed = committed_in.to(at::kLong).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const int64_t S = history.size(0), stride = history.size(1), R = slots.size(0);
  TORCH_CHECK(committed.dim() == 1 && committed.size(0) == S, "ngram_lookup: committed [S]");
  const int64_t* hp = history.data_ptr<int64_t>();
  const int64_t* lp = committed.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(0 <= sp[r] && sp[r] < S, "ngram_lookup: slot ", sp[r], " outside [0, ", S, ")");
    TORCH_CHECK(0 <= lp[sp[r]] && lp[sp[r]] <= width, "ngram_lookup: row length ", lp[sp[r]],
                " outside [0, width ", width, "]");
  }
  at::Tensor drafts = at::empty({R, k}, history.options());
  at::Tensor num = at::zeros({R}, history.options());
  int64_t* dp = drafts.data_ptr<int64_t>();
  int64_t* np = num.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* h = hp + sp[r] * stride;
    const int64_t L = lp[sp[r]];
    int64_t best = -1;  // index just after the match
    for (int64_t n = n_max; n >= n_min && best < 0; --n) {
      if (L < n + 1) continue;
      const int64_t* suffix = h + L - n;
      for (int64_t s = L - n - 1; s >= 0; --s) {
        if (std::equal(suffix, suffix + n, h + s)) {
          best = s + n;
          break;
        }
      }
    }
    const int64_t from = std::max<int64_t>(best, 0);  // no match: any tokens (num = 0)
    for (int64_t j = 0; j < k; ++j) dp[r * k + j] = h[std::min(from + j, width - 1)];
    if (best >= 0) np[r] = std::min(k, L - best);
  }
  return {drafts, num};
}

// ----------------------------------------------------------------------------
// Draft bookkeeping of a speculative step (MTP head)
// ----------------------------------------------------------------------------
// Two ops that replace the ~10 small torch ops around the head's draft: the best
// tokens of the draft logits (torch's argmax/topk run at ~1 GB/s here) and the write
// of the next step's drafts into the rows' state slots.

namespace {

// x ranks above y: NaN first (as torch.argmax and a descending stable sort), then the
// larger value, ties broken by the lower index.
inline bool ranks_above(float x, int64_t i, float y, int64_t j) {
  const bool xn = std::isnan(x), yn = std::isnan(y);
  if (xn != yn) return xn;
  if (!xn && x != y) return x > y;
  return i < j;
}

// The n best indices of one row, best first, into out (n <= V).
void top_row(const float* x, int64_t V, int64_t n, int64_t* out) {
  if (n == 1) {
    out[0] = argmax_row(x, V);
    return;
  }
  int64_t used = 0;  // out[0 .. used) kept sorted best first
  float worst = 0.0f;  // x[out[n - 1]] once used == n
  for (int64_t j = 0; j < V; ++j) {
    // NOTE: x[j] <= worst is false for a NaN on either side: those take the full test.
    // Columns come in increasing order, so a tie with the worst never ranks above it.
    if (used == n && (x[j] <= worst || !ranks_above(x[j], j, worst, out[n - 1]))) continue;
    int64_t pos = used < n ? used++ : n - 1;
    while (pos > 0 && ranks_above(x[j], j, x[out[pos - 1]], out[pos - 1])) {
      out[pos] = out[pos - 1];
      --pos;
    }
    out[pos] = j;
    worst = x[out[used - 1]];
  }
}

}  // namespace

// logits [N, V] float32 -> [N, n] int64: each row's n best columns, best first (ties:
// the lower column), as token ids through vocab [V] when given (a draft vocabulary).
at::Tensor top_tokens(const at::Tensor& logits_in, int64_t n,
                      const std::optional<at::Tensor>& vocab_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat,
              "top_tokens: logits must be float32 [N, V]");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(1 <= n && n <= V, "top_tokens: n = ", n, " outside [1, V = ", V, "]");
  at::Tensor vocab;
  if (vocab_in.has_value() && vocab_in->defined()) {
    vocab = vocab_in->to(at::kLong).contiguous();
    TORCH_CHECK(vocab.dim() == 1 && vocab.size(0) == V, "top_tokens: vocab must be [V]");
  }
  at::Tensor out = at::empty({N, n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t* vp = vocab.defined() ? vocab.data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, N, rows_grain(V), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      top_row(lp + i * V, V, n, op + i * n);
      if (vp)
        for (int64_t j = 0; j < n; ++j) op[i * n + j] = vp[op[i * n + j]];
    }
  });
  return out;
}

// For each row r (state slot s = slots[r]): the drafts are found[r] with num[r] of them
// where a lookup found some (num[r] > 0), else chain[r] (the head's k drafts);
// side_drafts[s, :A] are the best A of top[r] (the head's 1 + A best first tokens) that
// differ from the row's first draft. found/num and top are optional.
void write_drafts(at::Tensor& drafts, at::Tensor& num_drafts, at::Tensor& side_drafts,
                  const at::Tensor& slots_in, const at::Tensor& chain_in,
                  const std::optional<at::Tensor>& top_in,
                  const std::optional<at::Tensor>& found_in,
                  const std::optional<at::Tensor>& num_in) {
  for (const at::Tensor* t : {&drafts, &num_drafts, &side_drafts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "write_drafts: state tensors must be contiguous int64");
  TORCH_CHECK(drafts.dim() == 2 && num_drafts.dim() == 1 && side_drafts.dim() == 2 &&
                  num_drafts.size(0) == drafts.size(0) && side_drafts.size(0) == drafts.size(0),
              "write_drafts: drafts [S, K], num_drafts [S], side_drafts [S, W]");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor chain = chain_in.to(at::kLong).contiguous();
  const int64_t S = drafts.size(0), R = slots.size(0), k = chain.dim() == 2 ? chain.size(1) : 0;
  TORCH_CHECK(chain.dim() == 2 && chain.size(0) == R && 1 <= k && k <= drafts.size(1),
              "write_drafts: chain must be [R, k] with 1 <= k <= drafts.size(1)");
  const bool lookup = found_in.has_value() && found_in->defined();
  TORCH_CHECK(lookup == (num_in.has_value() && num_in->defined()),
              "write_drafts: found and num go together");
  at::Tensor found, num, top;
  if (lookup) {
    found = found_in->to(at::kLong).contiguous();
    num = num_in->to(at::kLong).contiguous();
    TORCH_CHECK(found.sizes() == chain.sizes() && num.dim() == 1 && num.size(0) == R,
                "write_drafts: found [R, k] and num [R]");
  }
  int64_t A = 0;
  if (top_in.has_value() && top_in->defined()) {
    top = top_in->to(at::kLong).contiguous();
    A = top.dim() == 2 ? top.size(1) - 1 : -1;
    TORCH_CHECK(top.dim() == 2 && top.size(0) == R && 0 <= A && A <= side_drafts.size(1),
                "write_drafts: top must be [R, 1 + A] with A <= side_drafts.size(1)");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= sp[r] && sp[r] < S, "write_drafts: slot ", sp[r], " outside [0, ", S, ")");
  const int64_t Kd = drafts.size(1), Wd = side_drafts.size(1);
  int64_t* dp = drafts.data_ptr<int64_t>();
  int64_t* np = num_drafts.data_ptr<int64_t>();
  int64_t* xp = side_drafts.data_ptr<int64_t>();
  const int64_t* cp = chain.data_ptr<int64_t>();
  const int64_t* fp = lookup ? found.data_ptr<int64_t>() : nullptr;
  const int64_t* mp = lookup ? num.data_ptr<int64_t>() : nullptr;
  const int64_t* tp = A > 0 ? top.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = sp[r];
    const bool hit = lookup && mp[r] > 0;
    const int64_t* src = (hit ? fp : cp) + r * k;
    std::copy(src, src + k, dp + s * Kd);
    np[s] = hit ? mp[r] : k;
    if (A == 0) continue;
    const int64_t* cand = tp + r * (A + 1);
    int64_t w = 0;
    for (int64_t j = 0; j <= A && w < A; ++j)
      if (cand[j] != src[0]) xp[s * Wd + w++] = cand[j];
  }
}

}  // namespace laneserve
