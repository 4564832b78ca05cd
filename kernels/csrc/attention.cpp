// Batch-invariant causal attention for CPUs over the engine's slotted K/V layout [B, S, H_kv, D] and over
// vLLM's paged layout (blocks of positions reached through a block table), with one arithmetic for both.
//
// Each query row (batch entry, position p, query head) is computed alone, in an order that depends on p and
// the head size only (one thread computes all heads of a block of up to eight query tokens of one sequence;
// they share reads, not arithmetic):
// scores s_i = q . k_i for i = 0 .. p (each dot product: eight lane sums of fma chains over d = j, j + 8, ...,
// folded as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the d tail by an ascending fma chain,
// then times the scale); m = max s_i; e_i = exp(s_i - m) (exp_f32 of exp_f32.h: glibc's expf algorithm spelt
// out, so the bits do not depend on the C library);
// denominator = sum of e_i, i ascending; out[d] = (fma chain over i ascending of e_i * v_i[d]) / denominator.
// Nothing past p is read, so stale or non-finite cache contents there cannot reach a result, and a prefill,
// a chunked prefill, a decode step and the trainer's forward give the same bits for the same query.
// A query with a negative position (padding) gets zeros. Where K/V live (a slotted row, a chain of paged
// blocks, fp32 or bf16 widened exactly) does not enter the arithmetic, so the same query gets the same
// bits from either cache.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "exp_f32.h"

namespace {

using rlfw_exp::exp_f32;
#if RLFW_AVX2
using rlfw_exp::exp8;
#endif

constexpr int64_t kLanes = 8;

// The walk asks for the K or V rows it will read a few positions ahead (a software prefetch: it moves no data
// the arithmetic sees, so no bit depends on it). Ahead is the slotted layout's: every head's row of position i
// lies contiguously at base + i * stride floats. PagedAhead is vLLM's, through a table of row addresses.

// One cache line toward L2 (locality 1: the rows being read keep L1). Spelt as an instruction the compiler
// must keep: with __builtin_prefetch, GCC 12.2 at -O3 emitted nothing for PagedAhead's loops (a small
// reproduction compiles to a bare return), while the slotted walk's loop kept its prefetch.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

struct Ahead {
  const float* base = nullptr;
  int64_t stride = 0;  // floats per position
  // Positions lo .. hi - 1 (clipped to < n): the part-th of `parts` nearly equal shares of their lines.
  void operator()(int64_t lo, int64_t hi, int64_t n, int64_t part = 0, int64_t parts = 1) const {
    if (base == nullptr || lo >= n) return;
    const int64_t bytes = (std::min(hi, n) - lo) * stride * static_cast<int64_t>(sizeof(float));
    const int64_t lines = (bytes + 63) / 64;
    const char* from = reinterpret_cast<const char*>(base + lo * stride);
    for (int64_t l = lines * part / parts; l < lines * (part + 1) / parts; ++l) prefetch_line(from + l * 64);
  }
};
template <typename T>
struct PagedAhead {
  const T* const* rows = nullptr;  // position i, K/V head h: its K row at rows[i * hkv + h]
  int64_t hkv = 0;
  int64_t offset = 0;  // elements from a K row to the same position's V row: 0 for K
  int64_t bytes = 0;   // per row
  // The part-th of `parts` nearly equal shares of the rows (position, K/V head) of positions lo .. hi - 1.
  void operator()(int64_t lo, int64_t hi, int64_t n, int64_t part = 0, int64_t parts = 1) const {
    if (lo >= n) return;
    const int64_t count = (std::min(hi, n) - lo) * hkv;
    for (int64_t r = count * part / parts; r < count * (part + 1) / parts; ++r) {
      const char* a = reinterpret_cast<const char*>(rows[lo * hkv + r] + offset);
      for (const char* b = a + bytes; a < b; a += 64) prefetch_line(a);
    }
  }
};
// The walks request a chunk's lines ahead in shares, one per head's pass over the chunk, so that the
// requests go out beside the arithmetic. Requested all at once at the chunk's start (128 lines of K, 256 of
// V at the 76M model's 4 K/V heads of 64), they filled the core's queue of outstanding misses and the walk
// stalled on its own prefetches; spread, a 76M decode step at 271 positions took 0.69-0.75x the time
// (RESULTS). 8 or 32 positions ahead instead of 16 were slower, and so was prefetcht0.
constexpr int64_t kAheadK = 16;  // positions of K requested ahead of the score walk
constexpr int64_t kAheadV = 16;  // positions of V requested ahead of the weighted sum

// e[i] = exp_f32(e[i] - m) for i < n (sixteen, eight, then one at a time: the same function on every lane).
inline void exp_shifted(float* e, int64_t n, float m) {
  int64_t i = 0;
#if RLFW_EXP16
  const __m512 mw = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(e + i, rlfw_exp::exp16(_mm512_sub_ps(_mm512_loadu_ps(e + i), mw)));
#endif
#if RLFW_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(e + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(e + i), mv)));
#endif
  for (; i < n; ++i) e[i] = exp_f32(e[i] - m);
}

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

// acc[d] += w_i * v_i[d] for i = i0 .. i1 - 1, continuing each element's one fma chain ascending in i, for
// NV vectors of d held in registers across the walk instead of reloaded and stored at every position.
template <int NV, typename Value>
inline void weighted_sum(const float* e, int64_t i0, int64_t i1, const Value& value, int64_t offset, float* acc) {
  __m256 a[NV];
  for (int k = 0; k < NV; ++k) a[k] = _mm256_loadu_ps(acc + offset + k * kLanes);
  for (int64_t i = i0; i < i1; ++i) {
    const __m256 wv = _mm256_set1_ps(e[i]);
    const float* v = value(i) + offset;
    for (int k = 0; k < NV; ++k) a[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + k * kLanes), a[k]);
  }
  for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + offset + k * kLanes, a[k]);
}
#endif

