// The elementwise ops around the linears: RoPE, SwiGLU's gate and RMSNorm, forward and backward, each one
// pass over memory instead of a chain of torch ops or autograd nodes.
//
// RoPE's forward is the same IEEE operations as the torch spelling x * cos + rotate_half(x) * sin (two
// rounded products, one rounded sum; the build's -ffp-contract=off keeps them unfused), so it gives the
// same bits as the spelling it replaces, on the engine's and on the trainer's side. SiLU-mul's forward is
// (g / (1 + exp(-g))) * u with the kernels' own exp (exp_f32.h), one rounding per operation. RMSNorm's
// forward sums a row's squares in sixteen lanes (element i into lane i mod 16, an fma chain per lane, i
// ascending), folds the lanes by halving (lane j += lane j + h for h = 8, 4, 2, 1), then r = 1 / sqrt(sum / D
// + eps) and y = w * (x * r). Each element or row is computed by one thread in that order on every build
// (AVX2/FMA or portable), so the forward's bits depend on the row alone. The backward passes
// need no bits of their own to match (they are gradients), only a fixed order: every output element is
// computed by one thread from its own inputs, and RMSNorm's weight gradient sums its rows in ascending
// order per column, so the results do not depend on the number of threads.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "exp_f32.h"

namespace {

constexpr int64_t kGrain = 16384;  // elements per parallel chunk (well above a thread's start-up cost)

void check_f32(const torch::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), op, ": ", name,
              " must be a contiguous fp32 CPU tensor");
}

}  // namespace

// Calls body(row, cos, sin, out) for every head row [D] of in [B, T, H, D] with its token's cos/sin [D]
// (from [B, T, D]); out is a new tensor shaped like in.
template <typename Body>
torch::Tensor per_head_row(const char* op, const torch::Tensor& in, const torch::Tensor& cos,
                           const torch::Tensor& sin, const Body& body) {
  check_f32(in, op, "input");
  check_f32(cos, op, "cos");
  check_f32(sin, op, "sin");
  TORCH_CHECK(in.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == in.size(0) &&
                  cos.size(1) == in.size(1) && cos.size(2) == in.size(3),
              op, ": input [B, T, H, D] with cos/sin [B, T, D]");
  const int64_t tokens = in.size(0) * in.size(1), heads = in.size(2), d = in.size(3);
  auto out = torch::empty_like(in);
  const float* src = in.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, heads * d));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t hd = 0; hd < heads; ++hd)
        body(src + (t * heads + hd) * d, cs + t * d, sn + t * d, dst + (t * heads + hd) * d);
  });
  return out;
}

// x [B, T, H, D], cos/sin [B, T, D], h = D / 2 (rounded down), n = D - h:
// out[i] = x_i cos_i - x_{i+h} sin_i (i < n) and x_i cos_i + x_{i-n} sin_i (i >= n), exactly as torch computes
// x * cos + cat(-x[h:], x[:h]) * sin (both halves equal when D is even).
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t d = x.dim() == 4 ? x.size(3) : 0, h = d / 2, n = d - h;
  return per_head_row("rope", x, cos, sin, [=](const float* xr, const float* c, const float* s, float* o) {
    for (int64_t i = 0; i < n; ++i) {
      const float a = xr[i] * c[i];
      const float b = -xr[i + h] * s[i];
      o[i] = a + b;
    }
    for (int64_t i = n; i < d; ++i) {
      const float a = xr[i] * c[i];
      const float b = xr[i - n] * s[i];
      o[i] = a + b;
    }
  });
}

// The gradient of rope with respect to x: dx_j = g_j cos_j, then dx_{i+h} -= g_i sin_i (i < n) and
// dx_{i-n} += g_i sin_i (i >= n).
torch::Tensor rope_backward(const torch::Tensor& grad, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t d = grad.dim() == 4 ? grad.size(3) : 0, h = d / 2, n = d - h;
  return per_head_row("rope_backward", grad, cos, sin,
                      [=](const float* g, const float* c, const float* s, float* o) {
                        for (int64_t j = 0; j < d; ++j) o[j] = g[j] * c[j];
                        for (int64_t i = 0; i < n; ++i) o[i + h] -= g[i] * s[i];
                        for (int64_t i = n; i < d; ++i) o[i - n] += g[i] * s[i];
                      });
}

