// paged_attention: task planning, thread split and the op's entry point. The per-tile
// arithmetic (and the design notes) live in attention_tile.h.

#include "attention_tile.h"
#include "ops.h"

#include <vector>

namespace laneserve {
namespace {

// One unit of work: queries q0..q0+nq-1 (consecutive tokens of one sequence,
// increasing positions) x q heads h0..h0+nh-1.
struct AttnTask {
  int64_t seq, q0, nq, h0, nh;
};

constexpr int64_t kMaxTaskQueries = 8;
constexpr int64_t kParallelMinPairs = 512;

template <typename CT, int DV_>
void attend_task(const AttnArgs<CT>& a, const AttnTask& task, const int64_t* tok_pos,
                 bool prefetch, std::vector<HeadState<state_lanes<DV_>()>>& states) {
  constexpr int kArr = state_lanes<DV_>();
  const int dv = DV_ > 0 ? DV_ : static_cast<int>(a.D / 8);
  const int64_t G = a.Hq / a.Hk;
  const int32_t* bt = a.block_tables + task.seq * a.max_blocks;
  const int64_t last_pos = a.seq_lens[task.seq] - 1;
  const int64_t last_slot = a.last_slot ? a.last_slot[task.seq] : -1;
  const __m256 scale = _mm256_set1_ps(a.scale);
  const int64_t pos_max = tok_pos[task.q0 + task.nq - 1];

  states.resize(task.nq * task.nh);
  for (int64_t qi = 0; qi < task.nq; ++qi)
    for (int64_t i = 0; i < task.nh; ++i)
      init_head<CT>(states[qi * task.nh + i],
                    a.q + (task.q0 + qi) * a.q_stride_t + (task.h0 + i) * a.q_stride_h, dv);

  // Columns of each token row this task reads: its kv groups' slices.
  const int64_t g_lo = task.h0 / G, g_hi = (task.h0 + task.nh - 1) / G;
  const int64_t pf_col = g_lo * a.D;
  const int64_t pf_bytes =
      prefetch ? (g_hi - g_lo + 1) * a.D * static_cast<int64_t>(sizeof(CT)) : 0;

  // Row pointers of the current and the next tile (double buffered): the next
  // tile's K/V rows are prefetched while the current one is computed.
  const CT* ptr_buf[2][2][kKeyTile];
  int cur = 0;
  const auto tile_len = [](int64_t pos, int64_t key0) {
    return static_cast<int>(std::min<int64_t>(kKeyTile, pos + 1 - key0));
  };
  const int n0 = tile_len(pos_max, 0);
  tile_ptrs(a, bt, 0, n0, last_pos, last_slot, ptr_buf[0][0], ptr_buf[0][1]);
  const int pf_n0 = prefetch ? n0 : 0;
  prefetch_rows(ptr_buf[0][0], 0, pf_n0, pf_col, pf_bytes);
  prefetch_rows(ptr_buf[0][1], 0, pf_n0, pf_col, pf_bytes);
  int64_t first_q = 0;  // queries before it have pos < key0 (positions increase)
  for (int64_t key0 = 0; key0 <= pos_max; key0 += kKeyTile) {
    while (tok_pos[task.q0 + first_q] < key0) ++first_q;
    const int64_t next0 = key0 + kKeyTile;
    const int nn = next0 <= pos_max ? tile_len(pos_max, next0) : 0;
    if (nn > 0)
      tile_ptrs(a, bt, next0, nn, last_pos, last_slot, ptr_buf[cur ^ 1][0], ptr_buf[cur ^ 1][1]);
    const int pf_n = prefetch ? nn : 0;
    const int64_t steps = task.nh * (task.nq - first_q);
    int64_t step = 0;
    for (int64_t i = 0; i < task.nh; ++i) {
      const int64_t col = ((task.h0 + i) / G) * a.D;
      for (int64_t qi = first_q; qi < task.nq; ++qi, ++step) {
        const int64_t pos = tok_pos[task.q0 + qi];
        const PrefetchSlice<CT> pf{ptr_buf[cur ^ 1][0], ptr_buf[cur ^ 1][1],
                                   static_cast<int>(pf_n * step / steps),
                                   static_cast<int>(pf_n * (step + 1) / steps), pf_col, pf_bytes};
        // NOTE: n is this query's own tile length; pointer entries beyond it
        // (later keys or padding) only feed lanes that are masked to -inf.
        attend_tile<CT, DV_, kArr>(states[qi * task.nh + i], ptr_buf[cur][0], ptr_buf[cur][1],
                                   col, tile_len(pos, key0), dv, scale, pf);
      }
    }
    cur ^= 1;
  }
  for (int64_t qi = 0; qi < task.nq; ++qi)
    for (int64_t i = 0; i < task.nh; ++i)
      store_head<CT>(states[qi * task.nh + i],
                     a.out + ((task.q0 + qi) * a.Hq + task.h0 + i) * a.D, dv);
}

// Splits the batch into tasks. Heads per task: all Hq (whole token rows
// streamed once, K/V tiles shared by every head from L1), else one GQA group,
// else one head, taking the coarsest that still gives each thread >= 4 tasks
// (so 2 threads are busy at batch 1). NOTE: the split never changes results.
std::vector<AttnTask> plan_tasks(const int32_t* qs, int64_t S, int64_t Hq, int64_t Hk,
                                 int64_t threads) {
  int64_t chunks = 0;  // query chunks of <= kMaxTaskQueries
  for (int64_t s = 0; s < S; ++s)
    chunks += (qs[s + 1] - qs[s] + kMaxTaskQueries - 1) / kMaxTaskQueries;
  const int64_t G = Hq / Hk;
  int64_t per_task = 1;
  if (chunks >= 4 * threads) {
    per_task = Hq;
  } else if (chunks * Hk >= 4 * threads) {
    per_task = G;
  }
  std::vector<AttnTask> tasks;
  tasks.reserve(chunks * (Hq / per_task));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t q0 = qs[s]; q0 < qs[s + 1]; q0 += kMaxTaskQueries)
      for (int64_t h0 = 0; h0 < Hq; h0 += per_task)
        tasks.push_back({s, q0, std::min<int64_t>(kMaxTaskQueries, qs[s + 1] - q0), h0, per_task});
  return tasks;
}

// Contiguous task ranges of about equal cost (queries x heads x keys), one per
// thread: sequences of very different lengths would unbalance an even split.
std::vector<int64_t> split_by_cost(const std::vector<AttnTask>& tasks,
                                   const std::vector<int64_t>& tok_pos, int64_t parts) {
  std::vector<double> prefix(tasks.size() + 1, 0.0);
  for (size_t t = 0; t < tasks.size(); ++t) {
    const AttnTask& k = tasks[t];
    const double keys = static_cast<double>(tok_pos[k.q0 + k.nq - 1] + 1);
    prefix[t + 1] = prefix[t] + static_cast<double>(k.nq * k.nh) * keys;
  }
  std::vector<int64_t> bounds(parts + 1, 0);
  size_t t = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const double target = prefix.back() * static_cast<double>(p) / static_cast<double>(parts);
    while (t < tasks.size() && prefix[t + 1] <= target) ++t;
    bounds[p] = static_cast<int64_t>(t);
  }
  bounds[parts] = static_cast<int64_t>(tasks.size());
  return bounds;
}

