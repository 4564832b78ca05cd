"""The CPU kernels' two fp32 exps, on every one of the 2^32 floats.

The CPU kernels compute the attention's softmax exponentials and SiLU's with their own exp
(``kernels/csrc/exp_f32.h``), so that eight can run at once and the bits do not depend on the C library.
It was written to give the bits the attention had when it called ``std::exp`` (glibc's ``expf``); this
script checks that claim exhaustively: it compiles the header's exp section (from ``kExp2Table`` to the
end of its namespace) into a small C++ program with the kernels' build flags and compares both its scalar
and its eight-lane path (and, where the machine has AVX-512, its sixteen-lane path) with ``expf`` bit for
bit, NaN payloads included.

The log-softmax's sum takes ``exp_neg`` (``kernels/csrc/exp_neg.h``), an fp32 exp for differences that are
never positive. The second program checks that its scalar, eight-lane and sixteen-lane paths give the same
bits on every float, and that on each float of [-87, 0] it is within one unit in the last place of exp
(the correctly rounded value: the double exp of the float, rounded to fp32). About 90 s on one core.

    .venv/bin/python bench/exp_exhaustive.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from rlfw.kernels.cpu_native import CFLAGS, LDFLAGS

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "exp_f32.h"
FIRST, END = "constexpr uint64_t kExp2Table", "}  // namespace rlfw_exp"

HARNESS = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <immintrin.h>
#define RLFW_AVX2 1
constexpr int64_t kExpLanes = 8;
%(section)s
int main() {
  long bad_scalar = 0, bad_vector = 0, bad_wide = 0;
  alignas(64) float xs[16], ys[16], zs[16];
  for (uint64_t u = 0; u < (1ULL << 32); u += 16) {
    for (int k = 0; k < 16; ++k) { uint32_t b = (uint32_t)(u + k); std::memcpy(&xs[k], &b, 4); }
    _mm256_store_ps(ys, exp8(_mm256_load_ps(xs)));
    _mm256_store_ps(ys + 8, exp8(_mm256_load_ps(xs + 8)));
#if RLFW_EXP16
    _mm512_store_ps(zs, exp16(_mm512_load_ps(xs)));
#else
    std::memcpy(zs, ys, sizeof zs);
#endif
    for (int k = 0; k < 16; ++k) {
      volatile float x = xs[k];
      const float ref = expf(x), one = exp_f32(xs[k]);
      uint32_t a, b, c, d;
      std::memcpy(&a, &ref, 4); std::memcpy(&b, &one, 4);
      std::memcpy(&c, &ys[k], 4); std::memcpy(&d, &zs[k], 4);
      const unsigned at = (unsigned)(u + k);
      if (a != b && bad_scalar++ < 5) std::printf("scalar at %%08x: expf %%08x, kernel %%08x\n", at, a, b);
      if (a != c && bad_vector++ < 5) std::printf("vector at %%08x: expf %%08x, kernel %%08x\n", at, a, c);
      if (a != d && bad_wide++ < 5) std::printf("16-lane at %%08x: expf %%08x, kernel %%08x\n", at, a, d);
    }
  }
  std::printf("all 2^32 floats: scalar path differs on %%ld, eight-lane path on %%ld, "
              "sixteen-lane path%%s on %%ld\n",
              bad_scalar, bad_vector, RLFW_EXP16 ? "" : " (not compiled: the eight-lane's)", bad_wide);
  return bad_scalar || bad_vector || bad_wide;
}
"""


NEG_HARNESS = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include "exp_neg.h"
using namespace rlfw_exp_neg;
int main() {
  long bad_vector = 0, bad_wide = 0, over = 0, checked = 0;
  int64_t worst = 0;
  alignas(64) float xs[16], ys[16], zs[16];
  for (uint64_t u = 0; u < (1ULL << 32); u += 16) {
    for (int k = 0; k < 16; ++k) { uint32_t b = (uint32_t)(u + k); std::memcpy(&xs[k], &b, 4); }
#if defined(__AVX2__) && defined(__FMA__)
    _mm256_store_ps(ys, exp_neg8(_mm256_load_ps(xs)));
    _mm256_store_ps(ys + 8, exp_neg8(_mm256_load_ps(xs + 8)));
#else
    for (int k = 0; k < 16; ++k) ys[k] = exp_neg(xs[k]);
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__)
    _mm512_store_ps(zs, exp_neg16(_mm512_load_ps(xs)));
#else
    std::memcpy(zs, ys, sizeof zs);
#endif
    for (int k = 0; k < 16; ++k) {
      const float one = exp_neg(xs[k]);
      uint32_t b, c, d;
      std::memcpy(&b, &one, 4); std::memcpy(&c, &ys[k], 4); std::memcpy(&d, &zs[k], 4);
      const unsigned at = (unsigned)(u + k);
      if (b != c && bad_vector++ < 5) std::printf("eight-lane at %08x: scalar %08x, vector %08x\n", at, b, c);
      if (b != d && bad_wide++ < 5) std::printf("16-lane at %08x: scalar %08x, vector %08x\n", at, b, d);
      if (xs[k] >= -87.0f && xs[k] <= 0.0f) {
        const float exact = (float)std::exp((double)xs[k]);
        uint32_t e;
        std::memcpy(&e, &exact, 4);
        const int64_t ulps = std::llabs((int64_t)b - (int64_t)e);
        ++checked;
        if (ulps > 1 && over++ < 5) std::printf("at %08x: %lld ulp from exp\n", at, (long long)ulps);
        if (ulps > worst) worst = ulps;
      }
    }
  }
  std::printf("exp_neg, all 2^32 floats: the eight-lane path differs from the scalar on %ld, the "
              "sixteen-lane path on %ld; on the %ld floats of [-87, 0] at most %lld ulp from exp\n",
              bad_vector, bad_wide, checked, (long long)worst);
  return bad_vector || bad_wide || over;
}
"""


def main() -> int:
    text = SOURCE.read_text()
    section = text[text.index(FIRST) : text.index(END)]
    with tempfile.TemporaryDirectory() as folder:
        src, exe = Path(folder) / "exp_check.cpp", Path(folder) / "exp_check"
        src.write_text(HARNESS % {"section": section})
        subprocess.run(["g++", *CFLAGS, str(src), "-o", str(exe), "-lm", *LDFLAGS], check=True)
        expf = subprocess.run([str(exe)], check=False).returncode
        src.write_text(NEG_HARNESS)
        include = f"-I{SOURCE.parent}"
        subprocess.run(["g++", *CFLAGS, include, str(src), "-o", str(exe), "-lm", *LDFLAGS], check=True)
        return expf or subprocess.run([str(exe)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