// out = silu(g) * u with silu(g) = g / denom, denom = 1 + exp(-g) (kept by the forward). With s = 1 / denom:
// du = grad * g * s and dg = grad * u * s * (1 + g * (1 - s)).
std::vector<torch::Tensor> silu_mul_backward(const torch::Tensor& grad, const torch::Tensor& g,
                                             const torch::Tensor& u, const torch::Tensor& denom) {
  check_f32(grad, "silu_mul_backward", "grad");
  check_f32(g, "silu_mul_backward", "gate");
  check_f32(u, "silu_mul_backward", "up");
  check_f32(denom, "silu_mul_backward", "denom");
  TORCH_CHECK(grad.sizes() == g.sizes() && u.sizes() == g.sizes() && denom.sizes() == g.sizes(),
              "silu_mul_backward: grad, gate, up and denom must have one shape");
  auto dg = torch::empty_like(g);
  auto du = torch::empty_like(u);
  const float* gr = grad.data_ptr<float>();
  const float* gs = g.data_ptr<float>();
  const float* us = u.data_ptr<float>();
  const float* dn = denom.data_ptr<float>();
  float* dgo = dg.data_ptr<float>();
  float* duo = du.data_ptr<float>();
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float s = 1.0f / dn[i];
      const float x = gs[i];
      duo[i] = gr[i] * (x * s);
      dgo[i] = gr[i] * us[i] * s * (1.0f + x * (1.0f - s));
    }
  });
  return {dg, du};
}

// y = w * (x * r) over rows of D with r = rsqrt(mean(x^2) + eps) (kept by the forward), x [R, D]:
// dx = r * (w g) - x * r^3 * sum(w g x) / D per row; dw = sum over rows of g * x * r, rows ascending.
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& grad, const torch::Tensor& x,
                                             const torch::Tensor& r, const torch::Tensor& w) {
  check_f32(grad, "rms_norm_backward", "grad");
  check_f32(x, "rms_norm_backward", "x");
  check_f32(r, "rms_norm_backward", "rsqrt");
  check_f32(w, "rms_norm_backward", "weight");
  TORCH_CHECK(x.dim() == 2 && grad.sizes() == x.sizes() && r.dim() == 1 && r.size(0) == x.size(0) &&
                  w.dim() == 1 && w.size(0) == x.size(1),
              "rms_norm_backward: grad and x [R, D], rsqrt [R], weight [D]");
  const int64_t rows = x.size(0), d = x.size(1);
  auto dx = torch::empty_like(x);
  auto dw = torch::zeros_like(w);
  const float* g = grad.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const float* rs = r.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* dxo = dx.data_ptr<float>();
  float* dwo = dw.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const float* gr = g + row * d;
      const float* xr = xs + row * d;
      float* o = dxo + row * d;
      float dot = 0.0f;
      for (int64_t j = 0; j < d; ++j) dot += ws[j] * gr[j] * xr[j];
      const float rr = rs[row];
      const float c = rr * rr * rr * dot / static_cast<float>(d);
      for (int64_t j = 0; j < d; ++j) o[j] = rr * (ws[j] * gr[j]) - c * xr[j];
    }
  });
  constexpr int64_t kCols = 16;  // columns per task: each column's rows are summed by one thread in order
  at::parallel_for(0, (d + kCols - 1) / kCols, 1, [&](int64_t c0, int64_t c1) {
    const int64_t j0 = c0 * kCols, j1 = std::min(d, c1 * kCols);
    for (int64_t row = 0; row < rows; ++row) {
      const float* gr = g + row * d;
      const float* xr = xs + row * d;
      const float rr = rs[row];
      for (int64_t j = j0; j < j1; ++j) dwo[j] += gr[j] * (xr[j] * rr);
    }
  });
  return {dx, dw};
}

