// The native engine's seeded Gumbel noise, one row per draw.
//
// Row i depends on seeds[i] alone: element j is SplitMix64's (j + 1)-th output from state seeds[i], its top
// 52 bits make u = (bits + 0.5) / 2^52 in (0, 1) (never 0 or 1), and the noise is -log(-log(u)) in double,
// rounded to float once. One thread computes a row, with the C library's log, so the bits depend on the
// seed alone (not on the batch, the thread count or the build).

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

torch::Tensor gumbel(const torch::Tensor& seeds, int64_t vocab) {
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1 && seeds.device().is_cpu(),
              "gumbel: seeds must be a 1-d int64 CPU tensor");
  TORCH_CHECK(vocab >= 0, "gumbel: vocab must be non-negative");
  const auto s = seeds.contiguous();
  const int64_t rows = s.size(0);
  auto out = torch::empty({rows, vocab}, torch::TensorOptions().dtype(at::kFloat));
  const int64_t* sd = s.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint64_t state = static_cast<uint64_t>(sd[r]);
      float* row = o + r * vocab;
      for (int64_t j = 0; j < vocab; ++j) {
        state += kGolden;
        const double u = (static_cast<double>(mix(state) >> 12) + 0.5) * 0x1p-52;
        row[j] = static_cast<float>(-std::log(-std::log(u)));
      }
    }
  });
  return out;
}

// The Gumbel-max draw of each row, argmax_j fl(x_j + fl(noise_j)) with ties to the lowest j: the token
// `torch.argmax(x + gumbel(seeds, vocab))` gives, without the two C-library logs for every entry.
//
// A first pass bounds every entry's value with a cheap log (a series in (m - 1) / (m + 1), absolute error
// under 1e-10 here) and margins for the two float roundings; only the entries whose upper bound reaches
// the largest lower bound can win, and those (a handful: the rest are far below the best) are evaluated
// exactly as `gumbel` does. The winner is always among them, so the token is the exact one. A row holding
// a NaN returns -1 (the caller takes the exact path, where torch's argmax decides).
namespace {

inline double series_log(double x) {  // x > 0, normal, finite
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int64_t e = static_cast<int64_t>((bits >> 52) & 0x7ff) - 1023;
  const uint64_t mbits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
  double m;
  std::memcpy(&m, &mbits, sizeof m);  // x = m 2^e, m in [1, 2)
  const bool high = m > 1.4142135623730951;
  m = high ? 0.5 * m : m;
  e = high ? e + 1 : e;
  const double s = (m - 1.0) / (m + 1.0), s2 = s * s;  // |s| <= 0.1716
  const double p =
      2.0 + s2 * (2.0 / 3 + s2 * (2.0 / 5 + s2 * (2.0 / 7 + s2 * (2.0 / 9 + s2 * (2.0 / 11 + s2 * (2.0 / 13))))));
  return s * p + static_cast<double>(e) * 0.69314718055994530942;
}

inline double uniform(uint64_t seed, int64_t j) {
  return (static_cast<double>(mix(seed + static_cast<uint64_t>(j + 1) * kGolden) >> 12) + 0.5) * 0x1p-52;
}

constexpr int64_t kBlock = 256;

int64_t draw_row(const float* x, int64_t vocab, uint64_t seed, std::vector<int64_t>& candidates) {
  candidates.clear();
  double best_low = -INFINITY;
  double low[kBlock], high[kBlock];
  bool nan = false;
  for (int64_t j0 = 0; j0 < vocab; j0 += kBlock) {
    const int64_t n = std::min(kBlock, vocab - j0);
    double block_low = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {  // vectorised: no branch, no reduction
      const double xi = static_cast<double>(x[j0 + i]);
      const double g = -series_log(-series_log(uniform(seed, j0 + i)));
      const double a = xi + g;
      // |value - a| <= the approximation (1e-10) + the float roundings of the noise and the sum (2^-24 each)
      const double margin = 1e-9 + 1.2e-7 * (std::fabs(g) + std::fabs(a));
      const double m = std::fabs(a) <= 1.7976931348623157e308 ? margin : 0.0;  // an infinite a is exact
      low[i] = a - m;
      high[i] = a + m;
    }
    for (int64_t i = 0; i < n; ++i) {
      nan += x[j0 + i] != x[j0 + i];
      block_low = std::max(block_low, low[i]);
    }
    best_low = block_low > best_low ? block_low : best_low;
    for (int64_t i = 0; i < n; ++i) {
      if (high[i] >= best_low) candidates.push_back(j0 + i);
    }
  }
  if (nan) return -1;
  int64_t arg = -1;
  float best = 0.0f;
  for (const int64_t j : candidates) {
    const float noise = static_cast<float>(-std::log(-std::log(uniform(seed, j))));
    const float v = x[j] + noise;
    if (arg < 0 || v > best) {  // ascending j: a tie keeps the lower id
      best = v;
      arg = j;
    }
  }
  return arg < 0 ? 0 : arg;
}

}  // namespace

