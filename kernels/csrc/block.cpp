// One dense decoder block over an engine's KV cache, in one call (fp32, no autograd): the built-in engine's
// slotted cache (cached_block) or vLLM's paged one (paged_block).
//
// The per-op path (rlfw/model/layers.py: Block, Attention, MLP) calls these same kernels from Python, one
// call per op, each behind Python and torch dispatch; on a small model's decode step that dispatch is
// about a third of the step. This function makes the same calls in the same order on the same operands,
// so every result is the per-op path's, bit for bit (tests/model/test_cached_block.py); the residual
// adds are the same ATen add the Python `x + y` reaches, and the cache write copies each token's K/V
// rows where the per-op path's index assignment stores them.

#include <torch/extension.h>

#include <cstring>
#include <vector>

torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
std::vector<torch::Tensor> silu_mul(const torch::Tensor& g, const torch::Tensor& u, bool keep_denom);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& q_pos, const torch::Tensor& rows, double scale);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& seq,
                              const torch::Tensor& pos, const torch::Tensor& block_table, double scale);

namespace {

// RMSNorm over the last dim of x, as kernels/norm.py's compiled path calls it.
torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const int64_t d = x.size(-1);
  return rms_norm(x.reshape({-1, d}).contiguous(), w, eps)[0].view(x.sizes());
}

// x [rows, K] against packed panels with n outputs, as kernels/matmul.py's linear calls it.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& panels, int64_t n) {
  return linear_packed(x.contiguous(), panels, n);
}

// cache[dest[i], pos[i]] = src[rows[i], cols[i]] for each i: one token's K or V heads, Hkv x D floats, copied
// as they are (what index_put_ of an index would store, without building the gathered tensor).
void write_kv(torch::Tensor& cache, const torch::Tensor& src, const torch::Tensor& rows, const torch::Tensor& cols,
              const torch::Tensor& dest, const torch::Tensor& pos) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.scalar_type() == at::kFloat,
              "cached_block: contiguous fp32 cache [slots, S, Hkv, D]");
  TORCH_CHECK(src.dim() == 4 && src.is_contiguous() && src.scalar_type() == at::kFloat && src.size(2) == cache.size(2) && src.size(3) == cache.size(3),
              "cached_block: K/V [B, T, Hkv, D] matching the cache's heads");
  const int64_t n = rows.numel();
  for (const torch::Tensor* ix : {&rows, &cols, &dest, &pos})
    TORCH_CHECK(ix->scalar_type() == at::kLong && ix->is_contiguous() && ix->numel() == n,
                "cached_block: four int64 index vectors of one length");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* c = cols.data_ptr<int64_t>();
  const int64_t* d = dest.data_ptr<int64_t>();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t row = cache.size(2) * cache.size(3);
  const float* from = src.data_ptr<float>();
  float* to = cache.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < src.size(0) && c[i] >= 0 && c[i] < src.size(1), "cached_block: K/V source out of range");
    TORCH_CHECK(d[i] >= 0 && d[i] < cache.size(0) && p[i] >= 0 && p[i] < cache.size(1),
                "cached_block: cache position out of range");
    std::memcpy(to + (d[i] * cache.size(1) + p[i]) * row, from + (r[i] * src.size(1) + c[i]) * row, row * sizeof(float));
  }
}


// kv [NB, Hkv, 2 * BS, D] (vLLM's CPU cache viewed as kernels/attention.py's _kv_pairs): token i's K (`value`
// false) or V heads, row rows[i] of src [U, Hkv, D], go to slot slots[i] = block * BS + offset, at row offset
// (keys) or BS + offset (values) of each head's block; a negative slot is padding and skipped. Rows computed
// once for several tokens (a prefix two requests share) go to each of their slots. The floats are copied as
// they are, what paged_store's index assignment stores.
void write_paged(torch::Tensor& kv, const torch::Tensor& src, const torch::Tensor& slots, const torch::Tensor& rows,
                 bool value) {
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.scalar_type() == at::kFloat && kv.size(2) % 2 == 0,
              "paged_block: contiguous fp32 cache [blocks, Hkv, 2 * block, D]");
  TORCH_CHECK(src.dim() == 3 && src.is_contiguous() && src.scalar_type() == at::kFloat && src.size(1) == kv.size(1) &&
                  src.size(2) == kv.size(3),
              "paged_block: K/V [N, Hkv, D] matching the cache's heads");
  for (const torch::Tensor* ix : {&slots, &rows})
    TORCH_CHECK(ix->scalar_type() == at::kLong && ix->is_contiguous() && ix->numel() == slots.numel(),
                "paged_block: one int64 slot and source row per token");
  const int64_t hkv = kv.size(1), block = kv.size(2) / 2, d = kv.size(3), capacity = kv.size(0) * block;
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const float* from = src.data_ptr<float>();
  float* to = kv.data_ptr<float>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (s[i] < 0) continue;
    TORCH_CHECK(s[i] < capacity, "paged_block: slot ", s[i], " past the cache's ", capacity, " positions");
    TORCH_CHECK(r[i] >= 0 && r[i] < src.size(0), "paged_block: source row ", r[i], " of ", src.size(0));
    const int64_t b = s[i] / block, j = s[i] % block + (value ? block : 0);
    for (int64_t h = 0; h < hkv; ++h)
      std::memcpy(to + ((b * hkv + h) * 2 * block + j) * d, from + (r[i] * hkv + h) * d, d * sizeof(float));
  }
}