template <typename CT, int DV_>
void attention_driver(const AttnArgs<CT>& a, const std::vector<AttnTask>& tasks,
                      const std::vector<int64_t>& tok_pos, int64_t threads) {
  const std::vector<int64_t> bounds = split_by_cost(tasks, tok_pos, threads);
  // One index per thread (grain 1, `threads` indices), each runs its range.
  const int64_t G = a.Hq / a.Hk;
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<HeadState<state_lanes<DV_>()>> states;
    for (int64_t part = lo; part < hi; ++part)
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) {
        // A single-head task right after one of the same query chunk and kv
        // group finds that group's K/V rows in L2: skip its prefetches.
        const AttnTask& k = tasks[t];
        const bool warm = t > bounds[part] && k.nh == 1 && tasks[t - 1].q0 == k.q0 &&
                          (tasks[t - 1].h0 / G) == (k.h0 / G);
        attend_task<CT, DV_>(a, k, tok_pos.data(), !warm, states);
      }
  });
}

template <typename CT>
void attention_dispatch(const AttnArgs<CT>& a, const std::vector<AttnTask>& tasks,
                        const std::vector<int64_t>& tok_pos, int64_t threads) {
  switch (a.D) {
    case 32: return attention_driver<CT, 4>(a, tasks, tok_pos, threads);
    case 64: return attention_driver<CT, 8>(a, tasks, tok_pos, threads);
    case 128: return attention_driver<CT, 16>(a, tasks, tok_pos, threads);
    default: return attention_driver<CT, 0>(a, tasks, tok_pos, threads);
  }
}
// Absolute position of every query token (bottom-right aligned causal:
// query i of a sequence with q_len L and seq_len n sits at n - L + i); also
// returns the key x head pair count. Validated serially (S is small).
std::vector<int64_t> token_positions(const int32_t* qs, const int32_t* sl, int64_t S, int64_t T,
                                     int64_t max_keys, int64_t Hq, int64_t& pairs) {
  TORCH_CHECK(qs[0] == 0 && qs[S] == T, "paged_attention: query_start_loc must span 0..T");
  std::vector<int64_t> tok_pos(T);
  pairs = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ql = qs[s + 1] - qs[s];
    TORCH_CHECK(ql >= 0 && ql <= sl[s], "paged_attention: sequence ", s, " has q_len ", ql,
                " > seq_len ", sl[s]);
    TORCH_CHECK(sl[s] <= max_keys, "paged_attention: seq_len exceeds the block table");
    for (int64_t i = 0; i < ql; ++i) {
      tok_pos[qs[s] + i] = sl[s] - ql + i;
      pairs += (sl[s] - ql + i + 1) * Hq;
    }
  }
  return tok_pos;
}

