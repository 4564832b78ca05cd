// Batch-invariant fp32 linear for CPUs: y[m, n] = sum_k x[m, k] * w[n, k], one fixed order per element.
//
// Every output element is one fma chain over k ascending, starting from +0: y = fma(x[k], w[n, k], y).
// fma rounds once and is exactly specified, so the AVX2 path, its masked tails and the portable loop give
// the same bits; blocking (rows, columns, threads) only decides which elements are computed together.
// No padding, no K tiles, no dependence on a BLAS library's shape-specific paths.

#include <torch/extension.h>

#include <algorithm>
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

constexpr int64_t kPanel = 16;  // output features per packed weight panel (two 8-lane vectors)
constexpr int64_t kRows = 6;    // rows per register block
constexpr int64_t kBlockBytes = 256 * 1024;  // rows of x per cache block (see linear())

// w [N, K] -> panels [ceil(N / 16)][K][16], zero past N (those lanes are computed, never stored).
std::vector<float> pack(const float* w, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  std::vector<float> out(panels * k * kPanel, 0.0f);
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
      const float* src = w + (p * kPanel + c) * k;
      float* dst = out.data() + p * k * kPanel + c;
      for (int64_t i = 0; i < k; ++i) dst[i * kPanel] = src[i];
    }
  return out;
}

#if RLFW_AVX2
template <int R>
void block(const float* x, int64_t k, const float* panel, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + i * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  alignas(32) float tmp[R][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tmp[r], acc[r][0]);
    _mm256_store_ps(tmp[r] + 8, acc[r][1]);
  }
  for (int r = 0; r < R; ++r) std::copy(tmp[r], tmp[r] + cols, y + r * ldy);
}

// Few rows (decode): no weight packing. x is transposed to xt [K][16] (rows as lanes, zero past M) and
// each weight row is read as it lies; every element is still fma(x[r, k], w[c, k], acc) over k ascending
// from +0, so these are the bits of the packed path.
constexpr int64_t kFewRows = 16;
constexpr int64_t kUnpackedMaxRows = 64;  // up to here the weight is read in place, 16 rows at a time

template <int C>
void few_rows_block(const float* xt, int64_t m, int64_t k, const float* w, float* y, int64_t ldy) {
  __m256 acc[C][2];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 x0 = _mm256_loadu_ps(xt + i * kFewRows);
    const __m256 x1 = _mm256_loadu_ps(xt + i * kFewRows + 8);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 wb = _mm256_broadcast_ss(w + c * k + i);
      acc[c][0] = _mm256_fmadd_ps(x0, wb, acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(x1, wb, acc[c][1]);
    }
  }
  alignas(32) float tmp[C][kFewRows];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm256_store_ps(tmp[c], acc[c][0]);
    _mm256_store_ps(tmp[c] + 8, acc[c][1]);
  }
  for (int c = 0; c < C; ++c)
    for (int64_t r = 0; r < m; ++r) y[r * ldy + c] = tmp[c][r];
}

void few_rows(const float* x, int64_t m, int64_t k, const float* w, float* y, int64_t n0, int64_t n1, int64_t n) {
  std::vector<float> xt(k * kFewRows);
  for (int64_t r0 = 0; r0 < m; r0 += kFewRows) {  // groups of 16 rows, each transposed once
    const int64_t rows = std::min(kFewRows, m - r0);
    std::fill(xt.begin(), xt.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) xt[i * kFewRows + r] = x[(r0 + r) * k + i];
    int64_t c = n0;
    for (; c + 4 <= n1; c += 4) few_rows_block<4>(xt.data(), rows, k, w + c * k, y + r0 * n + c, n);
    for (; c < n1; ++c) few_rows_block<1>(xt.data(), rows, k, w + c * k, y + r0 * n + c, n);
  }
}

void panel_rows(const float* x, int64_t m, int64_t k, const float* panel, float* y, int64_t n, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) block<kRows>(x + r * k, k, panel, y + r * n, n, cols);
  switch (m - r) {
    case 5: block<5>(x + r * k, k, panel, y + r * n, n, cols); break;
    case 4: block<4>(x + r * k, k, panel, y + r * n, n, cols); break;
    case 3: block<3>(x + r * k, k, panel, y + r * n, n, cols); break;
    case 2: block<2>(x + r * k, k, panel, y + r * n, n, cols); break;
    case 1: block<1>(x + r * k, k, panel, y + r * n, n, cols); break;
    default: break;
  }
}
#else
void panel_rows(const float* x, int64_t m, int64_t k, const float* panel, float* y, int64_t n, int64_t cols) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) acc = std::fma(x[r * k + i], panel[i * kPanel + c], acc);
      y[r * n + c] = acc;
    }
}
#endif

}  // namespace

// x [M, K] and weight [N, K], fp32 and contiguous; returns [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "linear: fp32 operands");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "linear: contiguous operands");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if RLFW_AVX2
  if (m <= kUnpackedMaxRows) {
    const float* wp = weight.data_ptr<float>();
    at::parallel_for(0, n, 4, [&](int64_t n0, int64_t n1) { few_rows(xp, m, k, wp, yp, n0, n1, n); });
    return y;
  }
#endif
  const std::vector<float> packed = pack(weight.data_ptr<float>(), n, k);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Rows go in blocks that stay in cache while every panel passes over them (about 256 KiB of x), so x
  // is read from memory once rather than once per panel. Threads take whole panels of a block; each
  // element is still one fma chain computed by one thread, whatever the blocking.
  const int64_t block_rows = std::max<int64_t>(kRows, (kBlockBytes / (k * 4)) / kRows * kRows);
  for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
    const int64_t rows = std::min(block_rows, m - r0);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        panel_rows(xp + r0 * k, rows, k, packed.data() + p * k * kPanel, yp + r0 * n + p * kPanel, n, cols);
      }
    });
  }
  return y;
}

bool vectorised() { return RLFW_AVX2; }
