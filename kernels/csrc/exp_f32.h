// The kernels' own fp32 exp, shared by the attention's softmax and SiLU (one definition, so every op that
// takes an exponential gets the same bits on every machine).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RLFW_AVX2 1
#else
#define RLFW_AVX2 0
#endif

namespace rlfw_exp {

constexpr int64_t kExpLanes = 8;  // floats per exp8 call

// exp for fp32, computed in double: x / ln2 = k / 32 + r, exp(x) = 2^(k/32) * p(r) with a cubic p, rounded to
// float once. This is the algorithm of glibc's expf (2.28 and later) with its fma-contracted evaluation, and
// it gives the same float as that expf on every input (checked on all 2^32 floats against glibc 2.36's
// libm on an AVX2/FMA machine: bench/exp_exhaustive.py). Written out here so the kernels' bits do not depend
// on which C library or which of its variants a machine has, and so eight can be computed at once.
constexpr uint64_t kExp2Table[32] = {  // bits of 2^(i/32), correctly rounded, minus i << 47
    0x3ff0000000000000ULL, 0x3fefd9b0d3158574ULL, 0x3fefb5586cf9890fULL, 0x3fef9301d0125b51ULL,
    0x3fef72b83c7d517bULL, 0x3fef54873168b9aaULL, 0x3fef387a6e756238ULL, 0x3fef1e9df51fdee1ULL,
    0x3fef06fe0a31b715ULL, 0x3feef1a7373aa9cbULL, 0x3feedea64c123422ULL, 0x3feece086061892dULL,
    0x3feebfdad5362a27ULL, 0x3feeb42b569d4f82ULL, 0x3feeab07dd485429ULL, 0x3feea47eb03a5585ULL,
    0x3feea09e667f3bcdULL, 0x3fee9f75e8ec5f74ULL, 0x3feea11473eb0187ULL, 0x3feea589994cce13ULL,
    0x3feeace5422aa0dbULL, 0x3feeb737b0cdc5e5ULL, 0x3feec49182a3f090ULL, 0x3feed503b23e255dULL,
    0x3feee89f995ad3adULL, 0x3feeff76f2fb5e47ULL, 0x3fef199bdd85529cULL, 0x3fef3720dcef9069ULL,
    0x3fef5818dcfba487ULL, 0x3fef7c97337b9b5fULL, 0x3fefa4afa2a490daULL, 0x3fefd0765b6e4540ULL};
constexpr double kExpInvLn2 = 0x1.71547652b82fep+0 * 32;  // 32 / ln 2
constexpr double kExpShift = 0x1.8p+52;                   // adding it rounds to an integer in the low bits
constexpr double kExpC0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32, kExpC1 = 0x1.ebfce50fac4f3p-3 / 32 / 32,
                 kExpC2 = 0x1.62e42ff0c52d6p-1 / 32;
constexpr uint32_t kExpLarge = 0x42b00000;  // |x| >= 88 (or not finite) takes the edge cases
constexpr float kExpHigh = 0x1.62e42ep6f;   // exp_f32 is +inf above (log(FLT_MAX))
constexpr float kExpLow = -0x1.9fe368p6f;  // and 0 below (log of half the least subnormal)

inline float exp_core(float x) {
  const double xd = x;
  double kd = std::fma(kExpInvLn2, xd, kExpShift);
  uint64_t ki;
  std::memcpy(&ki, &kd, sizeof ki);
  kd -= kExpShift;
  const double r = std::fma(kExpInvLn2, xd, -kd);
  const uint64_t t = kExp2Table[ki % 32] + (ki << 47);
  double s;
  std::memcpy(&s, &t, sizeof s);
  const double z = std::fma(kExpC0, r, kExpC1), r2 = r * r;
  const double y = std::fma(z, r2, std::fma(kExpC2, r, 1.0));
  return static_cast<float>(y * s);
}

inline float exp_f32(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) >= kExpLarge) {  // |x| >= 88, infinities, NaN
    if (x == -INFINITY) return 0.0f;
    if (!(x < INFINITY)) return x + x;       // NaN (quietened) or +inf
    if (x > kExpHigh) return INFINITY;
    if (x < kExpLow) return 0.0f;
  }
  return exp_core(x);
}

