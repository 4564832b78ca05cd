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
import hashlib
import os
from pathlib import Path
from typing import Any

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in (
        "module.cpp",
        "linear.cpp",
        "attention.cpp",
        "elementwise.cpp",
        "sampling.cpp",
        "block.cpp",
        "softmax.cpp",
    )
]
HEADERS = [Path(__file__).with_name("csrc") / name for name in ("exp_f32.h", "exp_neg.h")]
"""Included by the sources: copied beside them and part of the build key, never compiled alone."""
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
"""``-march=native`` only decides speed (AVX2/FMA or the portable path): both paths compute the same
fma chains, and fma is exactly rounded, so every machine gets the same bits. ``-ffp-contract=off`` keeps
the compiler from fusing the fold's additions. ``-fopenmp``: ``at::parallel_for`` is inline in the
extension and runs its range on one thread unless the extension itself is built with OpenMP; with it,
the kernels use ``torch.get_num_threads()`` threads (each output element is still one thread's fma
chain, so the bits do not depend on the count: tested)."""
LDFLAGS = ("-fopenmp",)  # tuples: torch appends to the lists it is given


NAME = "rlfw_cpu_kernels"


def serves(*tensors: Any) -> bool:
    """Whether the compiled kernels take these operands as they are: fp32 tensors on CPU."""
    import torch

    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def build_key() -> str:
    """What the compiled module depends on: the sources' contents, the flags and the torch version."""
    import torch

    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(" ".join([*CFLAGS, *LDFLAGS, torch.__version__]).encode())
    return digest.hexdigest()[:16]


def build_folder() -> Path:
    """Where the extension is built: ``<TORCH_EXTENSIONS_DIR or torch's default>/rlfw_cpu_kernels-<key>``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"{NAME}-{build_key()}"


@functools.cache
def module() -> Any:
    """The compiled extension (built on first use when the cache has none).

    Built in ``<TORCH_EXTENSIONS_DIR>/rlfw_cpu_kernels-<build key>/`` from a copy of the sources kept
    there, so every copy of rlfw with the same sources (the checkout, an installed wheel, a Ray job's
    staged working dir) finds the same build instead of recompiling because its files live elsewhere.
    Builds are serialised by an ``flock`` on that folder, which the kernel releases if the builder dies;
    torch's own lock file (which a build killed midway leaves behind, making every later build wait
    forever) is therefore stale whenever this process holds the flock, and is removed.
    """
    import fcntl
    import shutil

    from torch.utils.cpp_extension import load

    build = build_folder()
    build.mkdir(parents=True, exist_ok=True)
    with (build / "build.flock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        sources = []
        for source in SOURCES + HEADERS:
            copy = build / "src" / source.name
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                copy.parent.mkdir(exist_ok=True)
                shutil.copyfile(source, copy)
            if source in SOURCES:
                sources.append(str(copy))
        (build / "lock").unlink(missing_ok=True)  # a dead build's baton: we hold the flock
        return load(
            name=NAME,
            sources=sources,
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build),
            verbose=False,
        )
