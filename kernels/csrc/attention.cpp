// Batch-invariant causal attention for CPUs over the slotted K/V layout [B, S, H_kv, D].
//
// Each query row (batch entry, position p, query head) is computed alone, by one thread, in an order that
// depends on p and the head size only: scores s_i = q . k_i for i = 0 .. p (each dot product: eight lane
// sums of fma chains over d = j, j + 8, ..., folded as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
// then the d tail by an ascending fma chain, then times the scale); m = max s_i; e_i = exp(s_i - m);
// denominator = sum of e_i, i ascending; out[d] = (fma chain over i ascending of e_i * v_i[d]) / denominator.
// Nothing past p is read, so stale or non-finite cache contents there cannot reach a result, and a prefill,
// a chunked prefill, a decode step and the trainer's forward give the same bits for the same query.
// A query with a negative position (padding) gets zeros.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
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

// acc[d] = fma(w, v[d], acc[d]) for every d (each lane its own chain).
inline void axpy(float w, const float* v, float* acc, int64_t d) {
  int64_t i = 0;
#if RLFW_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + kLanes <= d; i += kLanes)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < d; ++i) acc[i] = std::fma(w, v[i], acc[i]);
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
      for (int64_t ti = 0; ti < t; ++ti) {
        const int64_t p = pos[bi * t + ti];
        if (p < 0) continue;
        TORCH_CHECK(p < s, "attention: position ", p, " outside the cache (", s, " slots)");
        const float* qrow = qp + ((bi * t + ti) * hq + h) * d;
        float m = -INFINITY;
        for (int64_t i = 0; i <= p; ++i) {
          e[i] = dot(qrow, kp + ((ri * s + i) * hkv + kvh) * d, d) * sc;
          m = std::max(m, e[i]);
        }
        float denom = 0.0f;
        for (int64_t i = 0; i <= p; ++i) {
          e[i] = std::exp(e[i] - m);
          denom += e[i];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t i = 0; i <= p; ++i) axpy(e[i], vp + ((ri * s + i) * hkv + kvh) * d, acc.data(), d);
        float* orow = op + ((bi * t + ti) * hq + h) * d;
        for (int64_t j = 0; j < d; ++j) orow[j] = acc[j] / denom;
      }
    }
  });
  return out;
}
