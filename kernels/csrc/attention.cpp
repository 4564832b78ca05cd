// Batch-invariant causal attention for CPUs over the engine's slotted K/V layout [B, S, H_kv, D] and over
// vLLM's paged layout (blocks of positions reached through a block table), with one arithmetic for both.
//
// Each query row (batch entry, position p, query head) is computed alone, by one thread, in an order that
// depends on p and the head size only: scores s_i = q . k_i for i = 0 .. p (each dot product: eight lane
// sums of fma chains over d = j, j + 8, ..., folded as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
// then the d tail by an ascending fma chain, then times the scale); m = max s_i; e_i = exp(s_i - m);
// denominator = sum of e_i, i ascending; out[d] = (fma chain over i ascending of e_i * v_i[d]) / denominator.
// Nothing past p is read, so stale or non-finite cache contents there cannot reach a result, and a prefill,
// a chunked prefill, a decode step and the trainer's forward give the same bits for the same query.
// A query with a negative position (padding) gets zeros. Where K/V live (a slotted row, a chain of paged
// blocks, fp32 or bf16 widened exactly) does not enter the arithmetic, so the same query gets the same
// bits from either cache.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RLFW_AVX2 1
#else
#define RLFW_AVX2 0
#endif

namespace {

constexpr int64_t kLanes = 8;

inline float fold(const float l[kLanes]) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

inline float dot(const float* a, const float* b, int64_t d) {
  const int64_t d8 = d - d % kLanes;
  alignas(32) float lanes[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
#if RLFW_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d8; i += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  _mm256_store_ps(lanes, acc);
#else
  for (int64_t i = 0; i < d8; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] = std::fma(a[i + j], b[i + j], lanes[j]);
#endif
  float s = fold(lanes);
  for (int64_t i = d8; i < d; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

#if RLFW_AVX2
// Eight dot products at once: the same fma chains as dot() (lane j of key k's accumulator sums d = j, j + 8,
// ...), their lanes transposed so that one vector add per fold step folds all eight in dot()'s order.
// Eight independent chains keep the FMA units busy where one chain waits on its own latency.
inline void dot8(const float* a, const float* const b[kLanes], int64_t d, float out[kLanes]) {
  const int64_t d8 = d - d % kLanes;
  __m256 acc[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d8; i += kLanes) {
    const __m256 av = _mm256_loadu_ps(a + i);
    for (int64_t k = 0; k < kLanes; ++k) acc[k] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b[k] + i), acc[k]);
  }
  // Transpose: t[j] holds lane j of every key's accumulator.
  const __m256 u0 = _mm256_unpacklo_ps(acc[0], acc[1]), u1 = _mm256_unpackhi_ps(acc[0], acc[1]);
  const __m256 u2 = _mm256_unpacklo_ps(acc[2], acc[3]), u3 = _mm256_unpackhi_ps(acc[2], acc[3]);
  const __m256 u4 = _mm256_unpacklo_ps(acc[4], acc[5]), u5 = _mm256_unpackhi_ps(acc[4], acc[5]);
  const __m256 u6 = _mm256_unpacklo_ps(acc[6], acc[7]), u7 = _mm256_unpackhi_ps(acc[6], acc[7]);
  const __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
  const __m256 t0 = _mm256_permute2f128_ps(s0, s4, 0x20), t4 = _mm256_permute2f128_ps(s0, s4, 0x31);
  const __m256 t1 = _mm256_permute2f128_ps(s1, s5, 0x20), t5 = _mm256_permute2f128_ps(s1, s5, 0x31);
  const __m256 t2 = _mm256_permute2f128_ps(s2, s6, 0x20), t6 = _mm256_permute2f128_ps(s2, s6, 0x31);
  const __m256 t3 = _mm256_permute2f128_ps(s3, s7, 0x20), t7 = _mm256_permute2f128_ps(s3, s7, 0x31);
  const __m256 folded = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t0, t4), _mm256_add_ps(t2, t6)),
                                      _mm256_add_ps(_mm256_add_ps(t1, t5), _mm256_add_ps(t3, t7)));
  _mm256_storeu_ps(out, folded);
  for (int64_t k = 0; k < kLanes; ++k)
    for (int64_t i = d8; i < d; ++i) out[k] = std::fma(a[i], b[k][i], out[k]);
}

