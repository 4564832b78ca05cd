// Batch-invariant fp32 linear for CPUs: y[m, n] = sum_k x[m, k] * w[n, k], one fixed order per element.
//
// Every output element is one fma chain over k ascending, starting from +0: y = fma(x[k], w[n, k], y).
// fma rounds once and is exactly specified, so the AVX-512 and AVX2 paths, their tails and the portable
// loop give the same bits; blocking (rows, columns, threads) only decides which elements are computed together.
// A long reduction is walked in stretches of k (see kStretch): a chain's partial sum is stored in y in fp32
// and picked up again by the next stretch, which continues the same chain, so stretches change no bit.
// No padding, no split of a chain across threads, no dependence on a BLAS library's shape-specific paths.
//
// A weight that serves many calls (an engine's, between weight updates) can be packed once (pack) and
// used by linear_packed; linear packs per call, or reads the weight in place for a few rows.

#include <torch/extension.h>

#include <unistd.h>

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
#if RLFW_AVX2 && defined(__AVX512F__)
#define RLFW_AVX512 1  // 16-lane register blocks; the same fma chains, so the same bits
#else
#define RLFW_AVX512 0
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per packed weight panel (two 8-lane or one 16-lane vector)
constexpr int64_t kRows = 6;    // rows per register block
constexpr int64_t kBlockBytes = 256 * 1024;  // rows of x per cache block (see linear())

// A long reduction (a weight gradient reduces over every token of the batch) is walked in the fewest
// stretches of at most kStretch steps of k, of nearly one length (ceil(k / stretches), the last what is
// left). A stretch keeps six rows of x in L1 and a group of panel stretches in L2. k up to kWholeK (six rows of x
// in 30 KiB, under a 32 KiB L1) is walked whole: at 1,040 rows a weight gradient already ran at
// 36-38 GFLOP/s whole, while at 4,160 rows six rows of the gradient (100 KiB) and each 266 KiB panel came
// from L3 for every row block and ran at 27-30 (RESULTS).
constexpr int64_t kStretch = 512;
constexpr int64_t kWholeK = 1280;

// One stretch of the reduction: kc of the k steps, from x's rows (k floats apart) and the same rows of each
// panel (k x 16 floats between panels). resume: each chain continues from the partial sum y holds (exact:
// it was stored in fp32 by the stretch before), rather than from +0.
struct Stretch {
  int64_t k;
  int64_t kc;
  bool resume;
  int64_t ldx() const { return k; }
  int64_t stride() const { return k * kPanel; }
};

// Weight panels per L2-resident group (see group_rows()): half the core's L2, so that a group and the rows
// passing over it stay there together; 512 KiB where the C library does not report the L2. (With a
// 512 KiB group on a 512 KiB L2 the 13M train step took 4.41 s against 4.22 s with 256 KiB: RESULTS.)
int64_t group_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? std::max<int64_t>(l2 / 2, 64 * 1024) : int64_t{512 * 1024};
  }();
  return bytes;
}

// w [N, K] -> panels [ceil(N / 16)][K][16], zero past N (those lanes are computed, never stored). Panels
// p0 .. p1-1 only (threads take whole panels).
void pack_into(const float* w, int64_t n, int64_t k, float* out, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    float* panel = out + p * k * kPanel;
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    if (cols < kPanel) std::fill(panel, panel + k * kPanel, 0.0f);
    for (int64_t c = 0; c < cols; ++c) {
      const float* src = w + (p * kPanel + c) * k;
      float* dst = panel + c;
      for (int64_t i = 0; i < k; ++i) dst[i * kPanel] = src[i];
    }
  }
}

// Sixteen floats from src to dst (cols of them; zero after), the row of one panel.
inline void panel_row(const float* src, int64_t cols, float* dst) {
#if RLFW_AVX2
  if (cols == kPanel) {
    _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
    _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(src + 8));
    return;
  }
#endif
  for (int64_t c = 0; c < kPanel; ++c) dst[c] = c < cols ? src[c] : 0.0f;
}

// wt [K, N] (a weight given transposed) -> the same panels as pack_into(wt.T): panel p holds columns
// 16 p .. 16 p + 15 of wt, row by row, so no transposed copy is made first. Panels p0 .. p1-1 only.
void pack_transposed_into(const float* wt, int64_t k, int64_t n, float* out, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    for (int64_t i = 0; i < k; ++i) panel_row(wt + i * n + p * kPanel, cols, out + (p * k + i) * kPanel);
  }
}