namespace {

constexpr int64_t kSumLanes = 16;  // RMSNorm's sum of squares: lanes of the fma chains

// Sum of x[i]^2 over i < d in the order stated at the top of this file.
inline float sum_squares(const float* x, int64_t d) {
  alignas(32) float lane[kSumLanes] = {};
  int64_t i = 0;
#if RLFW_AVX2
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (; i + kSumLanes <= d; i += kSumLanes) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  _mm256_store_ps(lane, lo);
  _mm256_store_ps(lane + 8, hi);
#endif
  for (; i < d; ++i) lane[i % kSumLanes] = std::fma(x[i], x[i], lane[i % kSumLanes]);
  for (int64_t h = kSumLanes / 2; h > 0; h /= 2)
    for (int64_t j = 0; j < h; ++j) lane[j] += lane[j + h];
  return lane[0];
}

}  // namespace

// y = w * (x * r) per row of x [R, D] with r = 1 / sqrt(sum(x^2) / D + eps); returns (y [R, D], r [R]) (r is
// what the backward reads).
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "rms_norm", "x");
  check_f32(w, "rms_norm", "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm: x [R, D] and weight [D]");
  const int64_t rows = x.size(0), d = x.size(1);
  auto y = torch::empty_like(x);
  auto r = torch::empty({rows}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  float* rs = r.data_ptr<float>();
  const float e = static_cast<float>(eps), n = static_cast<float>(d);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, d)), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const float* xr = xs + row * d;
      float* o = ys + row * d;
      const float rr = 1.0f / std::sqrt(sum_squares(xr, d) / n + e);
      rs[row] = rr;
      int64_t j = 0;
#if RLFW_AVX2
      const __m256 rv = _mm256_set1_ps(rr);
      for (; j + 8 <= d; j += 8)
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(ws + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), rv)));
#endif
      for (; j < d; ++j) o[j] = ws[j] * (xr[j] * rr);
    }
  });
  return {y, r};
}

// out = (g / (1 + exp(-g))) * u elementwise; with keep_denom also returns 1 + exp(-g) (the backward's input).
std::vector<torch::Tensor> silu_mul(const torch::Tensor& g, const torch::Tensor& u, bool keep_denom) {
  check_f32(g, "silu_mul", "gate");
  check_f32(u, "silu_mul", "up");
  TORCH_CHECK(u.sizes() == g.sizes(), "silu_mul: gate and up must have one shape");
  auto out = torch::empty_like(g);
  auto denom = keep_denom ? torch::empty_like(g) : torch::Tensor();
  const float* gs = g.data_ptr<float>();
  const float* us = u.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* dn = keep_denom ? denom.data_ptr<float>() : nullptr;
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if RLFW_EXP16
    const __m512 one16 = _mm512_set1_ps(1.0f), sign16 = _mm512_set1_ps(-0.0f);
    for (; i + 16 <= i1; i += 16) {
      const __m512 x = _mm512_loadu_ps(gs + i);
      const __m512 den = _mm512_add_ps(one16, rlfw_exp::exp16(_mm512_xor_ps(x, sign16)));
      if (dn != nullptr) _mm512_storeu_ps(dn + i, den);
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(x, den), _mm512_loadu_ps(us + i)));
    }
#endif
#if RLFW_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + rlfw_exp::kExpLanes <= i1; i += rlfw_exp::kExpLanes) {
      const __m256 x = _mm256_loadu_ps(gs + i);
      const __m256 den = _mm256_add_ps(one, rlfw_exp::exp8(_mm256_xor_ps(x, sign)));
      if (dn != nullptr) _mm256_storeu_ps(dn + i, den);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, den), _mm256_loadu_ps(us + i)));
    }
#endif
    for (; i < i1; ++i) {
      const float den = 1.0f + rlfw_exp::exp_f32(-gs[i]);
      if (dn != nullptr) dn[i] = den;
      o[i] = (gs[i] / den) * us[i];
    }
  });
  if (keep_denom) return {out, denom};
  return {out};
}