// acc[x] += w[i] * row(i)[x] for i = i0 .. i1 - 1 and x < d, each element one fma chain in i order,
// continued from what acc holds (eight vectors of accumulators in registers where the vector path is built).
template <typename Rows>
inline void chain_rows(const float* w, int64_t i0, int64_t i1, const Rows& row, int64_t d, float* acc) {
  int64_t col = 0;
#if RLFW_AVX2
  for (; col + 8 * kLanes <= d; col += 8 * kLanes) weighted_sum<8>(w, i0, i1, row, col, acc);
  for (; col + kLanes <= d; col += kLanes) weighted_sum<1>(w, i0, i1, row, col, acc);
#endif
  for (int64_t i = i0; i < i1 && col < d; ++i) {
    const float* r = row(i);
    for (int64_t x = col; x < d; ++x) acc[x] = std::fma(w[i], r[x], acc[x]);
  }
}

constexpr int64_t kQueryBlock = 8;  // query tokens of one batch entry walked together (see attend_block)
constexpr int64_t kBackwardFloats = 1 << 15;  // softmax rows of one query block in the backward (128 KiB)

// The query rows of nq tokens of one sequence over their visible positions, for heads 0 .. nh - 1. Token j's
// query rows are qs[j] (head h at qs[j] + h * d, reading K/V head h / group), its position ps[j] (negative:
// padding, left alone), its output rows outs[j]. key(i, kvh, k) and value(i, kvh) give position i's K and V
// rows for a K/V head (fp32, d floats; k in 0..7 names a scratch row where a K row must be widened, so eight
// can be live at once). e holds nq * nh * cap floats (cap > every position), acc nq * nh * d, denom nq * nh.
// Every query row's arithmetic is the header's and none depends on another's: the heads and tokens share only
// the walk over positions, so a position's K and V rows (side by side for all heads in the slotted layout)
// are read from memory once for the whole block, in order, not once per head and token (a prefill of 512
// tokens would otherwise read the sequence's whole K and V once per token, past what L2 holds). The AVX2
// path computes eight scores and eight exponentials at once and keeps output rows in registers across a
// chunk of positions; each element is the same fma chain in the same order.
template <typename Key, typename Value, typename KAhead, typename VAhead>
inline void attend_block(const float* const* qs, const int64_t* ps, int64_t nq, int64_t nh, int64_t group,
                         int64_t d, float sc, const Key& key, const Value& value, float* e, int64_t cap,
                         float* acc, float* denom, float* const* outs, const KAhead& k_ahead, const VAhead& v_ahead) {
  int64_t nmax = 0;
  for (int64_t j = 0; j < nq; ++j) nmax = std::max(nmax, ps[j] + 1);
  if (nmax <= 0) return;
  const auto scores = [&](int64_t j, int64_t h) { return e + (j * nh + h) * cap; };
  int64_t i = 0;
  k_ahead(0, kAheadK, nmax);
#if RLFW_AVX2
  for (; i + kLanes <= nmax; i += kLanes) {
    for (int64_t h = 0; h < nh; ++h) {
      k_ahead(i + kAheadK, i + kAheadK + kLanes, nmax, h, nh);
      const float* keys[kLanes];
      for (int64_t k = 0; k < kLanes; ++k) keys[k] = key(i + k, h / group, k);
      for (int64_t j = 0; j < nq; ++j) {
        if (i + kLanes > ps[j] + 1) continue;  // past this query's whole groups of eight: its tail below
        float* eh = scores(j, h) + i;
        dot8(qs[j] + h * d, keys, d, eh);
        for (int64_t k = 0; k < kLanes; ++k) eh[k] *= sc;
      }
    }
  }
#endif
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t n = ps[j] + 1;
    if (n <= 0) continue;
    const int64_t tail = RLFW_AVX2 ? n - n % kLanes : 0;
    for (int64_t t = tail; t < n; ++t)
      for (int64_t h = 0; h < nh; ++h) scores(j, h)[t] = dot(qs[j] + h * d, key(t, h / group, 0), d) * sc;
    // Each head's maximum and sum run over t ascending. The heads' chains are independent, so they advance
    // side by side, one position of every head at a time, rather than one chain waiting on its own latency
    // at every position. `row` holds the maxima, then the sums.
    float* row = denom + j * nh;
    std::fill(row, row + nh, -INFINITY);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < nh; ++h) row[h] = std::max(row[h], scores(j, h)[t]);
    for (int64_t h = 0; h < nh; ++h) exp_shifted(scores(j, h), n, row[h]);
    std::fill(row, row + nh, 0.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < nh; ++h) row[h] += scores(j, h)[t];
  }
  std::fill(acc, acc + nq * nh * d, 0.0f);
  v_ahead(0, kAheadV, nmax);
  constexpr int64_t kChunk = 16;  // positions whose V rows stay in L1 while every head and query walks them
  for (int64_t c0 = 0; c0 < nmax; c0 += kChunk) {
    for (int64_t h = 0; h < nh; ++h) {
      v_ahead(c0 + kAheadV, std::min(c0 + kChunk, nmax) + kAheadV, nmax, h, nh);
      const auto vh = [&](int64_t pos) { return value(pos, h / group); };
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t c1 = std::min(c0 + kChunk, ps[j] + 1);
        if (c1 <= c0) continue;
        chain_rows(scores(j, h), c0, c1, vh, d, acc + (j * nh + h) * d);
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    if (ps[j] < 0) continue;
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t x = 0; x < d; ++x) outs[j][h * d + x] = acc[(j * nh + h) * d + x] / denom[j * nh + h];
  }
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
                  rows.size(0) == b && q_pos.size(0) == b && q_pos.size(1) == t,
              "attention: shapes (q_pos must be [B, T])");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < k.size(0), "attention: cache row ", row[i], " outside 0..", k.size(0) - 1);
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < b * t; ++i)
    TORCH_CHECK(pos[i] < s, "attention: position ", pos[i], " outside the cache (", s, " slots)");
  const int64_t group = hq / hkv;
  const float sc = static_cast<float>(scale);
  // One task per block of up to kQueryBlock consecutive query tokens of a batch entry, all of their heads
  // together: a position's K (and V) rows of every head lie side by side in a cache row, so the walk reads
  // them once, in order, for the whole block.
  const int64_t blocks = (t + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, b * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> e(kQueryBlock * hq * s);
    std::vector<float> acc(kQueryBlock * hq * d), denom(kQueryBlock * hq);
    const float* qs[kQueryBlock];
    float* outs[kQueryBlock];
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t bi = task / blocks, t0 = (task % blocks) * kQueryBlock, nq = std::min(kQueryBlock, t - t0);
      const int64_t first = bi * t + t0, ri = row[bi];
      for (int64_t j = 0; j < nq; ++j) {
        qs[j] = qp + (first + j) * hq * d;
        outs[j] = op + (first + j) * hq * d;
      }
      const float* krow = kp + ri * s * hkv * d;
      const float* vrow = vp + ri * s * hkv * d;
      const auto key = [&](int64_t i, int64_t kvh, int64_t) { return krow + (i * hkv + kvh) * d; };
      const auto value = [&](int64_t i, int64_t kvh) { return vrow + (i * hkv + kvh) * d; };
      attend_block(qs, pos + first, nq, hq, group, d, sc, key, value, e.data(), s, acc.data(), denom.data(),
                   outs, Ahead{krow, hkv * d}, Ahead{vrow, hkv * d});
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
  const int64_t cap = max_pos + 1;
  // One task per run of up to kQueryBlock consecutive query tokens of one sequence (a prefill's tokens lie
  // side by side), all of their heads together.
  const int64_t chunks = (n + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> e(kQueryBlock * hq * cap);
    std::vector<float> acc(kQueryBlock * hq * d), denom(kQueryBlock * hq), kbuf(kLanes * d), vbuf(d);
    // Position i's K row for K/V head h, its V row `block` rows further: found once per run here rather
    // than by a division by the block size at every read of a row.
    std::vector<const T*> rows(cap * hkv);
    const float* qs[kQueryBlock];
    float* outs[kQueryBlock];
    for (int64_t first = c0 * kQueryBlock; first < std::min(n, c1 * kQueryBlock);) {
      if (pos[first] < 0) {  // padding: zeros (its sequence id is not checked, so not read)
        ++first;
        continue;
      }
      const int64_t end = std::min(n, (first / kQueryBlock + 1) * kQueryBlock);
      int64_t last = first + 1;  // the run: tokens first .. last - 1 of one sequence
      int64_t seen = pos[first] + 1;  // positions any token of the run sees
      while (last < end && seq[last] == seq[first]) seen = std::max(seen, pos[last++] + 1);
      const int64_t* blocks = table + seq[first] * max_blocks;
      // Block b, head h: `block` key rows, then `block` value rows, each d wide.
      for (int64_t i = 0; i < seen; i += block)
        for (int64_t h = 0; h < hkv; ++h) {
          const T* k = kv + (blocks[i / block] * hkv + h) * 2 * block * d;
          for (int64_t j = 0; j < std::min(block, seen - i); ++j) rows[(i + j) * hkv + h] = k + j * d;
        }
      const auto key = [&](int64_t i, int64_t h, int64_t k) { return widen(rows[i * hkv + h], kbuf.data() + k * d, d); };
      const auto value = [&](int64_t i, int64_t h) { return widen(rows[i * hkv + h] + block * d, vbuf.data(), d); };
      for (int64_t j = 0; j < last - first; ++j) {
        qs[j] = qp + (first + j) * hq * d;
        outs[j] = op + (first + j) * hq * d;
      }
      const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
      attend_block(qs, pos + first, last - first, hq, group, d, sc, key, value, e.data(), cap, acc.data(),
                   denom.data(), outs, PagedAhead<T>{rows.data(), hkv, 0, bytes},
                   PagedAhead<T>{rows.data(), hkv, block * d, bytes});
      first = last;
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

// exp_f32 elementwise over a contiguous fp32 tensor (what the attention's softmax uses; exposed for tests).
torch::Tensor exp_f32_tensor(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "exp: contiguous fp32 input");
  auto out = x.clone();
  float* p = out.data_ptr<float>();
  const int64_t n = out.numel();
  int64_t i = 0;
#if RLFW_AVX2
  for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(p + i, exp8(_mm256_loadu_ps(p + i)));
#endif
  for (; i < n; ++i) p[i] = exp_f32(p[i]);
  return out;
}

// The gradients of attention() with respect to q, k and v (training: k and v [B, S, Hkv, D] are the batch's
// own rows, no cache indirection) for the output gradient grad [B, T, Hq, D]. Gradients need no bits of
// their own to match, only a fixed order: one task per (batch entry, KV head) computes every query of that
// head group, and each element of dq, dk and dv is one fma chain, from zero, in an order that depends on
// the shapes alone: dq over keys ascending, dk and dv over query rows (tokens ascending, then heads)
// ascending. Per query row: p = softmax(scale * q.k_i) over i <= pos, dp_i = g.v_i,
// ds_i = p_i (dp_i - sum_j p_j dp_j); dq = scale * sum_i ds_i k_i, dk_i += scale * ds_i q, dv_i += p_i g.
// The query rows go in blocks: first every row's p and ds (and its dq), then, key by key, dk and dv over
// the block's rows, so each accumulator stays in registers across its chain rather than going through
// memory at every term (a block's chain continues the previous block's from memory: the same chain).
std::vector<torch::Tensor> attention_backward(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const torch::Tensor& q_pos, double scale,
                                              const torch::Tensor& grad) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_pos.dim() == 2 && grad.sizes() == q.sizes(),
              "attention_backward: bad ranks");
  for (const auto* t : {&q, &k, &v, &grad})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "attention_backward: contiguous fp32");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.is_contiguous(), "attention_backward: int64 positions");
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t s = k.size(1), hkv = k.size(2);
  TORCH_CHECK(k.size(0) == b && hkv > 0 && hq % hkv == 0 && k.size(3) == d && v.sizes() == k.sizes() &&
                  q_pos.size(0) == b && q_pos.size(1) == t,
              "attention_backward: shapes (q_pos must be [B, T])");
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < b * t; ++i)
    TORCH_CHECK(pos[i] < s, "attention_backward: position ", pos[i], " outside the keys (", s, ")");
  auto dq = torch::zeros_like(q);
  auto dk = torch::zeros_like(k);
  auto dv = torch::zeros_like(v);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const int64_t group = hq / hkv;
  const float sc = static_cast<float>(scale);
  // Dot products of a against rows 0 .. n-1 (row i at rows(i)): eight at a time where the vector path is built.
  const auto dots = [d](const float* a, int64_t n, const auto& rows, float* out) {
    int64_t i = 0;
#if RLFW_AVX2
    for (; i + kLanes <= n; i += kLanes) {
      const float* b[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) b[l] = rows(i + l);
      dot8(a, b, d, out + i);
    }
#endif
    for (; i < n; ++i) out[i] = dot(a, rows(i), d);
  };
  const int64_t block = std::max<int64_t>(1, kBackwardFloats / std::max<int64_t>(1, group * s));  // tokens
  at::parallel_for(0, b * hkv, 1, [&](int64_t i0, int64_t i1) {
    const int64_t rows = std::min(block, t) * group;
    std::vector<float> p(rows * s), ds(rows * s), dp(s), wp(rows), wds(rows);
    std::vector<int64_t> n_of(rows);
    std::vector<const float*> q_of(rows), g_of(rows), qs(rows), gs(rows);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t bi = task / hkv, kvh = task % hkv;
      const int64_t row0 = bi * s * hkv * d + kvh * d, step = hkv * d;  // key i of this head: row0 + i * step
      const auto key = [&](int64_t i) { return kp + row0 + i * step; };
      const auto value = [&](int64_t i) { return vp + row0 + i * step; };
      for (int64_t t0 = 0; t0 < t; t0 += block) {
        const int64_t nr = (std::min(t, t0 + block) - t0) * group;
        int64_t nmax = 0;
        for (int64_t r = 0; r < nr; ++r) {  // row r: token t0 + r / group, head kvh * group + r % group
          const int64_t ti = t0 + r / group, h = kvh * group + r % group;
          const int64_t n = pos[bi * t + ti] + 1;
          n_of[r] = std::max<int64_t>(n, 0);
          if (n <= 0) continue;
          nmax = std::max(nmax, n);
          const int64_t at_q = ((bi * t + ti) * hq + h) * d;
          const float* qr = q_of[r] = qp + at_q;
          const float* gr = g_of[r] = gp + at_q;
          float* pr = p.data() + r * s;
          float* dsr = ds.data() + r * s;
          dots(qr, n, key, pr);
          float m = -INFINITY;
          for (int64_t i = 0; i < n; ++i) m = std::max(m, pr[i] *= sc);
          exp_shifted(pr, n, m);
          float total = 0.0f;
          for (int64_t i = 0; i < n; ++i) total += pr[i];
          dots(gr, n, value, dp.data());
          float mean_dp = 0.0f;
          for (int64_t i = 0; i < n; ++i) mean_dp += (pr[i] /= total) * dp[i];
          for (int64_t i = 0; i < n; ++i) dsr[i] = sc * pr[i] * (dp[i] - mean_dp);
          chain_rows(dsr, 0, n, key, d, dqp + at_q);
        }
        for (int64_t i = 0; i < nmax; ++i) {  // key i: the block's rows that see it, in order
          int64_t count = 0;
          for (int64_t r = 0; r < nr; ++r) {
            if (n_of[r] <= i) continue;
            wds[count] = ds[r * s + i];
            wp[count] = p[r * s + i];
            qs[count] = q_of[r];
            gs[count] = g_of[r];
            ++count;
          }
          const int64_t at_kv = row0 + i * step;
          chain_rows(wds.data(), 0, count, [&](int64_t c) { return qs[c]; }, d, dkp + at_kv);
          chain_rows(wp.data(), 0, count, [&](int64_t c) { return gs[c]; }, d, dvp + at_kv);
        }
      }
    }
  });
  return {dq, dk, dv};
}