// Where a resumed register block reads its partial sums: y itself (row stride ldy) when it covers whole
// panels; else tmp, filled with the cols floats of each row of y and zeros past them (lanes that are
// computed and never stored). Sets ld to the row stride of what it returns.
template <int R, int W>
const float* resume_from(const float* y, int64_t ldy, int64_t cols, float (&tmp)[R][W], int64_t& ld) {
  ld = ldy;
  if (cols == W) return y;
  for (int r = 0; r < R; ++r) {
    std::copy(y + r * ldy, y + r * ldy + cols, tmp[r]);
    std::fill(tmp[r] + cols, tmp[r] + W, 0.0f);
  }
  ld = W;
  return tmp[0];
}

#if RLFW_AVX2
#if RLFW_AVX512
// The 16-lane block: one vector per panel row, R rows x P panels = R P accumulators (32 registers hold
// up to 24 chains and the P weight vectors), half the loads per fma of the 8-lane block below. Each
// element is the same fma chain as there and in the portable loop.
template <int R, int P>
void block(const float* x, const Stretch& s, const float* panel, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[R][P];
  alignas(64) float tmp[R][P * kPanel];
  if (s.resume) {
    int64_t ld;
    const float* from = resume_from(y, ldy, cols, tmp, ld);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_loadu_ps(from + r * ld + j * kPanel);
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const int64_t stride = s.stride(), ldx = s.ldx();
  for (int64_t i = 0; i < s.kc; ++i) {
    __m512 w[P];
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) w[j] = _mm512_loadu_ps(panel + j * stride + i * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_fmadd_ps(xb, w[j], acc[r][j]);
    }
  }
  if (cols == P * kPanel) {  // whole panels: straight into y
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) _mm512_storeu_ps(y + r * ldy + j * kPanel, acc[r][j]);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) _mm512_store_ps(tmp[r] + j * kPanel, acc[r][j]);
  for (int r = 0; r < R; ++r) std::copy(tmp[r], tmp[r] + cols, y + r * ldy);
}
#else
// R rows x P panels (16 P output features): 2 R P accumulators, each one element's fma chain over k.
template <int R, int P>
void block(const float* x, const Stretch& s, const float* panel, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][2 * P];
  alignas(32) float tmp[R][P * kPanel];
  if (s.resume) {
    int64_t ld;
    const float* from = resume_from(y, ldy, cols, tmp, ld);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_loadu_ps(from + r * ld + j * 8);
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  const int64_t stride = s.stride(), ldx = s.ldx();
  const int64_t k = s.kc;
  // Register budget (16 ymm): many rows load the 2P weight vectors once and broadcast x row by row; few
  // rows broadcast their x once and stream the weight vectors. Either way acc[r][j] takes one fma per i.
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (R >= 2 * P) {
      __m256 w[2 * P];
#pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) w[j] = _mm256_loadu_ps(panel + (j / 2) * stride + i * kPanel + (j % 2) * 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_fmadd_ps(xb, w[j], acc[r][j]);
      }
    } else {
      __m256 xb[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + i);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) {
        const __m256 w = _mm256_loadu_ps(panel + (j / 2) * stride + i * kPanel + (j % 2) * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(xb[r], w, acc[r][j]);
      }
    }
  }
  if (cols == P * kPanel) {  // whole panels: straight into y
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) _mm256_storeu_ps(y + r * ldy + j * 8, acc[r][j]);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * P; ++j) _mm256_store_ps(tmp[r] + j * 8, acc[r][j]);
  for (int r = 0; r < R; ++r) std::copy(tmp[r], tmp[r] + cols, y + r * ldy);
}
#endif

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

// One vector of rows (at most eight rows in an 8-lane vector; nine to sixteen in a 16-lane one on AVX-512)
// against C weight rows at once, so that C chains are in flight and no fma multiplies only the zeros past
// the rows, as the two-vector block above does for eight rows or fewer. The same fma chain per element.
struct Lanes8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V splat(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
};
#if RLFW_AVX512
struct Lanes16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V splat(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_store_ps(p, v); }
};
#endif

template <typename L, int C>
void few_rows_lanes(const float* xt, int64_t m, int64_t k, const float* w, float* y, int64_t ldy) {
  typename L::V acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c] = L::zero();
  for (int64_t i = 0; i < k; ++i) {
    const typename L::V x0 = L::load(xt + i * kFewRows);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = L::fma(x0, L::splat(w + c * k + i), acc[c]);
  }
  alignas(64) float tmp[C][L::kLanes];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) L::store(tmp[c], acc[c]);
  for (int c = 0; c < C; ++c)
    for (int64_t r = 0; r < m; ++r) y[r * ldy + c] = tmp[c][r];
}

