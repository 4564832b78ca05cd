// The native engine's seeded Gumbel noise, one row per draw.
//
// Row i depends on seeds[i] alone: element j is SplitMix64's (j + 1)-th output from state seeds[i], its top
// 52 bits make u = (bits + 0.5) / 2^52 in (0, 1) (never 0 or 1), and the noise is -log(-log(u)) in double,
// rounded to float once. One thread computes a row, with the C library's log, so the bits depend on the
// seed alone (not on the batch, the thread count or the build).

#include <torch/extension.h>

#include <cmath>
#include <cstdint>

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
