// Paged KV cache bookkeeping: write_kv_cache (new keys / values into their slots) and
// slot_mapping (each token's slot through the block table); check_cache is shared with
// paged_attention.

#include "ops.h"
#include "vec.h"

namespace laneserve {

void check_cache(const at::Tensor& c, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(c.dim() == 4 && c.is_contiguous(), name,
              " must be a contiguous [num_blocks, block_size, Hk, D] tensor");
  TORCH_CHECK(c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ||
                  c.scalar_type() == at::kHalf,
              name, " must be float32, bfloat16 or float16");
  TORCH_CHECK(c.sizes() == ref.sizes() && c.scalar_type() == ref.scalar_type(),
              "k_cache and v_cache must have the same shape and dtype");
}

// ----------------------------------------------------------------------------
// write_kv_cache: cache[slot] = k / v (converted); negative slots are skipped
// ----------------------------------------------------------------------------

namespace {

template <typename CT>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, CT* kc, CT* vc,
                   const int64_t* slots, int64_t num_slots) {
  const int64_t T = k.size(0), Hk = k.size(1), D = k.size(2);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), vs0 = v.stride(0);
  at::parallel_for(0, T, rows_grain(Hk * D * 4), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token (vLLM convention)
      TORCH_CHECK(slot < num_slots, "write_kv_cache: slot ", slot, " out of range");
      // Heads of one token are contiguous in both source rows and the cache.
      convert_row(kp + t * ks0, kc + slot * Hk * D, Hk * D);
      convert_row(vp + t * vs0, vc + slot * Hk * D, Hk * D);
    }
  });
}

at::Tensor rows_with_contiguous_heads(const at::Tensor& x) {
  const bool ok =
      (x.size(2) <= 1 || x.stride(2) == 1) && (x.size(1) <= 1 || x.stride(1) == x.size(2));
  return ok ? x : x.contiguous();
}

}  // namespace

void write_kv_cache(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(k_in.dim() == 3 && k_in.scalar_type() == at::kFloat && v_in.sizes() == k_in.sizes() &&
                  v_in.scalar_type() == at::kFloat,
              "write_kv_cache: k and v must be float32 [T, Hk, D]");
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  TORCH_CHECK(k_cache.size(2) == k_in.size(1) && k_cache.size(3) == k_in.size(2),
              "write_kv_cache: [Hk, D] of k does not match the cache");
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k_in.size(0), "write_kv_cache: slot_mapping must be [T]");
  const at::Tensor k = rows_with_contiguous_heads(k_in);
  const at::Tensor v = rows_with_contiguous_heads(v_in);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      write_kv_impl(k, v, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, num_slots);
      break;
    case at::kBFloat16:
      write_kv_impl(k, v, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), sp,
                    num_slots);
      break;
    default:
      write_kv_impl(k, v, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), sp,
                    num_slots);
  }
}

// ----------------------------------------------------------------------------
// Slot mapping (paged KV): one op instead of the index/div/mul/remainder/add chain
// ----------------------------------------------------------------------------
// Token t of row token_row[t] at position p goes to slot table[row, p / bs] * bs + p % bs.

namespace {

template <typename B>
void map_slots(const B* table, int64_t rows, int64_t cols, const int64_t* row,
               const int64_t* pos, int64_t T, int64_t bs, int64_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = row[t], p = pos[t];
    TORCH_CHECK(0 <= r && r < rows, "slot_mapping: token row ", r, " outside [0, ", rows, ")");
    TORCH_CHECK(0 <= p && p / bs < cols, "slot_mapping: position ", p,
                " outside the block table (", cols, " blocks of ", bs, ")");
    out[t] = static_cast<int64_t>(table[r * cols + p / bs]) * bs + p % bs;
  }
}

}  // namespace

at::Tensor slot_mapping(const at::Tensor& table_in, const at::Tensor& token_row_in,
                        const at::Tensor& positions_in, int64_t block_size) {
  TORCH_CHECK(table_in.dim() == 2 && (table_in.scalar_type() == at::kInt ||
                                      table_in.scalar_type() == at::kLong),
              "slot_mapping: table must be int32 or int64 [R, blocks]");
  TORCH_CHECK(block_size >= 1, "slot_mapping: block_size must be >= 1");
  const at::Tensor table = table_in.contiguous();
  const at::Tensor row = token_row_in.to(at::kLong).contiguous();
  const at::Tensor pos = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(row.dim() == 1 && pos.dim() == 1 && row.size(0) == pos.size(0),
              "slot_mapping: token_row and positions must be [T]");
  const int64_t T = pos.size(0), R = table.size(0), C = table.size(1);
  at::Tensor out = at::empty({T}, pos.options());
  if (table.scalar_type() == at::kInt)
    map_slots(table.data_ptr<int32_t>(), R, C, row.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
              T, block_size, out.data_ptr<int64_t>());
  else
    map_slots(table.data_ptr<int64_t>(), R, C, row.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
              T, block_size, out.data_ptr<int64_t>());
  return out;
}

}  // namespace laneserve