// Columns n0 .. n1-1 of one group of rows (xt), eight weight rows per block and the rest one at a time.
template <typename L>
void few_rows_columns(const float* xt, int64_t m, int64_t k, const float* w, float* y, int64_t n0, int64_t n1,
                      int64_t ldy) {
  int64_t c = n0;
  for (; c + 8 <= n1; c += 8) few_rows_lanes<L, 8>(xt, m, k, w + c * k, y + c, ldy);
  for (; c < n1; ++c) few_rows_lanes<L, 1>(xt, m, k, w + c * k, y + c, ldy);
}

void few_rows(const float* x, int64_t m, int64_t k, const float* w, float* y, int64_t n0, int64_t n1, int64_t n) {
  std::vector<float> xt(k * kFewRows);
  for (int64_t r0 = 0; r0 < m; r0 += kFewRows) {  // groups of 16 rows, each transposed once
    const int64_t rows = std::min(kFewRows, m - r0);
    std::fill(xt.begin(), xt.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) xt[i * kFewRows + r] = x[(r0 + r) * k + i];
    float* yr = y + r0 * n;
    if (rows <= 8) {
      few_rows_columns<Lanes8>(xt.data(), rows, k, w, yr, n0, n1, n);
      continue;
    }
#if RLFW_AVX512
    few_rows_columns<Lanes16>(xt.data(), rows, k, w, yr, n0, n1, n);
#else
    int64_t c = n0;
    for (; c + 4 <= n1; c += 4) few_rows_block<4>(xt.data(), rows, k, w + c * k, yr + c, n);
    for (; c < n1; ++c) few_rows_block<1>(xt.data(), rows, k, w + c * k, yr + c, n);
#endif
  }
}

#if RLFW_AVX512
// Register blocks: six rows by four panels (64 output features); the 1-5 rows left take 4-8 panels.
constexpr int64_t kMainPanels = 4;
#define RLFW_TAIL_BLOCKS(TAIL) \
  TAIL(5, 4)                    \
  TAIL(4, 4)                    \
  TAIL(3, 6)                    \
  TAIL(2, 8)                    \
  TAIL(1, 8)
#else
// Register blocks (16 registers): six rows by one panel; the 1-5 rows left (a decode batch's tail, or all
// of a small one) take several panels per block so that a block still has 8-12 independent chains.
constexpr int64_t kMainPanels = 1;
#define RLFW_TAIL_BLOCKS(TAIL) \
  TAIL(5, 1)                    \
  TAIL(4, 1)                    \
  TAIL(3, 2)                    \
  TAIL(2, 3)                    \
  TAIL(1, 4)
#endif

// Rows of x against panels p0 .. p1-1 of the packed weight over one stretch of k (packed points at the
// stretch's first row of panel 0), R rows and P panels per register block (the panels left over one at a
// time).
template <int R, int P>
void rows_by_panels(const float* x, const Stretch& s, const float* packed, float* y, int64_t n, int64_t p0,
                    int64_t p1) {
  int64_t p = p0;
  for (; p + P <= p1; p += P)
    block<R, P>(x, s, packed + p * s.stride(), y + p * kPanel, n, std::min(P * kPanel, n - p * kPanel));
  for (; p < p1; ++p) block<R, 1>(x, s, packed + p * s.stride(), y + p * kPanel, n, std::min(kPanel, n - p * kPanel));
}

// Rows 0 .. m-1 against a group of panels p0 .. p1-1 that stays in L2: every row block passes over the
// group before the next group is read, so each panel comes from memory once per call rather than once
// per row block (an engine's weights do not stay in the last-level cache from one step to the next).
void group_rows(const float* x, int64_t m, const Stretch& s, const float* packed, float* y, int64_t n, int64_t p0,
                int64_t p1) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows)
    rows_by_panels<kRows, kMainPanels>(x + r * s.ldx(), s, packed, y + r * n, n, p0, p1);
  const float* xr = x + r * s.ldx();
  float* yr = y + r * n;
  switch (m - r) {
#define RLFW_TAIL(R, P) \
  case R: rows_by_panels<R, P>(xr, s, packed, yr, n, p0, p1); break;
    RLFW_TAIL_BLOCKS(RLFW_TAIL)
#undef RLFW_TAIL
    default: break;
  }
}