// The block around its attention: RMSNorm, the q/k/v projections, the q and k norms, RoPE, then
// attend(q [B, T, Hq, D], k, v [B, T, Hkv, D]) -> [B * T, Hq * D] (which writes the cache), the output
// projection, the residual add, RMSNorm, SiLU-mul of gate and up, the down projection, the residual add.
template <typename Attend>
torch::Tensor block_around(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                           const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& norms, double eps,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, const torch::Tensor& cos,
                           const torch::Tensor& sin, const Attend& attend) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "cached_block: fp32 x [B, T, H]");
  TORCH_CHECK(panels.size() == 7 && outs.size() == 7, "cached_block: seven packed weights");
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "cached_block: two or four norm weights");
  const int64_t b = x.size(0), t = x.size(1), hidden = x.size(2);
  const torch::Tensor h = norm(x, norms[0], eps).view({b * t, hidden});
  torch::Tensor q = project(h, panels[0], outs[0]).view({b, t, heads, head_dim});
  torch::Tensor k = project(h, panels[1], outs[1]).view({b, t, kv_heads, head_dim});
  const torch::Tensor v = project(h, panels[2], outs[2]).view({b, t, kv_heads, head_dim});
  if (norms.size() == 4) {
    q = norm(q, norms[2], eps);
    k = norm(k, norms[3], eps);
  }
  q = rope(q.contiguous(), cos, sin);
  k = rope(k.contiguous(), cos, sin);
  const torch::Tensor a = attend(q, k, v);
  const torch::Tensor x1 = x + project(a, panels[3], outs[3]).view({b, t, outs[3]});
  const torch::Tensor m = norm(x1, norms[1], eps).view({b * t, hidden});
  const torch::Tensor act = silu_mul(project(m, panels[4], outs[4]), project(m, panels[5], outs[5]), false)[0];
  return x1 + project(act, panels[6], outs[6]).view({b, t, outs[6]});
}

}  // namespace

// x [B, T, H]; panels: q, k, v, o, gate, up and down packed by pack() with outs[i] outputs each; norms:
// the input and post-attention RMSNorm weights, then optionally the per-head q and k norm weights;
// cos and sin [B, T, head_dim]; the layer's cache k and v [slots, S, Hkv, D]; each valid token's K/V goes
// from batch entry (src_rows, src_cols) to cache (dest, pos); q_pos [B, T] the queries' positions and
// slots [B] the cache row each batch entry reads. Returns the block's output [B, T, H].
torch::Tensor cached_block(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                           const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& norms, double eps,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, const torch::Tensor& cos,
                           const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           const torch::Tensor& src_rows, const torch::Tensor& src_cols, const torch::Tensor& dest,
                           const torch::Tensor& pos, const torch::Tensor& q_pos, const torch::Tensor& slots,
                           double scale) {
  const auto attend = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    write_kv(k_cache, k, src_rows, src_cols, dest, pos);
    write_kv(v_cache, v, src_rows, src_cols, dest, pos);
    return attention(q, k_cache, v_cache, q_pos, slots, scale).view({q.size(0) * q.size(1), -1});
  };
  return block_around(x, panels, outs, norms, eps, heads, kv_heads, head_dim, cos, sin, attend);
}

// The same block inside vLLM: x [1, U, H] holds the rows computed for a step's N tokens of many sequences
// (U == N unless tokens share a prefix, computed once), cos and sin [1, U, head_dim]; kv [NB, Hkv, 2 * BS, D]
// is the layer's paged cache (vLLM's CPU tensor viewed as kernels/attention.py's _kv_pairs): token i's K/V,
// from row rows[i], go to slot_mapping[i] (negative: skipped); the cache is read through block_table [R, MB]:
// row u is sequence seq[u]'s query at position q_pos[u] (paged_attention's arguments). Returns the block's
// output [1, U, H].
torch::Tensor paged_block(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                          const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& norms, double eps,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, const torch::Tensor& cos,
                          const torch::Tensor& sin, torch::Tensor kv, const torch::Tensor& slot_mapping,
                          const torch::Tensor& rows, const torch::Tensor& seq, const torch::Tensor& q_pos,
                          const torch::Tensor& block_table, double scale) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "paged_block: x [1, U, H]");
  const int64_t n = x.size(1);
  const auto attend = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    write_paged(kv, k.view({n, kv_heads, head_dim}), slot_mapping, rows, false);
    write_paged(kv, v.contiguous().view({n, kv_heads, head_dim}), slot_mapping, rows, true);
    return paged_attention(q.view({n, heads, head_dim}), kv, seq, q_pos, block_table, scale).view({n, -1});
  };
  return block_around(x, panels, outs, norms, eps, heads, kv_heads, head_dim, cos, sin, attend);
}
