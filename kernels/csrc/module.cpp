// The Python module of the CPU kernels: one extension, one definition per op.

#include <torch/extension.h>

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor pack(const torch::Tensor& weight);
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);
torch::Tensor linear_t(const torch::Tensor& x, const torch::Tensor& wt);
torch::Tensor linear_tn(const torch::Tensor& g, const torch::Tensor& x);
torch::Tensor pack_t(const torch::Tensor& wt);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& q_pos, const torch::Tensor& rows, double scale);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& seq,
                              const torch::Tensor& pos, const torch::Tensor& block_table, double scale);
torch::Tensor exp_f32_tensor(const torch::Tensor& x);
std::vector<torch::Tensor> attention_backward(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const torch::Tensor& q_pos, double scale,
                                              const torch::Tensor& grad);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor rope_backward(const torch::Tensor& grad, const torch::Tensor& cos, const torch::Tensor& sin);
std::vector<torch::Tensor> silu_mul_backward(const torch::Tensor& grad, const torch::Tensor& g,
                                             const torch::Tensor& u, const torch::Tensor& denom);
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& grad, const torch::Tensor& x,
                                             const torch::Tensor& r, const torch::Tensor& w);
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::vector<torch::Tensor> silu_mul(const torch::Tensor& g, const torch::Tensor& u, bool keep_denom);
std::vector<torch::Tensor> softmax_stats(const torch::Tensor& x);
torch::Tensor exp_neg_tensor(const torch::Tensor& x);
void log_softmax_into(const torch::Tensor& x, torch::Tensor out);
torch::Tensor token_logp(const torch::Tensor& x, const torch::Tensor& ids);
torch::Tensor log_f64_tensor(const torch::Tensor& x);
torch::Tensor gumbel(const torch::Tensor& seeds, int64_t vocab);
torch::Tensor gumbel_argmax(const torch::Tensor& logits, const torch::Tensor& seeds);
std::vector<torch::Tensor> stable_topk(const torch::Tensor& values, int64_t k);
bool vectorised();
torch::Tensor cached_block(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                           const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& norms, double eps,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, const torch::Tensor& cos,
                           const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           const torch::Tensor& src_rows, const torch::Tensor& src_cols, const torch::Tensor& dest,
                           const torch::Tensor& pos, const torch::Tensor& q_pos, const torch::Tensor& slots,
                           double scale);
torch::Tensor paged_block(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                          const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& norms, double eps,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, const torch::Tensor& cos,
                          const torch::Tensor& sin, torch::Tensor kv, const torch::Tensor& slot_mapping,
                          const torch::Tensor& rows, const torch::Tensor& seq, const torch::Tensor& q_pos,
                          const torch::Tensor& block_table, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("linear", &linear, "batch-invariant fp32 linear (one fma chain per output element)");
  mod.def("pack", &pack, "a weight [N, K] as the panels linear_packed reads");
  mod.def("linear_packed", &linear_packed, "linear against a weight packed once (same bits as linear)");
  mod.def("linear_t", &linear_t, "x @ wt for a weight given transposed [K, N] (same bits as linear)");
  mod.def("linear_tn", &linear_tn, "g.T @ x for g [M, N], x [M, K] (same bits as linear_t(g.T, x))");
  mod.def("pack_t", &pack_t, "a weight given transposed [K, N] as the panels of its transpose (pack(wt.T))");
  mod.def("attention", &attention, "batch-invariant causal attention over the slotted K/V layout");
  mod.def("paged_attention", &paged_attention,
          "the same attention over a paged K/V cache read through a block table (vLLM's layout)");
  mod.def("rope", &rope, "rotate-half RoPE, fp32 (the same bits as x * cos + rotate_half(x) * sin)");
  mod.def("rope_backward", &rope_backward, "RoPE's gradient with respect to x");
  mod.def("rms_norm", &rms_norm, "(y, r) of RMSNorm over rows, r = 1 / sqrt(mean(x^2) + eps) (fixed lane order)");
  mod.def("silu_mul", &silu_mul, "(silu(gate) * up[, 1 + exp(-gate)]) with the kernels' own exp");
  mod.def("silu_mul_backward", &silu_mul_backward, "(d gate, d up) of silu(gate) * up, one pass");
  mod.def("rms_norm_backward", &rms_norm_backward, "(dx, d weight) of RMSNorm, one pass per row");
  mod.def("attention_backward", &attention_backward, "(dq, dk, dv) of attention over the batch's own K/V");
  mod.def("exp", &exp_f32_tensor, "the attention softmax's fp32 exp, elementwise (tests)");
  mod.def("softmax_stats", &softmax_stats,
          "(max, log of the sum of exp(x - max)) of each row: the log-softmax's statistics (one thread a row)");
  mod.def("log_softmax_into", &log_softmax_into, "each row's log-softmax (x - max) - lse, written into out");
  mod.def("token_logp", &token_logp, "each row's log-softmax at ids[r], the written row's arithmetic");
  mod.def("exp_neg", &exp_neg_tensor, "the log-softmax sum's fp32 exp of x <= 0, elementwise (tests)");
  mod.def("log", &log_f64_tensor, "the log-softmax's log, in fp64, elementwise (tests)");
  mod.def("gumbel", &gumbel, "seeded Gumbel noise [N, vocab], row i from seeds[i] alone (SplitMix64)");
  mod.def("gumbel_argmax", &gumbel_argmax,
          "argmax(logits + gumbel(seeds)) per row, ties to the lowest id, the noise computed where it can win");
  mod.def("stable_topk", &stable_topk, "(ids, values) of each row's k largest, ties to the lower id (one pass)");
  mod.def("cached_block", &cached_block,
          "a dense block over an engine's KV cache: the per-op path's kernel calls, in one call (same bits)");
  mod.def("paged_block", &paged_block,
          "the same block inside vLLM, over its paged cache and block table (same bits as the per-op path)");
  mod.def("vectorised", &vectorised, "whether the AVX2/FMA path was compiled");
}