void panel_rows(const float* x, int64_t m, const Stretch& s, const float* packed, float* y, int64_t n, int64_t p0,
                int64_t p1) {
  const int64_t fit = group_bytes() / (s.kc * kPanel * static_cast<int64_t>(sizeof(float)));
  const int64_t group = std::max(kMainPanels, fit / kMainPanels * kMainPanels);
  for (int64_t g0 = p0; g0 < p1; g0 += group) group_rows(x, m, s, packed, y, n, g0, std::min(p1, g0 + group));
}
#else
void panel_rows(const float* x, int64_t m, const Stretch& s, const float* packed, float* y, int64_t n, int64_t p0,
                int64_t p1) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = p0 * kPanel; c < std::min(n, p1 * kPanel); ++c) {
      const float* panel = packed + (c / kPanel) * s.stride() + c % kPanel;
      float acc = s.resume ? y[r * n + c] : 0.0f;
      for (int64_t i = 0; i < s.kc; ++i) acc = std::fma(x[r * s.ldx() + i], panel[i * kPanel], acc);
      y[r * n + c] = acc;
    }
}
#endif

}  // namespace

namespace {

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "linear: x [M, K] with K = ", k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "linear: contiguous fp32 x");
}

constexpr int64_t kTile = 64;  // rows and columns per cache tile of transpose_columns()

#if RLFW_AVX2
// dst[j * ldd + i] = src[i * lds + j] for an 8 x 8 block.
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

// dst[(j - j0) * ldd + i] = src[i * lds + j] for rows i < m and columns j0 <= j < j1 of src: those columns
// as rows of dst, in cache tiles of 64 x 64 with 8 x 8 register transposes inside them (a copy: the bits
// are src's).
void transpose_columns(const float* src, int64_t lds, int64_t m, int64_t j0, int64_t j1, float* dst, int64_t ldd) {
  for (int64_t t0 = j0; t0 < j1; t0 += kTile) {
    const int64_t t1 = std::min(j1, t0 + kTile);
    for (int64_t i0 = 0; i0 < m; i0 += kTile) {
      const int64_t i1 = std::min(m, i0 + kTile);
      int64_t j = t0;
#if RLFW_AVX2
      for (; j + 8 <= t1; j += 8) {
        int64_t i = i0;
        for (; i + 8 <= i1; i += 8) transpose8(src + i * lds + j, lds, dst + (j - j0) * ldd + i, ldd);
        for (; i < i1; ++i)
          for (int64_t jj = j; jj < j + 8; ++jj) dst[(jj - j0) * ldd + i] = src[i * lds + jj];
      }
#endif
      for (; j < t1; ++j)
        for (int64_t i = i0; i < i1; ++i) dst[(j - j0) * ldd + i] = src[i * lds + j];
    }
  }
}

// y [m, n] = x @ w.T from the packed panels of w [n, k], in the options of `like`. x comes a block of rows
// at a time: rows_of(r0, rows) gives rows r0 .. r0 + rows - 1 of x, each k floats, k apart.
template <typename RowsOf>
torch::Tensor run_packed(int64_t m, int64_t k, RowsOf rows_of, const float* packed, int64_t n,
                         const torch::Tensor& like) {
  auto y = torch::empty({m, n}, like.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  float* yp = y.data_ptr<float>();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t stretches = k <= kWholeK ? 1 : (k + kStretch - 1) / kStretch;
  const int64_t stretch = (k + stretches - 1) / stretches;
  // Rows go in blocks that stay in cache while every panel passes over them (about 256 KiB of x's
  // stretch), so x is read from memory once rather than once per panel. Threads take whole panels of a
  // block; the stretches of a block run one after another, so each element is still one fma chain over
  // k ascending, computed by one thread, whatever the blocking.
  const int64_t block_rows = std::max<int64_t>(kRows, (kBlockBytes / (stretch * 4)) / kRows * kRows);
  for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
    const int64_t rows = std::min(block_rows, m - r0);
    const float* xp = rows_of(r0, rows);
    for (int64_t k0 = 0; k0 < k; k0 += stretch) {
      const Stretch s{k, std::min(stretch, k - k0), k0 > 0};
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        panel_rows(xp + k0, rows, s, packed + k0 * kPanel, yp + r0 * n, n, p0, p1);
      });
    }
  }
  return y;
}

// y = x @ w.T from the packed panels of w [N, K].
torch::Tensor run_packed(const torch::Tensor& x, const float* packed, int64_t n) {
  const int64_t k = x.size(1);
  const float* xp = x.data_ptr<float>();
  return run_packed(x.size(0), k, [&](int64_t r0, int64_t) { return xp + r0 * k; }, packed, n, x);
}

