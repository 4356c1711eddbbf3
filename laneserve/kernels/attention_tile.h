// Paged attention, the per-(query, head) inner loop: the K/V row pointers of a key tile,
// their prefetch, and one tile's scores, online-softmax update and P @ V. Included only
// by attention.cpp, which plans and runs the tasks. Notes on batch invariance and fp
// contraction: vec.h.
#pragma once

#include "vec.h"

#include <type_traits>

namespace laneserve {

// ----------------------------------------------------------------------------
// Paged attention (decode and short verify/prefill chunks)
// ----------------------------------------------------------------------------
//
// The query at absolute position `pos` attends keys 0..pos of its sequence,
// read in place through the block table (no gather). A task is up to 8
// consecutive queries of one sequence x a set of q heads (all heads, one GQA
// group or one head, see plan_tasks). Keys go in tiles of kKeyTile absolute
// positions; a tile's K/V rows are pulled into L1 once (software prefetch one
// tile ahead) and used by every query and head of the task. Softmax is an fp32
// online softmax (running max m, sum l, accumulator acc) updated per tile.
//
// NOTE (invariance): per (query, head) the arithmetic is fixed: tile
// boundaries are absolute key indices (0, 32, 64, ...), each key's score is
// its own FMA chain over d followed by a lane-independent reduction, and the
// softmax/PV updates run in key order. Nothing depends on q_len, on the other
// sequences, on the head grouping of the task, or on the thread split.
//
// Lane order: head_dim is processed in chunks of 16 loaded with load_w16; for
// bf16 that yields columns [0-3, 8-11] and [4-7, 12-15] (unpack trick, see
// linear). q and acc are kept in that same lane order, which is harmless for
// dot products and undone when the output is stored.

constexpr int kKeyTile = 32;
constexpr int kMaxDV = 72;            // head_dim <= 576 (DeepSeek V3's MLA latent)
constexpr int kUnpackLaneCol[kNB] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

template <typename CT>
constexpr bool kPermutedLanes = std::is_same_v<CT, at::BFloat16>;

template <typename CT>
struct AttnArgs {
  const float* q;  // [T, Hq, D]
  const CT* k_cache;
  const CT* v_cache;  // [num_blocks, block_size, Hk, D]
  const int32_t* block_tables;
  const int32_t* seq_lens;  // [S]
  const int64_t* last_slot;  // [S] or null: cache slot of each sequence's last key (-1: table)
  float* out;  // [T, Hq, D]
  int64_t q_stride_t, q_stride_h;
  int64_t Hq, Hk, D, block_size, num_blocks, max_blocks;
  float scale;
};

// K and V token-row pointers of keys key0..key0+n-1 of one tile, walking the
// block table one block segment at a time. Entries n..round_up(n, 8)-1 repeat
// the last key so that score8 can always read 8 keys (those lanes are masked).
// A sequence's last key (position last_pos) is read from last_slot instead of
// the table when last_slot >= 0 (speculative side rows: an alternative token's
// key kept apart from the request's own slot; the arithmetic is unchanged).
template <typename CT>
inline void tile_ptrs(const AttnArgs<CT>& a, const int32_t* bt, int64_t key0, int n,
                      int64_t last_pos, int64_t last_slot, const CT** kp, const CT** vp) {
  const CT* kbase = a.k_cache;
  const CT* vbase = a.v_cache;
  const int64_t row_elems = a.Hk * a.D;
  int64_t bi = key0 / a.block_size;
  int64_t off = key0 - bi * a.block_size;
  int j = 0;
  while (j < n) {
    const int64_t blk = bt[bi++];
    TORCH_CHECK(blk >= 0 && blk < a.num_blocks, "paged_attention: block id out of range");
    const int take = static_cast<int>(std::min<int64_t>(n - j, a.block_size - off));
    const int64_t row0 = (blk * a.block_size + off) * row_elems;
    for (int t = 0; t < take; ++t) {
      kp[j + t] = kbase + row0 + t * row_elems;
      vp[j + t] = vbase + row0 + t * row_elems;
    }
    j += take;
    off = 0;
  }
  if (last_slot >= 0 && last_pos >= key0 && last_pos < key0 + n) {
    TORCH_CHECK(last_slot < a.num_blocks * a.block_size, "paged_attention: last_slot ",
                last_slot, " out of range");
    kp[last_pos - key0] = kbase + last_slot * row_elems;
    vp[last_pos - key0] = vbase + last_slot * row_elems;
  }
  for (; j % 8 != 0; ++j) {
    kp[j] = kp[n - 1];
    vp[j] = vp[n - 1];
  }
}

// Next-tile rows to prefetch into L1, a slice [begin, end) at a time: K/V rows
// sit at a (Hk * D) stride across shuffled blocks, which hardware prefetchers
// do not follow well, and issuing a whole tile at once overflows the miss
// queues, so each (head, query) step of the current tile issues one slice.
template <typename CT>
struct PrefetchSlice {
  const CT* const* k;
  const CT* const* v;
  int begin, end;
  int64_t col, bytes;  // byte span [col, col + bytes) of each row (col in elements)
};

template <typename CT>
inline void prefetch_rows(const CT* const* rows, int begin, int end, int64_t col, int64_t bytes) {
  const int64_t lines = (bytes + 63) / 64;
  for (int j = begin; j < end; ++j) {
    const char* p = reinterpret_cast<const char*>(rows[j] + col);
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
    _mm_prefetch(p + bytes - 1, _MM_HINT_T0);  // tail line when p is not 64 B aligned
  }
}

// Vector count of the per-head state: D/8 when known at compile time.
template <int DV_>
constexpr int state_lanes() {
  return DV_ > 0 ? DV_ : kMaxDV;
}

// Per (query, head) running state, kept in the cache's lane order.
template <int kArr>
struct HeadState {
  __m256 q[kArr];
  __m256 acc[kArr];
  float m;
  float l;
};

template <typename CT, int kArr>
void init_head(HeadState<kArr>& st, const float* qp, int dv) {
  const int npairs = dv / 2;
  for (int pr = 0; pr < npairs; ++pr) {
    if constexpr (kPermutedLanes<CT>) {
      alignas(32) float tmp[kNB];
      for (int L = 0; L < kNB; ++L) tmp[L] = qp[16 * pr + kUnpackLaneCol[L]];
      st.q[2 * pr] = _mm256_load_ps(tmp);
      st.q[2 * pr + 1] = _mm256_load_ps(tmp + 8);
    } else {
      st.q[2 * pr] = _mm256_loadu_ps(qp + 16 * pr);
      st.q[2 * pr + 1] = _mm256_loadu_ps(qp + 16 * pr + 8);
    }
  }
  if (dv & 1) st.q[dv - 1] = _mm256_loadu_ps(qp + 16 * npairs);
  for (int c = 0; c < dv; ++c) st.acc[c] = _mm256_setzero_ps();
  st.m = -std::numeric_limits<float>::infinity();
  st.l = 0.0f;
}

template <typename CT, int kArr>
void store_head(const HeadState<kArr>& st, float* op, int dv) {
  const __m256 lv = _mm256_set1_ps(st.l);
  const int npairs = dv / 2;
  for (int pr = 0; pr < npairs; ++pr) {
    const __m256 lo = _mm256_div_ps(st.acc[2 * pr], lv);
    const __m256 hi = _mm256_div_ps(st.acc[2 * pr + 1], lv);
    if constexpr (kPermutedLanes<CT>) {
      alignas(32) float tmp[kNB];
      _mm256_store_ps(tmp, lo);
      _mm256_store_ps(tmp + 8, hi);
      for (int L = 0; L < kNB; ++L) op[16 * pr + kUnpackLaneCol[L]] = tmp[L];
    } else {
      _mm256_storeu_ps(op + 16 * pr, lo);
      _mm256_storeu_ps(op + 16 * pr + 8, hi);
    }
  }
  if (dv & 1) _mm256_storeu_ps(op + 16 * npairs, _mm256_div_ps(st.acc[dv - 1], lv));
}

// Scores of 8 keys: s[j] = scale * sum_d q[d] k_j[d]. The 8 FMA chains are
// interleaved explicitly (a single chain per key is FMA-latency bound).
template <typename CT, int DV_, int kArr>
inline __m256 score8(const __m256* q, const CT* const* kp, int64_t col, int dv, __m256 scale) {
  const int npairs = dv / 2;
  __m256 d[8];
  for (int j = 0; j < 8; ++j) d[j] = _mm256_setzero_ps();
  for (int pr = 0; pr < npairs; ++pr) {
    for (int j = 0; j < 8; ++j) {
      __m256 x, y;
      load_w16(kp[j] + col + 16 * pr, x, y);
      d[j] = _mm256_fmadd_ps(q[2 * pr], x, d[j]);
      d[j] = _mm256_fmadd_ps(q[2 * pr + 1], y, d[j]);
    }
  }
  if (dv & 1)
    for (int j = 0; j < 8; ++j)
      d[j] = _mm256_fmadd_ps(q[dv - 1], load8(kp[j] + col + 16 * npairs), d[j]);
  return _mm256_mul_ps(hsum8(d), scale);
}

// One tile of n keys for one head: scores, online-softmax update, P @ V.
template <typename CT, int DV_, int kArr>
void attend_tile(HeadState<kArr>& st, const CT* const* kp, const CT* const* vp, int64_t col, int n,
                 int dv, __m256 scale, const PrefetchSlice<CT>& pf) {
  prefetch_rows(pf.k, pf.begin, pf.end, pf.col, pf.bytes);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 q[kArr];
  for (int c = 0; c < dv; ++c) q[c] = st.q[c];

  __m256 s[kKeyTile / 8];
  const int groups = (n + 7) / 8;
  __m256 tmax = neg_inf;
  for (int gi = 0; gi < groups; ++gi) {
    s[gi] = _mm256_blendv_ps(neg_inf, score8<CT, DV_, kArr>(q, kp + 8 * gi, col, dv, scale),
                             prefix_mask(n - gi * 8));
    tmax = _mm256_max_ps(tmax, s[gi]);
  }

  const float m_new = std::max(st.m, hmax(tmax));
  const float alpha = _mm256_cvtss_f32(exp256(_mm256_set1_ps(st.m - m_new)));  // 0 at start
  const __m256 mv = _mm256_set1_ps(m_new);
  alignas(32) float p[kKeyTile];
  __m256 psum = _mm256_setzero_ps();
  for (int gi = 0; gi < groups; ++gi) {
    const __m256 pg = exp256(_mm256_sub_ps(s[gi], mv));  // masked lanes: exp(-inf) = 0
    _mm256_store_ps(p + 8 * gi, pg);
    psum = _mm256_add_ps(psum, pg);
  }
  st.l = st.l * alpha + hsum(psum);
  st.m = m_new;

  // NOTE: local accumulators (not st.acc) so they live in registers: __m256
  // stores may alias the cache loads as far as the compiler knows.
  prefetch_rows(pf.v, pf.begin, pf.end, pf.col, pf.bytes);
  __m256 acc[kArr];
  const __m256 av = _mm256_set1_ps(alpha);
  for (int c = 0; c < dv; ++c) acc[c] = _mm256_mul_ps(st.acc[c], av);
  const int npairs = dv / 2;
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const CT* v = vp[j] + col;
    for (int pr = 0; pr < npairs; ++pr) {
      __m256 x, y;
      load_w16(v + 16 * pr, x, y);
      acc[2 * pr] = _mm256_fmadd_ps(pj, x, acc[2 * pr]);
      acc[2 * pr + 1] = _mm256_fmadd_ps(pj, y, acc[2 * pr + 1]);
    }
    if (dv & 1) acc[dv - 1] = _mm256_fmadd_ps(pj, load8(v + 16 * npairs), acc[dv - 1]);
  }
  for (int c = 0; c < dv; ++c) st.acc[c] = acc[c];
}

}  // namespace laneserve