// acc[d] += w_i * v_i[d] for i = 0 .. p, each element's one fma chain ascending in i, for NV
// vectors of d held in registers across the whole walk instead of reloaded and stored at every position.
template <int NV, typename Value>
inline void weighted_sum(const float* e, int64_t p, const Value& value, int64_t offset, float* acc) {
  __m256 a[NV];
  for (int k = 0; k < NV; ++k) a[k] = _mm256_loadu_ps(acc + offset + k * kLanes);
  for (int64_t i = 0; i <= p; ++i) {
    const __m256 wv = _mm256_set1_ps(e[i]);
    const float* v = value(i) + offset;
    for (int k = 0; k < NV; ++k) a[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + k * kLanes), a[k]);
  }
  for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + offset + k * kLanes, a[k]);
}
#endif

// One query row over positions 0 .. p: key(i, k) and value(i) give position i's K and V rows (fp32, D
// floats; k in 0..7 names a scratch row where a K row must be widened, so eight can be live at once).
// e holds at least p + 1 floats, acc D floats. The arithmetic is the header's: the AVX2 path computes
// eight scores at once and keeps the output row in registers, the same fma chains in the same order.
template <typename Key, typename Value>
inline void attend_row(const float* qrow, int64_t p, int64_t d, float sc, const Key& key, const Value& value,
                       float* e, float* acc, float* orow) {
  int64_t i = 0;
#if RLFW_AVX2
  for (; i + kLanes <= p + 1; i += kLanes) {
    const float* keys[kLanes];
    for (int64_t k = 0; k < kLanes; ++k) keys[k] = key(i + k, k);
    dot8(qrow, keys, d, e + i);
    for (int64_t k = 0; k < kLanes; ++k) e[i + k] *= sc;
  }
#endif
  for (; i <= p; ++i) e[i] = dot(qrow, key(i, 0), d) * sc;
  float m = -INFINITY;
  for (i = 0; i <= p; ++i) m = std::max(m, e[i]);
  float denom = 0.0f;
  for (i = 0; i <= p; ++i) {
    e[i] = std::exp(e[i] - m);
    denom += e[i];
  }
  std::fill(acc, acc + d, 0.0f);
  int64_t j = 0;
#if RLFW_AVX2
  constexpr int64_t kBlock = 8 * kLanes;  // eight accumulators in registers
  for (; j + kBlock <= d; j += kBlock) weighted_sum<8>(e, p, value, j, acc);
  for (; j + kLanes <= d; j += kLanes) weighted_sum<1>(e, p, value, j, acc);
#endif
  if (j < d)
    for (i = 0; i <= p; ++i) {
      const float* v = value(i);
      for (int64_t c = j; c < d; ++c) acc[c] = std::fma(e[i], v[c], acc[c]);
    }
  for (j = 0; j < d; ++j) orow[j] = acc[j] / denom;
}

}  // namespace

// q [B, T, Hq, D]; k and v [R, S, Hkv, D] cache rows (fp32, contiguous), batch entry b reading row rows[b]
// (int64 [B]; the engine passes its whole cache and the batch's slots, so nothing is gathered);
// q_pos [B, T] int64. Returns [B, T, Hq, D].
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& q_pos, const torch::Tensor& rows, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_pos.dim() == 2, "attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention: fp32 operands");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && rows.scalar_type() == at::kLong, "attention: int64 indices");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && q_pos.is_contiguous() &&
                  rows.is_contiguous(),
              "attention: contiguous operands");
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t s = k.size(1), hkv = k.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && k.size(3) == d && v.sizes() == k.sizes() && rows.dim() == 1 &&
                  rows.size(0) == b,
              "attention: shapes");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < k.size(0), "attention: cache row ", row[i], " outside 0..", k.size(0) - 1);
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t group = hq / hkv;
  const float sc = static_cast<float>(scale);
  // One task per (batch entry, query head); every query row inside it is computed independently.
  at::parallel_for(0, b * hq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> e(s);
    std::vector<float> acc(d);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t bi = task / hq, h = task % hq, kvh = h / group, ri = row[bi];
      const auto key = [&](int64_t i, int64_t) { return kp + ((ri * s + i) * hkv + kvh) * d; };
      const auto value = [&](int64_t i) { return vp + ((ri * s + i) * hkv + kvh) * d; };
      for (int64_t ti = 0; ti < t; ++ti) {
        const int64_t p = pos[bi * t + ti];
        if (p < 0) continue;
        TORCH_CHECK(p < s, "attention: position ", p, " outside the cache (", s, " slots)");
        attend_row(qp + ((bi * t + ti) * hq + h) * d, p, d, sc, key, value, e.data(), acc.data(),
                   op + ((bi * t + ti) * hq + h) * d);
      }
    }
  });
  return out;
}

