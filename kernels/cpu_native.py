"""The C++ CPU kernels under ``kernels/csrc``, compiled once per machine and cached.

They exist where the invariant op must own its reduction order: a BLAS library chooses its own per
problem shape (a one-row GEMV against a blocked GEMM, narrow-output paths, split-K across threads), so an
invariant op built on it has to pad and tile around those choices and still trusts them. The compiled
kernel fixes the order of every element itself. The build uses the system C++ compiler (the one DeepSpeed
needs) through ``torch.utils.cpp_extension``; ``TORCH_EXTENSIONS_DIR`` holds the result, and
``scripts/env.sh`` builds it at install so no run or test pays for it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("module.cpp", "linear.cpp", "attention.cpp")]
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
"""``-march=native`` only decides speed (AVX2/FMA or the portable path): both paths compute the same
fma chains, and fma is exactly rounded, so every machine gets the same bits. ``-ffp-contract=off`` keeps
the compiler from fusing the fold's additions. ``-fopenmp``: ``at::parallel_for`` is inline in the
extension and runs its range on one thread unless the extension itself is built with OpenMP; with it,
the kernels use ``torch.get_num_threads()`` threads (each output element is still one thread's fma
chain, so the bits do not depend on the count: tested)."""
LDFLAGS = ["-fopenmp"]


@functools.cache
def module() -> Any:
    """The compiled extension (built on first use when the cache has none)."""
    from torch.utils.cpp_extension import load

    return load(
        name="rlfw_cpu_kernels",
        sources=[str(s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        verbose=False,
    )
