// The log-softmax's row statistics: per row of x [R, V], the max m and the sum s of exp(x_j - m), from which
// log_softmax(x)_j = (x_j - m) - log(s). One pass finds the max, a second sums the exponentials without
// writing them; a real vocabulary's row is read twice and nothing of its size is allocated.
//
// m is the row's max with -0.0 turned into +0.0 (NaN if the row holds one). s is the sum of exp_f32(x_j - m)
// (exp_f32.h, each difference rounded to fp32 first) in double: element j goes into lane j mod 16, each lane
// adds in ascending j, and the lanes are folded by halving (lane l += lane l + h for h = 8, 4, 2, 1); the
// total is rounded to fp32 once. Every row is one thread's, in that order, on every build (AVX-512, AVX2/FMA
// or portable: the same additions lane by lane), so the bits depend on the row alone.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_f32.h"

namespace {

using rlfw_exp::exp_f32;

constexpr int64_t kLanes = 16;      // lanes of the sum (the definition above)
constexpr int64_t kGrain = 1 << 16;  // elements per parallel task

float row_max(const float* x, int64_t v) {
  float m = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#if RLFW_EXP16
  __m512 mv = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const __m512 xv = _mm512_loadu_ps(x + j);
    mv = _mm512_max_ps(mv, xv);
    unordered |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(mv);
  nan = unordered != 0;
#endif
  for (; j < v; ++j) {
    nan |= x[j] != x[j];
    m = x[j] > m ? x[j] : m;
  }
  return nan ? NAN : m + 0.0f;  // a max is exact; only the sign of a zero max depends on the scan
}

float row_exp_sum(const float* x, int64_t v, float m) {
  alignas(64) double lane[kLanes] = {};
  int64_t j = 0;
#if RLFW_EXP16
  const __m512 mv = _mm512_set1_ps(m);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (; j + kLanes <= v; j += kLanes) {
    const __m512 e = rlfw_exp::exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
  }
  _mm512_store_pd(lane, lo);
  _mm512_store_pd(lane + 8, hi);
#elif RLFW_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (; j + kLanes <= v; j += kLanes) {
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 e = rlfw_exp::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * h), mv));
      acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
  }
  for (int64_t k = 0; k < 4; ++k) _mm256_store_pd(lane + 4 * k, acc[k]);
#endif
  for (; j < v; ++j) lane[j % kLanes] += static_cast<double>(exp_f32(x[j] - m));
  for (int64_t h = kLanes / 2; h > 0; h /= 2)
    for (int64_t l = 0; l < h; ++l) lane[l] += lane[l + h];
  return static_cast<float>(lane[0]);
}

}  // namespace

// (max [R], sum [R]) of each row of x [R, V] as defined at the top of this file.
std::vector<torch::Tensor> softmax_stats(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "softmax_stats: x must be a contiguous 2-d fp32 CPU tensor");
  const int64_t rows = x.size(0), v = x.size(1);
  TORCH_CHECK(v > 0, "softmax_stats: rows must not be empty");
  auto opts = x.options();
  auto maxes = torch::empty({rows}, opts), sums = torch::empty({rows}, opts);
  const float* xs = x.data_ptr<float>();
  float* mp = maxes.data_ptr<float>();
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / v), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * v;
      mp[r] = row_max(row, v);
      sp[r] = row_exp_sum(row, v, mp[r]);
    }
  });
  return {maxes, sums};
}