namespace {

// The K or V row of one paged position: in place for fp32, widened (exactly) into `scratch` for bf16.
template <typename T>
inline const float* widen(const T* src, float* scratch, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t j = 0; j < d; ++j) scratch[j] = static_cast<float>(src[j]);
    return scratch;
  }
}

template <typename T>
void paged(const float* qp, const T* kv, const int64_t* seq, const int64_t* pos, const int64_t* table,
           int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t block, int64_t max_blocks, int64_t max_pos,
           float sc, float* op) {
  const int64_t group = hq / hkv;
  // One task per (query token, query head).
  at::parallel_for(0, n * hq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> e(max_pos + 1);
    std::vector<float> acc(d), kbuf(kLanes * d), vbuf(d);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t ti = task / hq, h = task % hq, kvh = h / group, p = pos[ti];
      if (p < 0) continue;
      const int64_t* blocks = table + seq[ti] * max_blocks;
      // Block b, head kvh: `block` key rows, then `block` value rows, each d wide.
      const auto at = [&](int64_t i) { return kv + ((blocks[i / block] * hkv + kvh) * 2 * block + i % block) * d; };
      const auto key = [&](int64_t i, int64_t k) { return widen(at(i), kbuf.data() + k * d, d); };
      const auto value = [&](int64_t i) { return widen(at(i) + block * d, vbuf.data(), d); };
      attend_row(qp + (ti * hq + h) * d, p, d, sc, key, value, e.data(), acc.data(), op + (ti * hq + h) * d);
    }
  });
}

}  // namespace

// q [N, Hq, D] fp32: N query tokens of many sequences; kv [NB, Hkv, 2 * BS, D] (fp32 or bf16): per block and
// KV head, BS key rows then BS value rows (vLLM's CPU cache tensor viewed so); token i belongs to sequence
// seq[i] (a row of block_table [R, MB], int64) at position pos[i] (int64; negative: padding, zeros) and sees
// positions 0 .. pos[i] of that sequence. Returns [N, Hq, D].
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& seq,
                              const torch::Tensor& pos, const torch::Tensor& block_table, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && seq.dim() == 1 && pos.dim() == 1 && block_table.dim() == 2,
              "paged_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: fp32 queries");
  TORCH_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16,
              "paged_attention: fp32 or bf16 cache");
  TORCH_CHECK(seq.scalar_type() == at::kLong && pos.scalar_type() == at::kLong &&
                  block_table.scalar_type() == at::kLong,
              "paged_attention: int64 indices");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && seq.is_contiguous() && pos.is_contiguous() &&
                  block_table.is_contiguous(),
              "paged_attention: contiguous operands");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t nb = kv.size(0), hkv = kv.size(1), block = kv.size(2) / 2;
  const int64_t rows = block_table.size(0), max_blocks = block_table.size(1);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && kv.size(3) == d && kv.size(2) % 2 == 0 && seq.size(0) == n &&
                  pos.size(0) == n,
              "paged_attention: shapes");
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  int64_t max_pos = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (pp[i] < 0) continue;
    TORCH_CHECK(sp[i] >= 0 && sp[i] < rows, "paged_attention: sequence ", sp[i], " outside 0..", rows - 1);
    TORCH_CHECK(pp[i] < max_blocks * block, "paged_attention: position ", pp[i], " past the block table");
    for (int64_t j = 0; j <= pp[i] / block; ++j) {
      const int64_t b = table[sp[i] * max_blocks + j];
      TORCH_CHECK(b >= 0 && b < nb, "paged_attention: block ", b, " outside 0..", nb - 1);
    }
    max_pos = std::max(max_pos, pp[i]);
  }
  auto out = torch::zeros_like(q);
  const float sc = static_cast<float>(scale);
  if (kv.scalar_type() == at::kFloat) {
    paged(q.data_ptr<float>(), kv.data_ptr<float>(), sp, pp, table, n, hq, hkv, d, block, max_blocks, max_pos, sc,
          out.data_ptr<float>());
  } else {
    paged(q.data_ptr<float>(), kv.data_ptr<at::BFloat16>(), sp, pp, table, n, hq, hkv, d, block, max_blocks,
          max_pos, sc, out.data_ptr<float>());
  }
  return out;
}
