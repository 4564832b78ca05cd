// The log-softmax's exponential: exp_neg(d) for d = x_j - m, which is never positive (m is the row's max) or
// NaN. Every operation is an fp32 operation rounded once (each fma fused):
//
//   kd = fma(d, kLog2e, 1.5 * 2^23), n = kd - 1.5 * 2^23  the integer nearest to d kLog2e (log2(e) in fp32)
//   r = fma(-n, kLn2Hi, d), then r = fma(-n, kLn2Lo, r)  d - n ln 2 (kLn2Hi + kLn2Lo = ln 2)
//   q = ((((c0 r + c1) r + c2) r + c3) r + c4) r + c5      each step an fma
//   exp_neg(d) = (fma(q, r * r, r) + 1) * 2^n           the last product exact (a normal float)
//
// with 0 for d < -87 (-inf included; exp(-87) is about 1.6e-38, and every float it returns is normal) and
// d + d for a NaN. The polynomial is Cephes' expf minimax fit on |r| <= ln(2) / 2; the result is within
// 1 ulp of exp on [-87, 0] (checked on every float there: bench/exp_exhaustive.py). It needs about half the
// instructions of exp_f32 (exp_f32.h), which computes in double to give glibc's expf bits; the sum it feeds
// is in double and rounded to fp32 once, so an ulp in one term almost never reaches the log-softmax.
// The scalar, eight-lane and sixteen-lane paths compute the same operations lane by lane.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace rlfw_exp_neg {

constexpr float kLog2e = 0x1.715476p+0f;  // log2(e) rounded to fp32
constexpr float kShift = 0x1.8p+23f;      // adding it rounds to an integer in the low bits
constexpr float kLn2Hi = 0x1.63p-1f;      // 0.693359375: few bits, so n * kLn2Hi is exact
constexpr float kLn2Lo = -0x1.bd0106p-13f;  // ln 2 - kLn2Hi, rounded to fp32
constexpr float kC0 = 1.9875691500e-4f, kC1 = 1.3981999507e-3f, kC2 = 8.3334519073e-3f,
                kC3 = 4.1665795894e-2f, kC4 = 1.6666665459e-1f, kC5 = 5.0000001201e-1f;
constexpr float kLow = -87.0f;  // exp_neg is 0 below
constexpr uint32_t kBias = 127;  // fp32 exponent bias: 2^n has bits (n + 127) << 23

inline float exp_neg(float d) {
  if (d != d) return d + d;
  if (d < kLow) return 0.0f;
  const float kd = std::fma(d, kLog2e, kShift);
  const float n = kd - kShift;
  float r = std::fma(-n, kLn2Hi, d);
  r = std::fma(-n, kLn2Lo, r);
  float q = std::fma(kC0, r, kC1);
  q = std::fma(q, r, kC2);
  q = std::fma(q, r, kC3);
  q = std::fma(q, r, kC4);
  q = std::fma(q, r, kC5);
  const float r2 = r * r;
  const float y = std::fma(q, r2, r) + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &kd, sizeof bits);  // the low bits of kd hold n + 1.5 * 2^23's
  bits = (bits + kBias) << 23;           // 1.5 * 2^23's bits vanish in the shift
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_neg8(__m256 d) {
  const __m256 shift = _mm256_set1_ps(kShift);
  const __m256 kd = _mm256_fmadd_ps(d, _mm256_set1_ps(kLog2e), shift);
  const __m256 n = _mm256_sub_ps(kd, shift);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), d);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(kC0), r, _mm256_set1_ps(kC1));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC2));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC3));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC4));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC5));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(kd), _mm256_set1_epi32(kBias)), 23);
  __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(d, _mm256_set1_ps(kLow), _CMP_LT_OQ));
  return _mm256_blendv_ps(out, _mm256_add_ps(d, d), _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__)
inline __m512 exp_neg16(__m512 d) {
  const __m512 shift = _mm512_set1_ps(kShift);
  const __m512 kd = _mm512_fmadd_ps(d, _mm512_set1_ps(kLog2e), shift);
  const __m512 n = _mm512_sub_ps(kd, shift);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), d);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(kC0), r, _mm512_set1_ps(kC1));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC2));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC3));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC4));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC5));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(kd), _mm512_set1_epi32(kBias)), 23);
  __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(d, _mm512_set1_ps(kLow), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), _mm512_add_ps(d, d));
}
#endif

}  // namespace rlfw_exp_neg
