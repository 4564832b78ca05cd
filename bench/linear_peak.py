"""How close the compiled linear comes to one core's fp32 peak.

The peak: 24 independent chains of 16-lane (or, without AVX-512, 8-lane) fmas in registers, compiled
here with -O3 -march=native (the kernels' target), so it counts what the core can issue and nothing
about memory. Then the packed linear (what an engine runs between weight updates) and torch's ``x @ w.T``
on the 13M and 76M models' shapes, warm, one thread: medians of ``--reps`` runs, the two alternated
(``paired.paired_medians``) so that machine noise hits both alike. The peak is timed once, before them.

    OMP_NUM_THREADS=1 .venv/bin/python bench/linear_peak.py
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paired import paired_medians  # noqa: E402

from kernels import cpu_native  # noqa: E402

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#if defined(__AVX512F__)
using vec = __m512;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define STORE _mm512_storeu_ps
constexpr int kLanes = 16;
#else
using vec = __m256;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
constexpr int kLanes = 8;
#endif
// GFLOP/s of `iters` rounds of 24 independent fma chains (2 flops per lane per fma).
double fma_peak(int64_t iters) {
  vec a[24];
  for (int i = 0; i < 24; ++i) a[i] = SET1(i * 1e-3f);
  const vec b = SET1(0.999f), c = SET1(1e-4f);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) a[i] = FMA(a[i], b, c);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink[kLanes];
  for (int i = 1; i < 24; ++i) a[0] = FMA(a[0], b, a[i]);
  STORE(sink, a[0]);
  return iters * 24.0 * kLanes * 2 / s / 1e9 + 0.0 * sink[0];
}
"""

SHAPES = {  # (rows, K, N): a decode step of 64 sequences and a 4160-token rescoring, per weight
    "13m": [(64, 512, 1536), (4160, 512, 1536), (64, 1536, 512), (4160, 1536, 512)],
    "76m": [(64, 768, 2304), (4160, 768, 2304), (64, 2304, 768), (4160, 2304, 768)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    flags = ["-O3", "-march=native"]
    peak_mod = load_inline(
        "rlfw_fma_peak",
        cpp_sources=PEAK_SOURCE + "\ndouble fma_peak(int64_t iters);",
        functions=["fma_peak"],
        extra_cflags=flags,
        verbose=False,
    )
    peak = max(peak_mod.fma_peak(100_000_000) for _ in range(3))
    native = cpu_native.module()
    rows = []
    for size, shapes in SHAPES.items():
        for m, k, n in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            panels = native.pack(w)
            flop = 2.0 * m * k * n
            t_ours, t_torch = paired_medians(
                functools.partial(native.linear_packed, x, panels, n),
                functools.partial(torch.matmul, x, w.T),
                args.reps,
            )
            ours, theirs = flop / t_ours / 1e9, flop / t_torch / 1e9
            rows.append({"model": size, "rows": m, "K": k, "N": n, "rlfw_packed": ours, "torch": theirs})
            print(
                f"{size} [{m} x {k}] @ [{k} x {n}]: rlfw packed {ours:6.1f} GFLOP/s ({ours / peak:.0%} of "
                f"peak), torch {theirs:6.1f}"
            )
    print(f"fma peak, one core: {peak:.1f} GFLOP/s")
    out = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread",
        "fma_peak": peak,
        "rows": rows,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