// Panels [ceil(n / 16), k, 16] for a weight with n outputs and inner size k, filled by
// pack_range(out, p0, p1) for panels p0 .. p1-1; not zeroed first: the packers write every float. Threads
// take whole panels (a copy: the bits are the weight's, whatever the split).
template <typename PackRange>
torch::Tensor packed_panels(const torch::Tensor& like, int64_t n, int64_t k, PackRange pack_range) {
  auto out = torch::empty({(n + kPanel - 1) / kPanel, k, kPanel}, like.options());
  float* panels = out.data_ptr<float>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t p0, int64_t p1) { pack_range(panels, p0, p1); });
  return out;
}

}  // namespace

// weight [N, K] fp32 -> its panels [ceil(N / 16), K, 16], the layout linear_packed reads.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "pack: contiguous fp32 weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const float* w = weight.data_ptr<float>();
  return packed_panels(weight, n, k,
                       [&](float* out, int64_t p0, int64_t p1) { pack_into(w, n, k, out, p0, p1); });
}

// wt [K, N] (a weight given transposed) -> the panels of wt.T [N, K], as pack(wt.T) gives them: what
// linear_packed reads to give the bits of linear_t(x, wt).
torch::Tensor pack_t(const torch::Tensor& wt) {
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == at::kFloat && wt.is_contiguous(),
              "pack_t: contiguous fp32 wt [K, N]");
  const int64_t k = wt.size(0), n = wt.size(1);
  const float* w = wt.data_ptr<float>();
  return packed_panels(wt, n, k,
                       [&](float* out, int64_t p0, int64_t p1) {
                         pack_transposed_into(w, k, n, out, p0, p1);
                       });
}

// x [M, K] against a weight [n, K] packed by pack(): the same bits as linear(x, weight).
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(0) == (n + kPanel - 1) / kPanel &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "linear_packed: panels [ceil(n / 16), K, 16] from pack()");
  check_x(x, packed.size(1));
  return run_packed(x, packed.data_ptr<float>(), n);
}

// x [M, K] and weight [N, K], fp32 and contiguous; returns [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "linear: contiguous fp32 weight [N, K]");
  check_x(x, weight.size(1));
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
#if RLFW_AVX2
  if (m <= kUnpackedMaxRows && m > 0 && n > 0 && k > 0) {  // too few rows to pay for packing
    auto y = torch::empty({m, n}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, n, 4, [&](int64_t n0, int64_t n1) { few_rows(xp, m, k, wp, yp, n0, n1, n); });
    return y;
  }
#endif
  const torch::Tensor panels = pack(weight);
  return run_packed(x, panels.data_ptr<float>(), n);
}

// x [M, K] @ wt [K, N] (the weight given transposed, as a backward pass holds it), fp32 and contiguous;
// returns [M, N]: each element the same fma chain over k ascending as linear(x, wt.T) gives it.
torch::Tensor linear_t(const torch::Tensor& x, const torch::Tensor& wt) {
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == at::kFloat && wt.is_contiguous(),
              "linear_t: contiguous fp32 wt [K, N]");
  check_x(x, wt.size(0));
  const torch::Tensor panels = pack_t(wt);
  return run_packed(x, panels.data_ptr<float>(), wt.size(1));
}

// g [M, N] and x [M, K], fp32 and contiguous -> g.T @ x [N, K] (a linear's weight gradient): the bits of
// linear_t(g.T, x), each element the fma chain over the M rows ascending. g.T is not made whole: each
// block of its rows is transposed (the kernel's threads taking whole 64-column tiles) into a buffer that
// stays in cache while the panels pass over it.
torch::Tensor linear_tn(const torch::Tensor& g, const torch::Tensor& x) {
  TORCH_CHECK(g.dim() == 2 && x.dim() == 2 && g.size(0) == x.size(0), "linear_tn: g [M, N] and x [M, K]");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_tn: contiguous fp32 g and x");
  const int64_t m = g.size(0), n = g.size(1);
  const torch::Tensor panels = pack_t(x);
  const float* gp = g.data_ptr<float>();
  std::vector<float> block;
  auto rows_of = [&](int64_t r0, int64_t rows) {
    block.resize(rows * m);
    float* dst = block.data();
    at::parallel_for(0, (rows + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
      transpose_columns(gp, n, m, r0 + t0 * kTile, r0 + std::min(rows, t1 * kTile), dst + t0 * kTile * m, m);
    });
    return static_cast<const float*>(dst);
  };
  return run_packed(n, m, rows_of, panels.data_ptr<float>(), x.size(1), g);
}

bool vectorised() { return RLFW_AVX2; }