template <typename CT>
void run_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const at::Tensor& bt, const at::Tensor& seq_lens, const at::Tensor& last_slot,
                   at::Tensor& out, double scale, const std::vector<AttnTask>& tasks,
                   const std::vector<int64_t>& tok_pos, int64_t threads) {
  AttnArgs<CT> a{};
  a.q = q.data_ptr<float>();
  a.k_cache = kc.data_ptr<CT>();
  a.v_cache = vc.data_ptr<CT>();
  a.block_tables = bt.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.last_slot = last_slot.defined() ? last_slot.data_ptr<int64_t>() : nullptr;
  a.out = out.data_ptr<float>();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.Hq = q.size(1);
  a.Hk = kc.size(2);
  a.D = q.size(2);
  a.block_size = kc.size(1);
  a.num_blocks = kc.size(0);
  a.max_blocks = bt.size(1);
  a.scale = static_cast<float>(scale);
  attention_dispatch(a, tasks, tok_pos, threads);
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                           const at::Tensor& seq_lens_in, const at::Tensor& qsl_in, double scale,
                           const std::optional<at::Tensor>& last_slot_in) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "paged_attention: q must be float32 [T, Hq, D]");
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor bt = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kInt).contiguous();
  const at::Tensor qsl = qsl_in.to(at::kInt).contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hk = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D, "paged_attention: head_dim mismatch");
  TORCH_CHECK(D % 8 == 0 && D / 8 <= kMaxDV, "paged_attention: head_dim must be a multiple of 8 "
              "and at most ", 8 * kMaxDV, ", got ", D);
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "paged_attention: Hq must be a multiple of Hk");
  TORCH_CHECK(bt.dim() == 2, "paged_attention: block_tables must be [S, max_blocks]");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(bt.size(0) >= S && qsl.numel() == S + 1,
              "paged_attention: block_tables / query_start_loc do not match seq_lens");
  at::Tensor last_slot;
  if (last_slot_in.has_value() && last_slot_in->defined()) {
    last_slot = last_slot_in->to(at::kLong).contiguous();
    TORCH_CHECK(last_slot.numel() == S, "paged_attention: last_slot must be [S]");
  }

  int64_t pairs = 0;
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const std::vector<int64_t> tok_pos =
      token_positions(qs, seq_lens.data_ptr<int32_t>(), S, T, bt.size(1) * bs, Hq, pairs);
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  if (T == 0) return out;
  // Below ~512 key x head pairs (a few us of work) the OpenMP fork/join costs
  // more than a second thread saves.
  const int64_t threads = pairs < kParallelMinPairs ? 1 : std::max(1, at::get_num_threads());
  const std::vector<AttnTask> tasks = plan_tasks(qs, S, Hq, Hk, threads);
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      run_attention<float>(q, k_cache, v_cache, bt, seq_lens, last_slot, out, scale, tasks,
                           tok_pos, threads);
      break;
    case at::kBFloat16:
      run_attention<at::BFloat16>(q, k_cache, v_cache, bt, seq_lens, last_slot, out, scale,
                                  tasks, tok_pos, threads);
      break;
    default:
      run_attention<at::Half>(q, k_cache, v_cache, bt, seq_lens, last_slot, out, scale, tasks,
                              tok_pos, threads);
  }
  return out;
}

}  // namespace laneserve
