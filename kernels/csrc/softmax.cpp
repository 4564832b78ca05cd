// The log-softmax of each row of x [R, V]: log_softmax(x)_j = (x_j - m) - lse, lse = log(s), with the row's
// max m and the sum s of exp(x_j - m). One pass finds the max, a second sums the exponentials without writing
// them, a third (when the log-softmax itself is asked for, not only m and lse) writes the row; each row is
// one thread's, and a real vocabulary's row (600 KiB) stays in cache across the passes.
//
// m is the row's max with -0.0 turned into +0.0 (NaN if the row holds one). s is the sum of exp_neg(x_j - m)
// (exp_neg.h: an fp32 exp for the never-positive differences, each rounded to fp32 first) in double: element j goes into lane j mod 16, each lane
// adds in ascending j, and the lanes are folded by halving (lane l += lane l + h for h = 8, 4, 2, 1). lse is
// log_f64(s) rounded to fp32 once. Every row is one thread's, in that order, on every build (AVX-512, AVX2/FMA
// or portable: the same additions lane by lane; bench/softmax_builds.py compares the three), so the bits
// depend on the row alone. A row of -inf only has m = -inf and gives NaN everywhere, as does a row holding a
// NaN; which NaN (its sign) follows the x86 rule that an operation returns its first NaN operand.
//
// log_f64(s) is the natural log in double from s = f 2^e (f in (sqrt(2) / 2, sqrt(2)]): with t = (f - 1) / (f + 1),
// log f = 2 atanh t = t (2 + t^2 (2/3 + t^2 (2/5 + ... + t^2 (2/23)))) evaluated in that order, plus e ln 2.
// Its own arithmetic (no C library); its error is a few units of double's last place, far below fp32's
// rounding. One call per row.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_f32.h"  // RLFW_AVX2 and RLFW_EXP16: which vector paths this build has
#include "exp_neg.h"

namespace {

using rlfw_exp_neg::exp_neg;

constexpr int64_t kLanes = 16;      // lanes of the sum (the definition above)
constexpr int64_t kGrain = 1 << 16;  // elements per parallel task
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kSqrt2 = 1.41421356237309504880;

// The natural log of x > 0 in double, as the header states.
double log_f64(double x) {
  if (!(x > 0.0)) return x == 0.0 ? -INFINITY : NAN;  // negative or NaN: NaN
  if (x == INFINITY) return x;
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int64_t e = static_cast<int64_t>(bits >> 52) - 1023;
  if (e == -1023) {  // subnormal: scale into the normal range first
    const double y = x * 0x1p64;
    std::memcpy(&bits, &y, sizeof bits);
    e = static_cast<int64_t>(bits >> 52) - 1023 - 64;
  }
  const uint64_t fbits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
  double f;
  std::memcpy(&f, &fbits, sizeof f);  // x = f 2^e, f in [1, 2)
  if (f > kSqrt2) {
    f *= 0.5;
    ++e;
  }
  const double t = (f - 1.0) / (f + 1.0), t2 = t * t;  // |t| <= 0.1716
  double p = 2.0 / 23;
  for (int k = 10; k >= 0; --k) p = 2.0 / (2 * k + 1) + t2 * p;
  return t * p + static_cast<double>(e) * kLn2;
}

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

double row_exp_sum(const float* x, int64_t v, float m) {
  alignas(64) double lane[kLanes] = {};
  int64_t j = 0;
#if RLFW_EXP16
  const __m512 mv = _mm512_set1_ps(m);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (; j + kLanes <= v; j += kLanes) {
    const __m512 e = rlfw_exp_neg::exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
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
      const __m256 e = rlfw_exp_neg::exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * h), mv));
      acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
  }
  for (int64_t k = 0; k < 4; ++k) _mm256_store_pd(lane + 4 * k, acc[k]);
#endif
  for (; j < v; ++j) lane[j % kLanes] += static_cast<double>(exp_neg(x[j] - m));
  for (int64_t h = kLanes / 2; h > 0; h /= 2)
    for (int64_t l = 0; l < h; ++l) lane[l] += lane[l + h];
  return lane[0];
}