torch::Tensor gumbel_argmax(const torch::Tensor& logits, const torch::Tensor& seeds) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.device().is_cpu(),
              "gumbel_argmax: logits must be a 2-d fp32 CPU tensor");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1 && seeds.size(0) == logits.size(0),
              "gumbel_argmax: seeds must be int64 [rows]");
  const auto x = logits.contiguous();
  const auto s = seeds.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = torch::empty({rows}, torch::TensorOptions().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const int64_t* sd = s.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> candidates;
    for (int64_t r = r0; r < r1; ++r) {
      o[r] = vocab == 0 ? 0 : draw_row(xp + r * vocab, vocab, static_cast<uint64_t>(sd[r]), candidates);
    }
  });
  return out;
}

// The k largest entries of each row, largest first, ties to the lower id: the first k of a stable
// descending sort. One pass keeps the k best seen so far, ordered by (value descending, id ascending); an
// entry enters only if it is strictly larger than the worst kept one (an equal one has a higher id and
// loses the tie), so most entries cost one compare. Rows holding a NaN (which torch's sort places first)
// return id -1 in their first column: the caller sorts those itself.
namespace {

constexpr int64_t kScan = 64;

bool topk_row(const float* x, int64_t vocab, int64_t k, int64_t* ids, float* vals) {
  // kept[0 .. k) in ascending rank: kept[0] is the worst (smallest value, then highest id)
  std::vector<std::pair<float, int64_t>> kept;
  kept.reserve(k);
  const auto worse = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);  // a ranks below b
  };
  for (int64_t j = 0; j < k; ++j) {
    if (x[j] != x[j]) return false;
    kept.emplace_back(x[j], j);
  }
  std::sort(kept.begin(), kept.end(), worse);
  float floor = kept[0].first;
  for (int64_t j0 = k; j0 < vocab; j0 += kScan) {
    const int64_t n = std::min(kScan, vocab - j0);
    int64_t enters = 0, nan = 0;
    for (int64_t i = 0; i < n; ++i) {  // vectorised: two counts
      enters += x[j0 + i] > floor;
      nan += x[j0 + i] != x[j0 + i];
    }
    if (nan) return false;
    if (!enters) continue;
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[j0 + i];
      if (!(v > floor)) continue;
      // drop the worst, insert (v, j) at its rank (ids ascend, so an equal value ranks below the kept one)
      int64_t at = 0;
      while (at + 1 < k && !worse(std::make_pair(v, j0 + i), kept[at + 1])) {
        kept[at] = kept[at + 1];
        ++at;
      }
      kept[at] = std::make_pair(v, j0 + i);
      floor = kept[0].first;
    }
  }
  for (int64_t r = 0; r < k; ++r) {
    ids[r] = kept[k - 1 - r].second;
    vals[r] = kept[k - 1 - r].first;
  }
  return true;
}

}  // namespace

std::vector<torch::Tensor> stable_topk(const torch::Tensor& values, int64_t k) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.dim() == 2 && values.device().is_cpu(),
              "stable_topk: values must be a 2-d fp32 CPU tensor");
  const auto x = values.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(k >= 1 && k <= vocab, "stable_topk: k must be in [1, vocab]");
  auto ids = torch::empty({rows, k}, torch::TensorOptions().dtype(at::kLong));
  auto vals = torch::empty({rows, k}, torch::TensorOptions().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* vp = vals.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (!topk_row(xp + r * vocab, vocab, k, ip + r * k, vp + r * k)) ip[r * k] = -1;
    }
  });
  return {ids, vals};
}
