// Registers the laneserve CPU ops as torch.ops.laneserve.<name> (CPU dispatch key only).
// Built and loaded by laneserve/kernels/build.py; the Python wrappers are in
// laneserve/kernels/cpu.py and the contract of each op in laneserve/kernels/base.py.

#include "ops.h"

#include <torch/library.h>

TORCH_LIBRARY(laneserve, m) {
  m.def("pack_linear_weight(Tensor w, int isa) -> Tensor");
  m.def(
      "linear(Tensor x, Tensor w, int out_features, Tensor? bias, int isa, "
      "Tensor? scale=None) -> Tensor");
  m.def(
      "linear_prefill(Tensor x, Tensor w, int out_features, Tensor? bias, int first_prefill, "
      "int method=0) -> Tensor");
  m.def(
      "quant_linear(Tensor x, Tensor w, int out_features, int qtype, Tensor? bias, int isa=1) "
      "-> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "quant_linear_q8(Tensor x, Tensor w, int out_features, int qtype, Tensor? bias) -> "
      "Tensor");
  m.def(
      "scaled_linear(Tensor x, Tensor w, Tensor scale, int out_features, int fmt, int group, "
      "Tensor? bias, int isa=0) -> Tensor");
  m.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, int head_dim, "
      "Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x, float? limit=None) -> Tensor");
  m.def(
      "hyper_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float eps, "
      "float rms_eps) -> (Tensor, Tensor, Tensor)");
  m.def("hyper_post(Tensor streams, Tensor out, Tensor post, Tensor comb) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor? last_slot=None) -> Tensor");
  m.def(
      "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "verify_greedy(Tensor logits, Tensor drafts, Tensor num_valid, Tensor alternatives) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "commit_side_rows(Tensor(a!) k_stack, Tensor(b!) v_stack, Tensor side_slots, "
      "Tensor real_slot, Tensor hit, Tensor choice, Tensor(c!) hidden, Tensor side_hidden, "
      "Tensor first_draft) -> ()");
  m.def(
      "ngram_lookup(Tensor history, Tensor committed, Tensor slots, int width, int k, "
      "int n_min, int n_max) -> (Tensor, Tensor)");
  m.def(
      "slot_mapping(Tensor table, Tensor token_row, Tensor positions, int block_size) -> "
      "Tensor");
  m.def("top_tokens(Tensor logits, int n, Tensor? vocab) -> Tensor");
  m.def(
      "write_drafts(Tensor(a!) drafts, Tensor(b!) num_drafts, Tensor(c!) side_drafts, "
      "Tensor slots, Tensor chain, Tensor? top, Tensor? found, Tensor? num) -> ()");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("pack_linear_weight", &laneserve::pack_linear_weight);
  m.impl("linear", &laneserve::linear);
  m.impl("linear_prefill", &laneserve::linear_prefill);
  m.impl("quant_linear", &laneserve::quant_linear);
  m.impl("quantize_q8", &laneserve::quantize_q8);
  m.impl("quant_linear_q8", &laneserve::quant_linear_q8);
  m.impl("scaled_linear", &laneserve::scaled_linear);
  m.impl("causal_attention_bf16", &laneserve::causal_attention_bf16);
  m.impl("rms_norm", &laneserve::rms_norm);
  m.impl("fused_add_rms_norm", &laneserve::fused_add_rms_norm);
  m.impl("rotary_embedding", &laneserve::rotary_embedding);
  m.impl("silu_and_mul", &laneserve::silu_and_mul);
  m.impl("hyper_pre", &laneserve::hyper_pre);
  m.impl("hyper_post", &laneserve::hyper_post);
  m.impl("paged_attention", &laneserve::paged_attention);
  m.impl("write_kv_cache", &laneserve::write_kv_cache);
  m.impl("verify_greedy", &laneserve::verify_greedy);
  m.impl("commit_side_rows", &laneserve::commit_side_rows);
  m.impl("ngram_lookup", &laneserve::ngram_lookup);
  m.impl("slot_mapping", &laneserve::slot_mapping);
  m.impl("top_tokens", &laneserve::top_tokens);
  m.impl("write_drafts", &laneserve::write_drafts);
}
