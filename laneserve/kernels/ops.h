// The laneserve CPU ops (torch.ops.laneserve.<name>), one declaration per op, grouped by
// the file that defines it; bindings.cpp registers them with their schemas. Shapes,
// dtypes and the batch-invariance contract are documented on the Python side
// (laneserve/kernels/base.py, the Kernels protocol).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace laneserve {

// linear.cpp
at::Tensor pack_linear_weight(const at::Tensor& w, int64_t isa);
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                  const std::optional<at::Tensor>& bias_in, int64_t isa,
                  const std::optional<at::Tensor>& scale_in);

// linear_amx.cpp (its dot-product backend: linear_dpbf16.cpp)
at::Tensor linear_prefill(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                          const std::optional<at::Tensor>& bias_in, int64_t first_prefill,
                          int64_t method);
// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                        int64_t qtype, const std::optional<at::Tensor>& bias_in, int64_t isa);
// quant_linear_q8.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x_in);
at::Tensor quant_linear_q8(const at::Tensor& x_in, const at::Tensor& w, int64_t n_out,
                           int64_t qtype, const std::optional<at::Tensor>& bias_in);
// scaled_linear.cpp
at::Tensor scaled_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale,
                         int64_t n_out, int64_t fmt, int64_t group,
                         const std::optional<at::Tensor>& bias_in, int64_t isa);

// causal_attention.cpp
at::Tensor causal_attention_bf16(const at::Tensor& q_in, const at::Tensor& k_in,
                                 const at::Tensor& v_in, double scale);

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w_in, double eps);
void rotary_embedding(const at::Tensor& positions_in, at::Tensor& q, at::Tensor& k,
                      int64_t head_dim, const at::Tensor& cache_in);
at::Tensor silu_and_mul(const at::Tensor& x_in, std::optional<double> limit);

// hyper.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> hyper_pre(const at::Tensor& streams,
                                                          const at::Tensor& fn,
                                                          const at::Tensor& base,
                                                          const at::Tensor& scale, int64_t iters,
                                                          double eps, double rms_eps);
at::Tensor hyper_post(const at::Tensor& streams, const at::Tensor& out, const at::Tensor& post,
                      const at::Tensor& comb);

// attention.cpp
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                           const at::Tensor& seq_lens_in, const at::Tensor& qsl_in, double scale,
                           const std::optional<at::Tensor>& last_slot_in);

// kv_cache.cpp
void write_kv_cache(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping_in);
at::Tensor slot_mapping(const at::Tensor& table_in, const at::Tensor& token_row_in,
                        const at::Tensor& positions_in, int64_t block_size);
// Shared argument check of a paged K or V cache (also used by paged_attention).
void check_cache(const at::Tensor& c, const at::Tensor& ref, const char* name);

// spec_ops.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_greedy(
    const at::Tensor& logits_in, const at::Tensor& drafts_in, const at::Tensor& num_valid_in,
    const at::Tensor& alternatives_in);
void commit_side_rows(at::Tensor& k_stack, at::Tensor& v_stack, const at::Tensor& side_slots,
                      const at::Tensor& real_slot, const at::Tensor& hit,
                      const at::Tensor& choice, at::Tensor& hidden,
                      const at::Tensor& side_hidden, const at::Tensor& first_draft);
std::tuple<at::Tensor, at::Tensor> ngram_lookup(const at::Tensor& history_in,
                                                const at::Tensor& committed_in,
                                                const at::Tensor& slots_in, int64_t width,
                                                int64_t k, int64_t n_min, int64_t n_max);
at::Tensor top_tokens(const at::Tensor& logits_in, int64_t n,
                      const std::optional<at::Tensor>& vocab_in);
void write_drafts(at::Tensor& drafts, at::Tensor& num_drafts, at::Tensor& side_drafts,
                  const at::Tensor& slots_in, const at::Tensor& chain_in,
                  const std::optional<at::Tensor>& top_in,
                  const std::optional<at::Tensor>& found_in,
                  const std::optional<at::Tensor>& num_in);

}  // namespace laneserve
