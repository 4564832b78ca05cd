"""How close the compiled linear comes to one core's fp32 peak.

The peak: 24 independent chains of 16-lane fmas (or, without AVX-512, 12 chains of 8 lanes: 24 would
not fit AVX2's 16 registers and the loop would time spills), all in registers, compiled here with -O3
-march=native (the kernels' target), so it counts what the core can issue and nothing about memory.
Then the packed linear (what an engine runs between weight updates) and torch's ``x @ w.T`` on the 13M
and 76M models' shapes, one thread: medians of ``--reps`` rounds, each round running the peak, the packed
linear and torch's once (``paired.alternated_medians``), so that machine noise hits all three alike and
each shape's share of peak compares timings of the same minutes. The output names the CPU and its vector
width: the same code runs 8-lane (AVX2) or 16-lane (AVX-512) blocks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/linear_peak.py
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import machine  # noqa: E402
from paired import alternated_medians  # noqa: E402

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
constexpr int kChains = 24;  // of 32 vector registers
#else
using vec = __m256;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
constexpr int kLanes = 8;
constexpr int kChains = 12;  // of 16: more would spill to memory and time loads and stores
#endif
int fma_lanes() { return kLanes; }
int fma_chains() { return kChains; }
// GFLOP/s of `iters` rounds of kChains independent fma chains (2 flops per lane per fma): enough chains to
// cover the fma latency on every port, all in registers.
double fma_peak(int64_t iters) {
  vec a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = SET1(i * 1e-3f);
  const vec b = SET1(0.999f), c = SET1(1e-4f);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) a[i] = FMA(a[i], b, c);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink[kLanes];
  for (int i = 1; i < kChains; ++i) a[0] = FMA(a[0], b, a[i]);
  STORE(sink, a[0]);
  return iters * double(kChains) * kLanes * 2 / s / 1e9 + 0.0 * sink[0];
}
"""

SHAPES = {  # (rows, K, N): a decode step of 64 sequences and a 4160-token rescoring, per weight
    "13m": [(64, 512, 1536), (4160, 512, 1536), (64, 1536, 512), (4160, 1536, 512)],
    "76m": [(64, 768, 2304), (4160, 768, 2304), (64, 2304, 768), (4160, 2304, 768)],
}


PEAK_ITERS = 4_000_000  # about 10 ms of fmas: one round's peak takes as long as a mid-sized linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    flags = ["-O3", "-march=native"]
    peak_mod = load_inline(
        "rlfw_fma_peak",
        cpp_sources=PEAK_SOURCE + "\ndouble fma_peak(int64_t iters);\nint fma_lanes();\nint fma_chains();",
        functions=["fma_peak", "fma_lanes", "fma_chains"],
        extra_cflags=flags,
        verbose=False,
    )
    lanes = peak_mod.fma_lanes()
    peak_flop = PEAK_ITERS * float(peak_mod.fma_chains()) * lanes * 2
    native = cpu_native.module()
    rows = []
    for size, shapes in SHAPES.items():
        for m, k, n in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            panels = native.pack(w)
            flop = 2.0 * m * k * n
            t_peak, t_ours, t_torch = alternated_medians(
                [
                    functools.partial(peak_mod.fma_peak, PEAK_ITERS),
                    functools.partial(native.linear_packed, x, panels, n),
                    functools.partial(torch.matmul, x, w.T),
                ],
                args.reps,
            )
            peak, ours, theirs = peak_flop / t_peak / 1e9, flop / t_ours / 1e9, flop / t_torch / 1e9
            shape = {"model": size, "rows": m, "K": k, "N": n}
            rows.append(shape | {"fma_peak": peak, "rlfw_packed": ours, "torch": theirs})
            print(
                f"{size} [{m} x {k}] @ [{k} x {n}]: rlfw packed {ours:6.1f} GFLOP/s ({ours / peak:.0%} of "
                f"peak {peak:.1f}), torch {theirs:6.1f}"
            )
    out = {
        "machine": f"{machine.describe()}, {torch.get_num_threads()} thread, {lanes}-lane fma",
        "rows": rows,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