#if RLFW_AVX2
// exp_core on four doubles (widened floats), rounded to four floats: the same operations lane by lane.
inline __m128 exp_core4(__m256d xd) {
  const __m256d inv = _mm256_set1_pd(kExpInvLn2), shift = _mm256_set1_pd(kExpShift);
  __m256d kd = _mm256_fmadd_pd(inv, xd, shift);
  const __m256i ki = _mm256_castpd_si256(kd);
  kd = _mm256_sub_pd(kd, shift);
  const __m256d r = _mm256_fmsub_pd(inv, xd, kd);
  const __m256i idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
  const __m256i tab = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kExp2Table), idx, 8);
  const __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(tab, _mm256_slli_epi64(ki, 47)));
  const __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(kExpC0), r, _mm256_set1_pd(kExpC1));
  const __m256d r2 = _mm256_mul_pd(r, r);
  const __m256d y = _mm256_fmadd_pd(z, r2, _mm256_fmadd_pd(_mm256_set1_pd(kExpC2), r, _mm256_set1_pd(1.0)));
  return _mm256_cvtpd_ps(_mm256_mul_pd(y, s));
}

// exp_f32 of eight floats, branch-free: exp_core on every lane, then the edge cases of exp_f32 (below kExpLow
// or -inf: 0; above kExpHigh or +inf: +inf; NaN: x + x) chosen lane by lane.
inline __m256 exp8(__m256 x) {
  __m256 out = _mm256_set_m128(exp_core4(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))),
                               exp_core4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
  out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ));
  out = _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(kExpHigh), _CMP_GT_OQ));
  return _mm256_blendv_ps(out, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

#if RLFW_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
#define RLFW_EXP16 1
// exp_core on eight doubles, rounded to eight floats: exp_core4's operations on wider registers, the table
// read with two-register permutes instead of a gather.
inline __m256 exp_core8(__m512d xd) {
  const __m512d inv = _mm512_set1_pd(kExpInvLn2), shift = _mm512_set1_pd(kExpShift);
  __m512d kd = _mm512_fmadd_pd(inv, xd, shift);
  const __m512i ki = _mm512_castpd_si512(kd);
  kd = _mm512_sub_pd(kd, shift);
  const __m512d r = _mm512_fmsub_pd(inv, xd, kd);
  const __m512i* table = reinterpret_cast<const __m512i*>(kExp2Table);
  const __m512i low = _mm512_permutex2var_epi64(_mm512_loadu_si512(table), ki, _mm512_loadu_si512(table + 1));
  const __m512i high = _mm512_permutex2var_epi64(_mm512_loadu_si512(table + 2), ki, _mm512_loadu_si512(table + 3));
  const __m512i tab = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), low, high);
  const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(tab, _mm512_slli_epi64(ki, 47)));
  const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(kExpC0), r, _mm512_set1_pd(kExpC1));
  const __m512d r2 = _mm512_mul_pd(r, r);
  const __m512d y = _mm512_fmadd_pd(z, r2, _mm512_fmadd_pd(_mm512_set1_pd(kExpC2), r, _mm512_set1_pd(1.0)));
  return _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
}

// exp_f32 of sixteen floats, branch-free as exp8.
inline __m512 exp16(__m512 x) {
  const __m512 core = _mm512_insertf32x8(
      _mm512_castps256_ps512(exp_core8(_mm512_cvtps_pd(_mm512_castps512_ps256(x)))),
      exp_core8(_mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))), 1);
  __m512 out = _mm512_mask_mov_ps(core, _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ),
                                  _mm512_setzero_ps());
  out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpHigh), _CMP_GT_OQ),
                           _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_add_ps(x, x));
}
#else
#define RLFW_EXP16 0
#endif

}  // namespace rlfw_exp