// out = (x - m) - lse over a row.
void write_row(const float* x, int64_t v, float m, float lse, float* out) {
  int64_t j = 0;
#if RLFW_EXP16
  const __m512 mv = _mm512_set1_ps(m), lv = _mm512_set1_ps(lse);
  for (; j + kLanes <= v; j += kLanes)
    _mm512_storeu_ps(out + j, _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv), lv));
#elif RLFW_AVX2
  const __m256 mv = _mm256_set1_ps(m), lv = _mm256_set1_ps(lse);
  for (; j + 8 <= v; j += 8)
    _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv), lv));
#endif
  for (; j < v; ++j) out[j] = (x[j] - m) - lse;
}

void check_rows(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous 2-d fp32 CPU tensor");
  TORCH_CHECK(x.size(1) > 0, op, ": rows must not be empty");
}

// For each row r of x: m[r], lse[r], and (when out is given) the row's log-softmax written to out[r].
void rows(const torch::Tensor& x, float* mp, float* lp, float* out) {
  const int64_t n = x.size(0), v = x.size(1);
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, kGrain / v), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * v;
      const float m = row_max(row, v);
      const float lse = static_cast<float>(log_f64(row_exp_sum(row, v, m)));
      if (mp != nullptr) mp[r] = m;
      if (lp != nullptr) lp[r] = lse;
      if (out != nullptr) write_row(row, v, m, lse, out + r * v);
    }
  });
}

}  // namespace

// (m [R], lse [R]) of each row of x [R, V] as defined at the top of this file.
std::vector<torch::Tensor> softmax_stats(const torch::Tensor& x) {
  check_rows(x, "softmax_stats");
  auto m = torch::empty({x.size(0)}, x.options()), lse = torch::empty({x.size(0)}, x.options());
  rows(x, m.data_ptr<float>(), lse.data_ptr<float>(), nullptr);
  return {m, lse};
}

// The log-softmax of each row of x [R, V] written into out [R, V] (the same bits as (x - m) - lse from
// softmax_stats).
void log_softmax_into(const torch::Tensor& x, torch::Tensor out) {
  check_rows(x, "log_softmax_into");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.device().is_cpu(),
              "log_softmax_into: out must be a contiguous fp32 CPU tensor shaped like x");
  rows(x, nullptr, nullptr, out.data_ptr<float>());
}

// The log-softmax of row r of x [R, V] at ids[r]: (x[r, ids[r]] - m) - lse, the same operations as the
// written row's element, without writing the row.
torch::Tensor token_logp(const torch::Tensor& x, const torch::Tensor& ids) {
  check_rows(x, "token_logp");  // softmax_stats checks it too; here first, so the op named is this one
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == x.size(0) && ids.device().is_cpu(),
              "token_logp: ids must be int64 [R]");
  const auto idc = ids.contiguous();
  const int64_t n = x.size(0), v = x.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < v, "token_logp: id ", ip[r], " is outside the vocabulary of ", v);
  const auto stats = softmax_stats(x);
  auto out = torch::empty({n}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* mp = stats[0].data_ptr<float>();
  const float* lp = stats[1].data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) op[r] = (xs[r * v + ip[r]] - mp[r]) - lp[r];
  return out;
}

// exp_neg elementwise over a contiguous fp32 tensor (tests): sixteen or eight lanes at a time where the
// build has them, then one at a time, as the sum takes them.
torch::Tensor exp_neg_tensor(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "exp_neg: contiguous fp32 CPU input");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = x.numel();
  int64_t i = 0;
#if RLFW_EXP16
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(op + i, rlfw_exp_neg::exp_neg16(_mm512_loadu_ps(xp + i)));
#elif RLFW_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(op + i, rlfw_exp_neg::exp_neg8(_mm256_loadu_ps(xp + i)));
#endif
  for (; i < n; ++i) op[i] = exp_neg(xp[i]);
  return out;
}

// log_f64 elementwise on fp64 (tests).
torch::Tensor log_f64_tensor(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kDouble && x.is_contiguous(), "log: contiguous fp64 input");
  auto out = torch::empty_like(x);
  const double* xp = x.data_ptr<double>();
  double* op = out.data_ptr<double>();
  for (int64_t i = 0; i < x.numel(); ++i) op[i] = log_f64(xp[i]);
  return out;
}
